"""One training (or evaluation) step of a pipeline, through a schedule of ``torch.distributed.pipelining``.

A rank runs one stage (GPipe, 1F1B) or several (interleaved 1F1B). The batch is cut into ``microbatches``
equal micro-batches along dim 0, each loss divided by their number: the gradients are the whole batch's
mean loss's, accumulating over calls. The step's loss comes back on every rank of the pipeline.

Stages are built with their inputs' and outputs' shapes (``stage_shapes``), so torch never infers them by unpickling.

Each stage measures itself (:class:`StageTimes`); with ``timed=True`` the stages start each step together
(a barrier), so that every stage's wall time spans the whole step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_int
from ..mesh import Mesh, current_mesh

SCHEDULES = ("gpipe", "1f1b", "interleaved")

#: ``stage_shapes(stage, micro)``: stage ``stage``'s example input and output (meta tensors of the shape,
#: dtype and layout it takes and returns) for a micro-batch ``micro`` of the first stage's input (a meta tensor),
#: under the autocast state in force when it is called.
StageShapes = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StageTimes:
    """What stage ``stage`` did since the last reset: ``busy`` seconds in its forward and backward chunks of
    ``wall`` seconds of steps (``idle_fraction``: the rest, waiting for neighbours: the bubble), and
    ``peak_in_flight``, the most micro-batches whose forward had run and whose backward had not."""

    stage: int
    busy: float = 0.0
    wall: float = 0.0
    peak_in_flight: int = 0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy / self.wall if self.wall > 0 else 0.0


def _timed_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A ``PipelineStage`` that counts its compute time and in-flight micro-batches."""

        busy = 0.0
        peak = 0

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - began
                self.peak = max(self.peak, len(self.fwd_cache))  # forwards awaiting their backward

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return super().backward_one_chunk(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - began

    return TimedStage


class Pipeline:
    """Run ``modules`` (this rank's stages, numbered ``stages`` of ``mesh.pp * len(modules)``) as one
    pipeline over ``mesh.pp_group`` with the schedule ``schedule``.

    ``stage_shapes``: see :data:`StageShapes`. ``loss_fn(output, target)`` is one micro-batch's mean loss;
    ``check_inputs(inputs, target)`` raises for a batch the model cannot take, on every rank before any
    starts (give every rank the batch); ``after_backward()`` runs on every rank after each training
    step's last backward (to sum the gradients of weights shared between stages, say). :meth:`step` and
    :meth:`evaluate` return the batch's mean loss, float64, on every rank. A module may be wrapped in DDP or
    be an FSDP2 module: the schedule reduces its gradients over dp after the step's last backward.

    Example::

        mesh = tensorpar.init(tp=2, pp=2)
        pipe = Pipeline([stage_module], [mesh.pp_rank], schedule="1f1b", microbatches=4, loss_fn=loss_fn,
                        stage_shapes=lambda stage, micro: (torch.empty_like(micro), torch.empty_like(micro)))
        loss = pipe.step(idx, targets)        # forward and backward of the whole batch, then optimizer.step()
    """

    def __init__(self, modules: Sequence[nn.Module], stages: Sequence[int], mesh: Mesh | None = None, *,
                 schedule: str = "1f1b", microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], stage_shapes: StageShapes,
                 check_inputs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 after_backward: Callable[[], None] | None = None, timed: bool = False) -> None:
        self.mesh = mesh = mesh or current_mesh()
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        check_int(microbatches, "microbatches")
        if len(modules) != len(stages) or not modules:
            raise ValueError(f"{len(modules)} stage modules for {len(stages)} stage indices")
        if schedule != "interleaved" and len(modules) != 1:
            raise ValueError(f"the {schedule} schedule runs one stage per rank, got {len(modules)}: "
                             "use schedule='interleaved' for several")
        self.n_stages = mesh.pp * len(modules)
        if schedule == "1f1b" and microbatches < mesh.pp:
            raise ValueError(f"the 1f1b schedule needs at least as many micro-batches as stages: "
                             f"microbatches ({microbatches}) is smaller than pp ({mesh.pp})")
        if schedule == "interleaved" and microbatches % max(1, microbatches // mesh.pp):
            raise ValueError(f"interleaved 1F1B runs the micro-batches in rounds of pp ({mesh.pp}): "
                             f"microbatches ({microbatches}) is not a multiple of {microbatches // mesh.pp}")
        self.schedule_name, self.microbatches = schedule, microbatches
        self.modules, self.stage_ids = list(modules), list(stages)
        self._loss_fn, self._check, self._after_backward = loss_fn, check_inputs, after_backward
        self._stage_shapes, self._scale, self.timed = stage_shapes, 1.0, timed
        self._schedules: dict[tuple[Any, ...], tuple[Any, list[Any]]] = {}
        self.reset_times()

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # summed over the micro-batches: the mean (times the step's loss_scale)
        return self._loss_fn(output, target) * (self._scale / self.microbatches)

    def _schedule(self, inputs: torch.Tensor, train: bool) -> tuple[Any, list[Any]]:
        """The schedule (and its stages) for batches like ``inputs``: one per batch layout and autocast state."""
        device = self.mesh.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        key = (train, tuple(inputs.shape), inputs.stride(), inputs.dtype, autocast)
        if key not in self._schedules:
            first = inputs.tensor_split(self.microbatches)[0]  # the schedule's first micro-batch: a view, as here
            micro = torch.empty_strided(first.shape, first.stride(), dtype=inputs.dtype, device="meta")
            stage_class = _timed_stage_class()
            stages = []
            for module, s in zip(self.modules, self.stage_ids, strict=True):
                given, made = self._stage_shapes(s, micro)
                # as torch's own inference marks them: gradients flow back through what stages pass on
                example_input = given.detach().requires_grad_(train and s > 0 and given.is_floating_point())
                example_output = made.detach().requires_grad_(train and made.is_floating_point())
                stages.append(stage_class(module, s, self.n_stages, self.mesh.device, input_args=example_input,
                                          output_args=example_output, group=self.mesh.pp_group))
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

            cls: type = (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)[SCHEDULES.index(self.schedule_name)]
            scheduled = stages if self.schedule_name == "interleaved" else stages[0]
            self._schedules[key] = (cls(scheduled, self.microbatches, loss_fn=self._loss, scale_grads=False), stages)
        return self._schedules[key]

    def _run(self, inputs: torch.Tensor, target: torch.Tensor, *, train: bool, loss_scale: float = 1.0) -> torch.Tensor:
        for name, value in (("inputs", inputs), ("target", target)):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise TypeError(f"{name} must be a batched tensor, got {value!r:.80}")
            if value.shape[0] % self.microbatches:
                raise ValueError(f"the batch of {value.shape[0]} rows ({name}) does not split into "
                                 f"microbatches ({self.microbatches}) of equal size")
        if self._check is not None:
            self._check(inputs, target)
        schedule, stages = self._schedule(inputs, train)
        self._scale = loss_scale
        args = (inputs,) if 0 in self.stage_ids else ()  # the first stage takes the batch, the last the target
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.n_stages - 1 in self.stage_ids else {}
        if self.timed:  # the stages start together, so each one's wall time spans the whole pipeline's step
            dist.barrier(group=self.mesh.pp_group)
        began = time.perf_counter()
        if train:
            schedule.step(*args, return_outputs=False, **kwargs)
            if self._after_backward is not None:
                self._after_backward()
        else:
            with torch.no_grad():
                schedule.eval(*args, **kwargs)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if losses:
            total += torch.stack([loss.detach().double() for loss in losses]).sum()
        if self.mesh.pp > 1:  # the last stage's loss, to every stage (and the stages end together)
            dist.all_reduce(total, group=self.mesh.pp_group)
        wall = time.perf_counter() - began
        for stage in stages:
            times = self._times.setdefault(stage.stage_index, StageTimes(stage.stage_index))
            times.busy, times.wall = times.busy + stage.busy, times.wall + wall
            times.peak_in_flight, stage.busy, stage.peak = max(times.peak_in_flight, stage.peak), 0.0, 0
        return total

    def step(self, inputs: torch.Tensor, target: torch.Tensor, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of the whole batch; the mean loss on every rank of the pipeline.
        ``loss_scale`` multiplies the loss, and so the gradients (``1 / accumulation steps``, say)."""
        return self._run(inputs, target, train=True, loss_scale=loss_scale)

    def evaluate(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss, forward only, on every rank of the pipeline."""
        return self._run(inputs, target, train=False)

    def times(self) -> list[StageTimes]:
        """This rank's stages' measurements since the last :meth:`reset_times`."""
        return [replace(t) for _, t in sorted(self._times.items())]

    def reset_times(self) -> None:
        self._times: dict[int, StageTimes] = {}
