"""Pipeline parallelism over ``torch.distributed.pipelining``: balanced stages of whole blocks along the
mesh's ``pp`` dimension (stage ``s`` on pipeline rank ``s % pp``), schedules by name with the losses on
every rank, and stages that measure their idle time. Each stage is tensor-parallel inside."""

from .partition import rank_stages, stage_blocks
from .runner import SCHEDULES, Pipeline, StageTimes

__all__ = ["SCHEDULES", "Pipeline", "StageTimes", "rank_stages", "stage_blocks"]
