"""Comparisons of sharded results against their dense twins, with norm-wise tolerances."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..full import full_grads, unshard
from ..mesh import current_mesh, group_rank_size
from ..sharding import Shard, shard

#: Norm-wise relative tolerances of a sharded result against its dense twin.
TOLERANCES: Mapping[torch.dtype, float] = MappingProxyType(
    {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2})


def rel_error(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """``‖actual − expected‖ / max(‖expected‖, scale)`` in float64 (absolute when both are zero). ``scale`` is
    for values whose true size is zero or near it, where any round-off is a large fraction of the value: e.g.
    one gradient measured against the norm of the whole model's gradient."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape {tuple(a.shape)} does not match the expected {tuple(e.shape)}")
    norm = max(e.norm().item(), scale)
    return (a - e).norm().item() / (norm if norm > 0 else 1.0)


def tolerance(dtype: torch.dtype, rtol: float | None = None) -> float:
    """``rtol``, else the default of ``dtype`` (bfloat16's for other low-precision floats; exact for the rest)."""
    if rtol is not None:
        return rtol
    return TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16] if dtype.is_floating_point else 0.0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float | None = None, name: str = "",
                 scale: float = 0.0) -> float:
    """Raise unless the norm-wise relative error (see :func:`rel_error`) is within ``rtol``
    (default: by dtype); return it."""
    rtol = tolerance(expected.dtype, rtol)
    err = rel_error(actual, expected, scale)
    if not err <= rtol:
        raise AssertionError(f"{name or 'tensor'}: relative error {err:.3g} exceeds {rtol:.1g} ({expected.dtype})")
    return err


def assert_sharded_equivalent(sharded: nn.Module, dense: nn.Module, x: torch.Tensor, *,
                              input_shard: Shard | None = None, output_shard: Shard | None = None,
                              rtol: float | None = None, seed: int = 0,
                              group: ProcessGroup | None = None) -> dict[str, float]:
    """Check a sharded module against its dense twin; return the relative error of each quantity.

    ``x`` is the full input, the same on every rank. The sharded module gets this rank's slice of it when
    ``input_shard`` is given, and its output is gathered along ``output_shard`` when given. Compared: the
    output, the input gradient, and every parameter gradient (gathered to full size; keys must match the dense
    module's parameter names) after backward of the same random output gradient. Norm-wise relative errors,
    each parameter gradient against the larger of its own norm and the whole gradient's (see
    :func:`rel_error`). All collectives run before any comparison, so a mismatch fails every rank alike
    instead of hanging the others.
    """
    group = current_mesh().tp_group if group is None else group
    rank, n = group_rank_size(group)
    x_dense, x_full = (x.detach().clone().requires_grad_() for _ in range(2))
    y_dense = dense(x_dense)
    y = sharded(shard(x_full, input_shard, n, rank) if input_shard else x_full)
    g = torch.randn(y_dense.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(y_dense.dtype).to(y_dense.device)
    y_dense.backward(g)
    y.backward(shard(g, output_shard, n, rank) if output_shard else g)

    y_full = unshard(y, output_shard, group) if output_shard else y.detach()
    dx = x_full.grad
    if input_shard and dx is not None:  # each rank holds the gradient of its own slice only
        dx = unshard(shard(dx, input_shard, n, rank), input_shard, group)
    grads = full_grads(sharded)
    dense_grads = {k: p.grad for k, p in dense.named_parameters() if p.grad is not None}

    if set(grads) != set(dense_grads):
        raise AssertionError(f"sharded gradients {sorted(grads)} do not match the dense {sorted(dense_grads)}")
    # a parameter gradient is measured against the whole gradient's norm when that is larger: some
    # are zero in exact arithmetic (a key bias shifts a whole softmax row) and hold only round-off
    scale = torch.cat([g.detach().double().flatten().cpu() for g in dense_grads.values()]).norm().item() \
        if dense_grads else 0.0
    pairs: dict[str, tuple[Any, ...]] = {"output": (y_full, y_dense), "input grad": (dx, x_dense.grad)}
    pairs.update({f"grad {k}": (grads[k], dense_grads[k], scale) for k in sorted(dense_grads)})
    return assert_all_close(pairs, rtol=rtol, what=f"sharded module differs from its dense twin at tp={n}")


def assert_all_close(pairs: Mapping[str, tuple[Any, ...]], *, rtol: float | None = None,
                     what: str = "results differ") -> dict[str, float]:
    """:func:`assert_close` on every ``name: (actual, expected[, scale])``; one error listing
    every failure, else the relative errors by name. Call it after the last collective, so that
    a mismatch fails every rank alike instead of leaving the others waiting."""
    errors, failures = {}, []
    for name, (actual, expected, *scale) in pairs.items():
        try:
            errors[name] = assert_close(actual, expected, rtol=rtol, name=name, scale=scale[0] if scale else 0.0)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        raise AssertionError(f"{what}:\n  " + "\n  ".join(failures))
    return errors
