"""Column- and row-parallel linear layers.

A linear layer ``Y = X Wᵀ + b`` with ``W`` of shape ``(out, in)`` splits two ways:

* **Column-parallel** splits ``W`` by rows (output features):
  ``W = [W_1; ...; W_tp]`` so ``Y = [X W_1ᵀ, ..., X W_tpᵀ]``. Each rank computes
  its own slice of the output from the whole input. The input is replicated,
  so its gradient is a sum of every rank's part: ``f`` (:func:`copy_to_tp`)
  all-reduces it in backward.
* **Row-parallel** splits ``W`` by columns (input features):
  ``W = [W_1, ..., W_tp]`` and ``X = [X_1, ..., X_tp]`` so ``Y = Σ_r X_r W_rᵀ``.
  Each rank computes a partial sum and ``g`` (:func:`reduce_from_tp`) all-reduces
  it in forward; the bias is added once, after the sum. Both layers fuse their
  collective with the matmul (:mod:`tensorpar.comm.linear`), which lets it work
  in place on buffers the op owns and overlap the backward all-reduce with the
  weight-gradient computation.

Column then row (an MLP) needs no communication in between: the column layer's sharded output is
exactly the row layer's sharded input. Several column layers reading one input share one ``f``
(:class:`~layers.regions.CopyToTP`, and ``copy_input=False``). ``unit=k`` keeps whole groups of ``k``
features together; shards are balanced, need not divide evenly, and initialise alike at every tp.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.checks import check_int
from tensorpar.sharding import Shard

from . import numerics
from .regions import summed_gradients


def check_activation(x: object, name: str) -> None:
    """Raise a ``TypeError`` naming ``name`` unless ``x`` is a floating-point tensor (activations are)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: input dtype {x.dtype} is not a floating-point dtype")


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_len: int | None = None
            ) -> torch.Tensor:
    """A column-parallel product with nothing to communicate: ``F.linear``."""
    return F.linear(x, weight, bias)


