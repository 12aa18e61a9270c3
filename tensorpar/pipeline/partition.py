"""Which blocks each pipeline stage holds, and which stages each pipeline rank runs."""

from __future__ import annotations

from ..checks import check_int
from ..sharding import partition_offsets, partition_sizes


def stage_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """The blocks of each of ``n_stages`` stages: balanced runs of whole blocks, the longer runs first.

    Example::

        >>> stage_blocks(5, 2)
        [range(0, 3), range(3, 5)]
    """
    check_int(n_blocks, "n_layer")
    check_int(n_stages, "pipeline stages")
    if n_blocks < n_stages:
        raise ValueError(f"n_layer ({n_blocks}) is smaller than the number of pipeline stages ({n_stages})")
    sizes = partition_sizes(n_blocks, n_stages, name="n_layer")
    return [range(o, o + s) for o, s in zip(partition_offsets(n_blocks, n_stages, name="n_layer"), sizes, strict=True)]


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, of ``pp * stages_per_rank``: stage ``s`` runs on
    rank ``s % pp`` (looped, as torch's interleaved schedules place them).

    Example::

        >>> rank_stages(1, pp=2, stages_per_rank=2)
        [1, 3]
    """
    check_int(pp, "pp")
    check_int(stages_per_rank, "stages_per_rank")
    check_int(pp_rank, "pp_rank", minimum=0)
    if pp_rank >= pp:
        raise ValueError(f"pp_rank ({pp_rank}) is out of range for pp ({pp})")
    return [pp_rank + k * pp for k in range(stages_per_rank)]
