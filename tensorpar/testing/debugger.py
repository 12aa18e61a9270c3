"""The equivalence debugger: where does a sharded model first differ from its dense twin?

Hooks on every submodule name both models share record each call's output (forward order) and its
output and input gradients (backward order: an output's when backward reaches the module, an input's
when it leaves). Before comparing, the ranks agree on the sequence of hooks that fired (a hash
exchange), so a fault that changes control flow on one rank raises there instead of a hang.

A tensor whose ranks' copies sum to the dense one (a partial sum: a vocab-parallel embedding's
unreduced lookup, the input gradient of a column layer whose ``f`` is shared) is a divergence only if
the next diverging tensor comes before any that matches: when one matches first, a module the dense
twin lacks (an ``f`` or ``g``) summed the partial results, as designed. A partial sum that a module
elsewhere reduces can hide a fault in between.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..bitwise.settings import Bitwise
from ..full import placements
from ..mesh import group_rank_size, tp_group
from ..world import collective_device, exchange_ints
from .divergence import Item, classify, diagnose, gathered, parameter_items
from .findings import DivergenceReport, Finding

#: ``(module name, call, [(slot, tensor or None), ...])`` in the order the hooks fired
Record = tuple[str, int, list[tuple[str, torch.Tensor | None]]]


def _slots(prefix: str, value: Any) -> list[tuple[str, torch.Tensor | None]]:
    """The tensors of a module's output (or of a gradient tuple), each named by its place."""
    if isinstance(value, torch.Tensor) or value is None:
        return [(prefix, value)]
    if isinstance(value, Mapping):
        return [(f"{prefix}[{k}]", v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    if isinstance(value, (tuple, list)):
        if len(value) == 1:
            return _slots(prefix, value[0])
        return [(f"{prefix}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor) or v is None]
    return []


@contextmanager
def _recording(model: nn.Module, names: set[str]) -> Iterator[tuple[list[Record], list[Record]]]:
    """Hooks on the submodules ``names`` of ``model``: yields (forward, backward) records, filled as it runs."""
    forward: list[Record] = []
    backward: list[Record] = []
    calls: Counter[tuple[str, str]] = Counter()

    def on(name: str, slot: str, records: list[Record]) -> Callable[..., None]:
        def hook(module: nn.Module, *args: Any) -> None:  # (inputs, output), (grad_input, _) or (grad_output,)
            tensors = _slots(slot, args[1] if slot == "output" else args[0])
            records.append((name, calls[name, slot], [(s, None if t is None else t.detach().clone())
                                                      for s, t in tensors]))
            calls[name, slot] += 1
        return hook

    handles = []
    for name, module in model.named_modules():
        if name in names:
            handles += [module.register_forward_hook(on(name, "output", forward)),
                        module.register_full_backward_pre_hook(on(name, "output gradient", backward)),
                        module.register_full_backward_hook(on(name, "input gradient", backward))]
    try:
        with warnings.catch_warnings():  # hooks on modules without tensor inputs or outputs say so: expected here
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            yield forward, backward
    finally:
        for handle in handles:
            handle.remove()


def _agree_on_sequence(what: str, labels: Sequence[str], group: ProcessGroup, device: torch.device | None) -> None:
    """Raise the same rank-tagged ``RuntimeError`` on every rank unless all ranks recorded ``labels``."""
    def digest(text: str) -> int:
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)

    rank, _n = group_rank_size(group)
    everyone = exchange_ints([len(labels), digest("\n".join(labels))], group, device)
    if all(row == everyone[0] for row in everyone):
        return
    longest = max(row[0] for row in everyone)
    hashes = exchange_ints([digest(s) for s in labels] + [0] * (longest - len(labels)), group, device)
    at = next(i for i in range(longest) if len({row[i] for row in hashes}) > 1)
    counts = ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(everyone))
    here = labels[at] if at < len(labels) else "nothing"
    raise RuntimeError(f"rank {rank}: the ranks ran different {what} ({counts} hook calls); they first differ "
                       f"at call {at}, where this rank ran {here}: a fault changed control flow on some rank, "
                       "so no tensors are compared")


def _items(phase: str, sharded: list[Record], dense: list[Record], model: nn.Module) -> list[Item]:
    """The items of one pass, in the sharded model's order. Outputs (and their gradients) carry
    their module's blocked placements and, forward, its replicated bias (see :class:`Item`)."""
    found = {(name, call, slot): t for name, call, slots in dense for slot, t in slots}
    split = placements(model)
    items = []
    for name, call, slots in sharded:
        hints = tuple(p for key, (p, _) in split.items()  # its split parameters of several pieces (fused ones)
                      if key.rpartition(".")[0] == name and len(p.pieces(1, 0)) > 1)
        b = getattr(model.get_submodule(name), "bias", None)
        bias = b.detach() if isinstance(b, torch.Tensor) and (f"{name}.bias" if name else "bias") not in split \
            and phase == "forward output" else None
        for slot, t in slots:
            items.append(Item(name, phase, slot, t, found.get((name, call, slot)), call=call, bias=bias, any_dim=True,
                              hints=hints if slot.startswith("output") else ()))
    return items


def _labels(records: list[Record]) -> list[str]:
    return [f"{name or '<model>'}#{call}:{','.join(slot for slot, _ in slots)}" for name, call, slots in records]


def _first_in_order(items: list[Item], group: ProcessGroup) -> list[Finding]:
    """The findings of one pass: the first divergence diagnosed, the later ones marked downstream.
    Partial sums wait for the next non-partial tensor (see the module's docstring)."""
    pending: list[Finding] = []
    first: Finding | None = None
    found: list[Finding] = []
    downstream = functools.partial(dataclasses.replace, diagnosis=None, downstream=True)  # after the first, undiagnosed
    for item in items:
        if not item.diverging():
            if first is None:
                pending.clear()  # summed by a module the dense twin lacks: partial by design
            continue
        if first is not None:
            found.append(item.finding(downstream=True))
            continue
        diagnosis, partial = diagnose(item, group)
        finding = item.finding(diagnosis)
        if partial:
            pending.append(finding)
            continue
        first = pending[0] if pending else finding
        found += [first] + [downstream(f) for f in [*pending[1:], finding] if f is not first]
        pending.clear()
    if first is None and pending:
        found += [pending[0]] + [downstream(f) for f in pending[1:]]
    return found


def _backward(out_s: Any, out_d: Any, forward: list[Item], loss_fn: Callable[..., torch.Tensor] | None,
              target: Any, seed: int, group: ProcessGroup) -> str | None:
    """Backward through both models; a note instead when there is nothing to differentiate. An
    output split across ranks is gathered first, and its shard gets its part of the gradient."""
    root = next((i for i in forward if i.module == "" and i.call == 0 and i.what == "output"), None)
    shard = full = None
    if isinstance(out_s, torch.Tensor) and root is not None and root.kind == "sharded" and out_s.requires_grad:
        shard, out_s = out_s, gathered(root, group).requires_grad_()
        full = out_s  # the full output
    if loss_fn is not None:
        extra = () if target is None else (target,)
        out_d, out_s = loss_fn(out_d, *extra), loss_fn(out_s, *extra)
    elif not isinstance(out_d, torch.Tensor) or not isinstance(out_s, torch.Tensor):
        raise TypeError(f"the models return {type(out_d).__name__} and {type(out_s).__name__}, not tensors: "
                        "pass loss_fn= to reduce the output to a loss")
    if not (isinstance(out_d, torch.Tensor) and isinstance(out_s, torch.Tensor) and out_d.requires_grad
            and out_s.requires_grad and out_d.shape == out_s.shape):
        return "no backward pass: the outputs differ in shape or do not require a gradient"
    # a fixed random projection of the output (a sum would hide what a LayerNorm's gradient does)
    grad = torch.randn(out_d.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) \
        .to(out_d.dtype).to(out_d.device) if out_d.dim() else None
    out_d.backward(grad)
    out_s.backward(grad)
    if shard is not None and full is not None and root is not None and full.grad is not None:
        shard.backward(root.part(full.grad, group_rank_size(group)[0]))
    return None


def group_of_one() -> ProcessGroup:
    """A process group of this rank alone, for a twin built at tp = 1 beside a sharded model (every rank
    of the world calls it: creating groups is a collective), e.g. ``GPT(config, group=group_of_one())``."""
    return dist.new_subgroups(group_size=1)[0]  # (this rank's group, every rank's)


def find_divergence(sharded: nn.Module, dense: nn.Module, *inputs: Any,
                    loss_fn: Callable[..., torch.Tensor] | None = None, target: Any = None,
                    rtol: float | None = None, group: ProcessGroup | None = None, seed: int = 0) -> DivergenceReport:
    """Find where ``sharded`` first differs from ``dense``, its unsharded twin; a collective over the tp group,
    returning the same :class:`~tensorpar.testing.findings.DivergenceReport` on every rank.

    Both models get ``inputs`` (full, the same on every rank; floating-point ones cloned to require
    gradients). Compared: each call's output (a split one gathered), each call's output and input
    gradients after backward of ``loss_fn(output[, target])`` (on the full output), by default of the
    output itself when a scalar, else of a fixed random projection of it (from ``seed``); then every
    parameter and parameter gradient. Norm-wise relative tolerance ``rtol``, by default per dtype
    (:data:`~tensorpar.testing.TOLERANCES`). Both models' ``.grad`` are reset first and hold this
    backward's gradients after. Run it with dropout off (``model.eval()`` or ``p=0``).

    A sharded model built in bitwise mode (its ``numerics``, :mod:`tensorpar.bitwise`) is compared
    exactly (``rtol`` 0 unless given): its twin is the same model built in bitwise mode at tp = 1, on a
    group of this rank alone (:func:`group_of_one`), and any bit that differs is a divergence. Printed, the
    report names the first diverging module of each pass, and why: ``assert report.ok, report``.
    """
    if loss_fn is None and target is not None:
        raise ValueError("target= is given to loss_fn(output, target): pass loss_fn= too")
    split = placements(sharded)  # the group of the model's first split tensor, else the default mesh's tp group
    group = next(iter(split.values()))[1] if group is None and split else tp_group(group)
    device = collective_device(group)
    if rtol is None and isinstance(getattr(sharded, "numerics", None), Bitwise):
        rtol = 0.0  # the bitwise mode: the tp = 1 twin's bits exactly
    for p in [*sharded.parameters(), *dense.parameters()]:
        p.grad = None
    names = {name for name, _ in sharded.named_modules()} & {name for name, _ in dense.named_modules()}

    def fresh() -> list[Any]:
        return [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                for x in inputs]

    notes = []
    with torch.enable_grad(), _recording(dense, names) as (dense_fwd, dense_bwd), \
            _recording(sharded, names) as (fwd, bwd):
        out_d, out_s = dense(*fresh()), sharded(*fresh())
        _agree_on_sequence("forward passes", [*_labels(fwd), "|", *_labels(dense_fwd)], group, device)
        forward_items = _items("forward output", fwd, dense_fwd, sharded)
        classify(forward_items, group, rtol, device)
        forward = _first_in_order(forward_items, group)
        note = _backward(out_s, out_d, forward_items, loss_fn, target, seed, group)
        if note is None:
            _agree_on_sequence("backward passes", [*_labels(bwd), "|", *_labels(dense_bwd)], group, device)
        else:
            notes.append(note)
            bwd.clear()
        backward_items = _items("backward gradient", bwd, dense_bwd, sharded)
        classify(backward_items, group, rtol, device)
        backward = _first_in_order(backward_items, group)
    values, grads, unmatched = parameter_items(sharded, dense)
    classify(values + grads, group, rtol, device)
    tensors = [i.finding(diagnose(i, group)[0]) for i in values + grads if i.diverging()]
    if unmatched:
        notes.append(f"parameters only one model has (not compared): {', '.join(unmatched)}")
    odd = [f"{i.module or '<model>'} {i.what}" for i in forward_items + backward_items if i.kind == "unmatched"]
    if odd:
        notes.append(f"{len(odd)} tensors whose per-rank shapes are neither the dense shape nor a split of it "
                     f"(not compared): {', '.join(odd[:4])}" + (", ..." if len(odd) > 4 else ""))
    counted = {"forward output": forward_items, "backward gradient": backward_items, "parameter": values,
               "parameter gradient": grads}
    compared = {phase: sum(i.kind not in ("absent", "unmatched") for i in items) for phase, items in counted.items()}
    first_forward, first_backward = (next((f for f in found if not f.downstream), None)
                                     for found in (forward, backward))
    report = DivergenceReport(group_rank_size(group)[1], first_forward, first_backward,
                              tuple(forward + backward + tensors), compared, tuple(notes))
    sent = [report]  # rank 0's on every rank (a replicated bias that differs may change a diagnosis elsewhere)
    dist.broadcast_object_list(sent, src=dist.get_global_rank(group, 0), group=group, device=device)
    return sent[0]