class _ParallelLinear(nn.Module):
    """What column- and row-parallel layers share: the split of ``weight`` along ``split_dim``."""

    split_dim: ClassVar[int]  # 0: output features are split; 1: input features are split

    def __init__(self, in_features: int, out_features: int, bias: bool, unit: int | tuple[int, ...],
                 group: ProcessGroup | None, device: torch.device | str | None, dtype: torch.dtype | None,
                 replicated: int = 0) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features),
                            *(("unit", u) for u in (unit if isinstance(unit, tuple) else (unit,)))):
            check_int(value, f"{type(self).__name__}: {name}")
        self.in_features, self.out_features, self.unit = in_features, out_features, unit
        self.tp_group = tensorpar.tp_group(group)
        self.tp_rank, self.tp = tensorpar.group_rank_size(self.tp_group)
        full = (out_features, in_features)
        self.placement = Shard(self.split_dim, full[self.split_dim], unit, replicated)
        name = ("out_features", "in_features")[self.split_dim]
        name = name if unit == 1 and not replicated else f"{name} in units of {unit}"
        self.pieces = self.placement.pieces(self.tp, self.tp_rank, name=name)  # (offset, length) in the full dim
        self.local_offset, self.local_features = self.pieces[0][0], sum(n for _, n in self.pieces)
        local = list(full)
        local[self.split_dim] = self.local_features
        self.weight = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
        bias_size = self.local_features if self.split_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_size, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def sharding(self) -> dict[str, Shard]:
        """Placements of the split parameters (see :mod:`tensorpar.full`)."""
        split = {"weight": self.placement}
        if self.bias is not None and self.split_dim == 0:
            split["bias"] = self.placement
        return split

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default: weight and bias ``U(-1/√in, 1/√in)``, drawn tp-invariantly."""
        bound = 1 / math.sqrt(self.in_features)
        for name, geometry in tensorpar.shard_geometry(self).items():
            tensorpar.tiled_init.uniform_(getattr(self, name), -bound, bound, **geometry)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: Any) -> _ParallelLinear:
        """Shard an ``nn.Linear`` (the same on every rank), keeping its weights.

        Example::

            fc1 = ColumnParallelLinear.from_linear(dense.fc1)
            fc2 = RowParallelLinear.from_linear(dense.fc2)
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear expects an nn.Linear, got {type(linear).__name__}")
        module = cls(linear.in_features, linear.out_features, linear.bias is not None,
                     device="meta", dtype=linear.weight.dtype, **options)
        module.to_empty(device=linear.weight.device)
        tensorpar.load_full_state_dict(module, linear.state_dict())
        return module

    def to_linear(self) -> nn.Linear:
        """The full ``nn.Linear``, gathered on every rank (a collective)."""
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                           device="meta", dtype=self.weight.dtype)
        linear.to_empty(device=self.weight.device)
        linear.load_state_dict(tensorpar.full_state_dict(self))
        return linear

    def _check_input(self, x: torch.Tensor, weight: torch.Tensor, width: int) -> None:
        """Raise unless ``x`` is a floating-point tensor with ``width`` features in its last dim, on the weight's
        device and in its dtype (or autocast's); the usual input costs a few attribute compares."""
        if isinstance(x, torch.Tensor) and x.dtype == weight.dtype and x.device == weight.device \
                and x.shape[-1:] == (width,):
            return
        name = type(self).__name__
        check_activation(x, name)
        if x.dim() == 0 or x.shape[-1] != width:
            what = "an input" if width == self.in_features else (
                f"this rank's input slice ({self.in_features} in_features over tp {self.tp}; input_is_parallel=True)")
            raise ValueError(f"{name} expects {what} with {width} features in its last dim, "
                             f"got shape {tuple(x.shape)}")
        if x.device != weight.device:
            raise TypeError(f"{name}: input is on {x.device} but the weight is on {weight.device}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"{name}: input dtype {x.dtype} does not match the weight dtype {weight.dtype}")

    def extra_repr(self) -> str:
        split = ("out_features", "in_features")[self.split_dim]
        where = " + ".join(f"[{lo}:{lo + n}]" for lo, n in self.pieces)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, local {split}={self.local_features} {where} "
                f"on tp rank {self.tp_rank} of {self.tp}" + (f", unit={self.unit}" if self.unit != 1 else "")
                + (f", replicated={self.placement.replicated}" if self.placement.replicated else ""))


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear`` with its output features split across the tp group.

    Input ``(*, in_features)``, replicated on every rank. Output
    ``(*, out_features / tp)`` (this rank's balanced slice), or the full
    ``(*, out_features)`` on every rank with ``gather_output=True``.
    ``copy_input=False`` leaves ``f`` to a :class:`~layers.regions.CopyToTP` shared with other
    layers reading the input. ``sequence_parallel=True`` takes this rank's tokens
    ``(..., T_r, in_features)`` and all-gathers them (``f̄``); ``forward(x, seq_len=T)`` names the
    full length (else one small collective finds it). A tuple ``unit`` splits consecutive blocks
    alike (a fused ``[Q | K | V]``, see :class:`~tensorpar.sharding.Shard`), the local output this
    rank's piece of each block. The last ``replicated`` output features are held whole by every
    rank, after its shard; backward sums their weight and bias gradient rows over the group.

    Example::

        tensorpar.init(tp=2)
        fc = ColumnParallelLinear(768, 3072)   # weight (1536, 768) on each rank
        y = fc(x)                              # (B, T, 1536)
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, gather_output: bool = False,
                 copy_input: bool = True, sequence_parallel: bool = False, unit: int | tuple[int, ...] = 1,
                 replicated: int = 0, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if sequence_parallel and not copy_input:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True gathers the tokens itself; with "
                             "copy_input=False the input is already gathered (an AllGatherSequence shared by several "
                             "layers): leave sequence_parallel off there")
        if gather_output and (isinstance(unit, tuple) or replicated):
            raise ValueError("ColumnParallelLinear: gather_output=True needs a plain split (an int unit, nothing "
                             "replicated)")
        super().__init__(in_features, out_features, bias, unit, group, device, dtype, replicated)
        self.gather_output, self.copy_input, self.sequence_parallel = gather_output, copy_input, sequence_parallel
        # (x, weight, bias, seq_len) -> (*, out / tp): the default product (the matmul alone where no rank takes
        # part), or the bitwise mode's (chosen once)
        alone = not sequence_parallel and (self.tp == 1 or not (copy_input or replicated))
        self.product = numerics.column(_matmul if alone else self._product, self.placement, self.tp_group,
                                       sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        weight = self.weight
        self._check_input(x, weight, self.in_features)
        y = self.product(x, weight, self.bias, seq_len)  # (*, out / tp)
        if self.gather_output:
            y = self._gather_units(y)  # (*, out)
        return y

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 seq_len: int | None) -> torch.Tensor:
        """The default product: ``f`` (or ``f̄``) fused with the matmul, on this rank's rows."""
        tail = self.placement.replicated
        if tail and self.tp > 1:  # f on the replicated rows: their gradients summed over the group
            head = self.local_features - tail
            w, w_tail = weight.split([head, tail])
            b, b_tail = (None, None) if bias is None else bias.split([head, tail])
            w_tail, b_tail = summed_gradients([w_tail, b_tail], self.tp_group)
            weight = torch.cat([w, w_tail])  # (local out, in)
            bias = None if bias is None else torch.cat([b, b_tail])
        if self.sequence_parallel:  # (..., T_r, in) -> (..., T, out / tp)
            y = tensorpar.sequence_parallel_column_linear(x, weight, bias, seq_len, self.tp_group)
        elif self.copy_input and self.tp > 1:
            y = tensorpar.column_parallel_linear(x, weight, bias, self.tp_group)  # (*, out / tp)
        else:  # f was applied by the caller, or there is no other rank
            y = F.linear(x, weight, bias)
        return y

    def _gather_units(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's output features, gathered by the layer's split in whole units."""
        assert isinstance(self.unit, int)  # a tuple unit with gather_output is refused at construction
        units = y.unflatten(-1, (-1, self.unit))  # (*, out / tp / unit, unit)
        full = tensorpar.gather_from_tp(units, -2, self.out_features // self.unit, self.tp_group)
        return full.flatten(-2)  # (*, out)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, gather_output={self.gather_output}, copy_input={self.copy_input}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear`` with its input features split across the tp group.

    Input ``(*, in_features / tp)``, this rank's balanced slice (the output of a
    ``ColumnParallelLinear``), or the full ``(*, in_features)`` with
    ``input_is_parallel=False`` (each rank then keeps its slice). Output
    ``(*, out_features)``, summed over the group and identical on every rank; with
    ``sequence_parallel=True``, this rank's tokens of it, ``(..., T_r, out_features)``
    (reduce-scattered along dim -2, ``ḡ``; the bias gradient is still whole on every rank).

    Example::

        tensorpar.init(tp=2)
        proj = RowParallelLinear(3072, 768)   # weight (768, 1536) on each rank
        y = proj(h)                           # h: (B, T, 1536) -> y: (B, T, 768)
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, unit: int = 1, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, unit, group, device, dtype)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        # (x, weight, bias) -> (*, out), summed over the group: the default product (the matmul alone at tp 1),
        # or the bitwise mode's
        alone = self.tp == 1 and not sequence_parallel
        self.product = numerics.row(F.linear if alone else self._product, self.placement, self.tp_group,
                                    sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.input_is_parallel or self.tp == 1:
            self._check_input(x, weight, self.local_features)
        else:
            self._check_input(x, weight, self.in_features)
            x = tensorpar.scatter_to_tp(x, -1, self.tp_group, unit=self.unit)  # (*, in / tp)
        return self.product(x, weight, self.bias)  # (*, out), or (..., T_r, out)

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The default product: the matmul fused with ``g`` (or ``ḡ``)."""
        if self.sequence_parallel:  # (..., T_r, out): this rank's tokens of the sum
            return tensorpar.sequence_parallel_row_linear(x, weight, bias, self.tp_group)
        return tensorpar.row_parallel_linear(x, weight, bias, self.tp_group)  # (*, out), summed over ranks

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, input_is_parallel={self.input_is_parallel}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class ReplicatedLinear(nn.Linear):
    """``nn.Linear`` held whole on every rank of the tp group, each rank using the part of its
    output that its own sharded computation needs (e.g. the key/value heads its query heads
    read). Every rank's weight gradient then covers its part only, so backward sums them over
    the group (``f`` on the weights): one all-reduce of the weight and bias together.

    The input must already be inside the tensor-parallel region (after a
    :class:`~layers.regions.CopyToTP`), like a ``ColumnParallelLinear(copy_input=False)``'s.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            check_int(value, f"{type(self).__name__}: {name}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.tp_group = tensorpar.tp_group(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activation(x, type(self).__name__)
        weight, bias = summed_gradients([self.weight, self.bias], self.tp_group)  # one f for both
        return F.linear(x, weight, bias)
