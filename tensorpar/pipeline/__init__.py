"""Pipeline parallelism over ``torch.distributed.pipelining``: balanced stages of whole blocks,
schedules by name (GPipe, 1F1B, interleaved 1F1B) with the losses on every rank, and a stage that
measures its own idle time and in-flight micro-batches.

Stages are laid out along the mesh's ``pp`` dimension: with ``v`` stages per rank (interleaved),
stage ``s`` of ``pp * v`` runs on pipeline rank ``s % pp``, as torch's interleaved schedules expect.
Each stage is tensor-parallel inside (its own tp group) and its dp replicas reduce their gradients
as usual (DDP, ZeRO or FSDP2 on the stage's module).
"""

from .partition import rank_stages, stage_blocks
from .runner import SCHEDULES, Pipeline, StageTimes

__all__ = ["SCHEDULES", "Pipeline", "StageTimes", "rank_stages", "stage_blocks"]
