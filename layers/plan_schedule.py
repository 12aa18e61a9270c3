"""Which micro-batches a pipeline rank's stages hold in flight (forward run, backward not yet) over a step.

GPipe runs every forward before any backward; 1F1B lets stage ``s`` of ``pp`` run ``pp - s`` forwards ahead.
Interleaved 1F1B (several stages a rank, looped: stage ``j * pp + rank``) interleaves them by rounds of
micro-batches; its order is torch's own, taken from ``ScheduleInterleaved1F1B``'s computation of each rank's
actions (the same as the schedule runs) and followed action by action.
"""

from __future__ import annotations

import functools

from tensorpar.pipeline import rank_stages, stage_blocks

from .plan_layout import Layout

#: a moment of a rank's step: ``(stage, micro-batches in flight, forwards run so far)`` for each of its stages
#: (by global stage index)
InFlight = tuple[tuple[int, int, int], ...]


def stage_sizes(n_layer: int, layout: Layout, stage: int) -> dict[int, int]:
    """The blocks of each of pipeline rank ``stage``'s stages, by global stage index."""
    split = stage_blocks(n_layer, layout.pp * layout.stages_per_rank)
    return {i: len(split[i]) for i in rank_stages(stage, layout.pp, layout.stages_per_rank)}


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batches whose forward has run and whose backward has not, at a pipeline rank's fullest
    moment (all its stages together): one without a pipeline (accumulated micro-batches run one after the
    other), every one with GPipe, at most ``pp - stage`` with 1F1B, and with interleaved 1F1B the most its
    stages hold at once in torch's order (:func:`moments`)."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return layout.microbatches
    if layout.schedule == "interleaved":
        return max(sum(n for _, n, _ in moment) for moment in moments(layout, stage))
    return min(layout.microbatches, layout.pp - stage)


def moments(layout: Layout, stage: int) -> list[InFlight]:
    """After each forward of pipeline rank ``stage``'s step (the moments a stage's count grows), the
    micro-batches in flight on each of its stages and the forwards each has run: one moment for the schedules
    of one stage a rank (its fullest, :func:`in_flight`, counted with every forward of the step run), every
    forward's for interleaved 1F1B."""
    stages = rank_stages(stage, layout.pp, layout.stages_per_rank)
    if layout.pp == 1 or layout.schedule != "interleaved":
        return [((stages[0], in_flight(layout, stage), layout.microbatches),)]
    return list(_interleaved(layout.pp, layout.stages_per_rank, layout.microbatches, stage))


@functools.lru_cache(maxsize=64)
def _interleaved(pp: int, stages_per_rank: int, microbatches: int, rank: int) -> tuple[InFlight, ...]:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    # the schedule's order without its stages (which need a process group): the attributes its
    # _calculate_single_rank_operations reads, set as its __init__ sets them
    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    rounds = max(1, microbatches // pp)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, stages_per_rank, microbatches
    schedule.number_of_rounds, schedule.microbatches_per_round = rounds, microbatches // rounds
    stages = rank_stages(rank, pp, stages_per_rank)
    held, run = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
    found = []
    for action in schedule._calculate_single_rank_operations(rank):
        if action is None:
            continue
        if action.computation_type == _ComputationType.FORWARD:
            held[action.stage_index] += 1
            run[action.stage_index] += 1
            found.append(tuple((i, held[i], run[i]) for i in stages))
        elif action.computation_type == _ComputationType.FULL_BACKWARD:
            held[action.stage_index] -= 1
    return tuple(found)
