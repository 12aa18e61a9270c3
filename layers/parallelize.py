"""Convert a dense model to tensor parallelism by a plan, in place.

A plan maps submodule names (glob patterns allowed) to styles: a name from
:data:`STYLES`, a head style (:class:`QKVColumn`, :class:`HeadRow`), any class
with ``from_linear``/``from_embedding``, or any callable that takes the dense
module and returns its replacement. Nothing is registered anywhere: a style of
your own is just passed in the plan.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType

from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.checks import check_int
from tensorpar.sharding import partition_bounds

from . import numerics
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear


def _head_dim(linear: nn.Module, n_head: int, style: str, *, blocks: int = 1) -> int:
    """The features of one of ``n_head`` heads in ``linear`` (an ``nn.Linear``): its output features
    over ``blocks`` (a fused ``[Q | K | V]`` has 3), or with ``blocks=0`` its input features."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{style} expects an nn.Linear, got {type(linear).__name__}")
    if blocks and linear.out_features % blocks:
        raise ValueError(f"{style}: out_features ({linear.out_features}) is not {blocks} equal blocks")
    width = linear.out_features // blocks if blocks else linear.in_features
    if width % n_head:
        raise ValueError(f"{style}: {width} features are not a whole number of {n_head} heads")
    return width // n_head


@dataclass(frozen=True)
class QKVColumn:
    """Style for a fused ``[Q | K | V]`` projection, ``nn.Linear(C, 3 C)`` (nanoGPT's ``c_attn``):
    column-parallel by whole heads in each of its three blocks, so a rank holds its heads of Q,
    of K and of V (balanced: 4 heads over 3 ranks are 2, 1, 1) and outputs ``[Q_r | K_r | V_r]``.

    The module owning the projection then works on this rank's heads only, so its head count
    and width become this rank's: ``heads_attr`` (``"n_head"``) is set to the local heads and
    ``width_attr`` (``"n_embd"``) to their features (``None`` leaves one alone), as
    :func:`~layers.parallelize_hf` does for Hugging Face's GPT-2. Its forward must take its
    shapes from them, as nanoGPT's ``split(self.n_embd, dim=2)`` does: heads of
    ``self.n_embd // self.n_head`` features and an output of ``self.n_embd``, not ``C`` of the
    input. The output projection then takes the heads back by rows: :class:`HeadRow`.

    Example::

        tensorpar.init(tp=3)
        layers.parallelize(model, {"transformer.h.*.attn.c_attn": QKVColumn(n_head=12),
                                   "transformer.h.*.attn.c_proj": HeadRow(n_head=12)})
    """

    n_head: int
    _: KW_ONLY
    heads_attr: str | None = "n_head"
    width_attr: str | None = "n_embd"

    def __post_init__(self) -> None:
        check_int(self.n_head, "QKVColumn: n_head")

    def __call__(self, linear: nn.Module, *, group: ProcessGroup | None = None) -> ColumnParallelLinear:
        d = _head_dim(linear, self.n_head, "QKVColumn", blocks=3)
        return ColumnParallelLinear.from_linear(linear, unit=(d, d, d), group=group)  # [Q | K | V], split alike

    def update_owner(self, owner: nn.Module, sharded: ColumnParallelLinear) -> None:
        """Give ``owner`` (the module holding the projection) this rank's head count and width."""
        heads = partition_bounds(self.n_head, sharded.tp, sharded.tp_rank, name="n_head")[1]
        local = {attr: value for attr, value in ((self.heads_attr, heads), (self.width_attr, heads * sharded.unit[0]))
                 if attr is not None}
        for attr, value in local.items():
            if not hasattr(owner, attr):
                raise ValueError(f"QKVColumn: {type(owner).__name__} has no attribute {attr!r} to set to this "
                                 f"rank's {value}; name it with heads_attr/width_attr, or pass None")
        for attr, value in local.items():
            setattr(owner, attr, value)


@dataclass(frozen=True)
class HeadRow:
    """Style for attention's output projection, ``nn.Linear(C, C)``: row-parallel by whole heads,
    taking the heads :class:`QKVColumn` gives each rank (4 heads over 3 ranks: 2, 1, 1)."""

    n_head: int

    def __post_init__(self) -> None:
        check_int(self.n_head, "HeadRow: n_head")

    def __call__(self, linear: nn.Module, *, group: ProcessGroup | None = None) -> RowParallelLinear:
        d = _head_dim(linear, self.n_head, "HeadRow", blocks=0)
        return RowParallelLinear.from_linear(linear, unit=d, group=group)


@dataclass(frozen=True)
class Segmentwise:
    """Style for an elementwise module between a column- and a row-parallel layer (an activation such as
    nanoGPT's ``mlp.gelu``), over a column output of ``features`` full features: in bitwise mode it runs
    on one canonical segment at a time (:class:`~layers.numerics.SegmentwiseActivation`), and elsewhere as it is.

    Example::

        layers.parallelize(model, {"transformer.h.*.mlp.c_fc": "column",
                                   "transformer.h.*.mlp.gelu": Segmentwise(4 * n_embd),
                                   "transformer.h.*.mlp.c_proj": "row"})
    """

    features: int

    def __post_init__(self) -> None:
        check_int(self.features, "Segmentwise: features")

    def __call__(self, module: nn.Module, *, group: ProcessGroup | None = None) -> numerics.SegmentwiseActivation:
        return numerics.SegmentwiseActivation(module, self.features, group=group)


#: A plan value: a style name (a key of ``STYLES``), a head or segment style, a class with ``from_linear``,
#: or a converter.
Style = str | QKVColumn | HeadRow | Segmentwise | type | Callable[[nn.Module], nn.Module]

#: The named styles.
STYLES: Mapping[str, type] = MappingProxyType(
    {"column": ColumnParallelLinear, "row": RowParallelLinear, "embedding": VocabParallelEmbedding})

#: How a style class converts each kind of dense module.
_FROM = ((nn.Linear, "from_linear"), (nn.Embedding, "from_embedding"))


def _converter(style: Style, group: ProcessGroup | None) -> Callable[[nn.Module], nn.Module]:
    if isinstance(style, str):
        if style not in STYLES:
            raise ValueError(f"unknown parallel style {style!r}; known styles: {', '.join(sorted(STYLES))} "
                             "(or pass a class with from_linear/from_embedding, or a callable)")
        style = STYLES[style]
    if isinstance(style, (QKVColumn, HeadRow, Segmentwise)):
        return functools.partial(style, group=group)
    if isinstance(style, type) and any(hasattr(style, method) for _, method in _FROM):
        cls = style

        def convert(module: nn.Module) -> nn.Module:
            for kind, method in _FROM:
                if isinstance(module, kind) and hasattr(cls, method):
                    return getattr(cls, method)(module, group=group)
            raise TypeError(f"{cls.__name__} cannot convert a {type(module).__name__}")
        return convert
    if callable(style):
        return style
    raise TypeError("a plan value must be a style name, a class with from_linear/from_embedding, or a callable; "
                    f"got {style!r}")


def parallelize(model: nn.Module, plan: Mapping[str, Style], *, group: ProcessGroup | None = None) -> nn.Module:
    """Swap the submodules named by ``plan`` for their tensor-parallel twins, keeping weights.

    Keys are submodule names, glob patterns allowed (``"blocks.*.fc1"``); values
    are styles: ``"column"`` (``ColumnParallelLinear``), ``"row"``
    (``RowParallelLinear``), ``"embedding"`` (``VocabParallelEmbedding``),
    :class:`QKVColumn` and :class:`HeadRow` (a fused Q/K/V projection and the
    output projection, by whole heads), :class:`Segmentwise` (an activation
    between a column and a row layer, for the bitwise mode), a
    class with ``from_linear``/``from_embedding``, or any callable
    taking the dense module and returning its replacement. Every rank must hold
    the same dense weights. Returns ``model``, changed in place.

    Example::

        tensorpar.init(tp=2)
        layers.parallelize(model, {"blocks.*.mlp.fc1": "column", "blocks.*.mlp.fc2": "row"})
        layers.parallelize(model, {"head": lambda linear: MyShardedHead(linear)})   # a style of your own
        layers.parallelize(gpt, {"transformer.h.*.attn.c_attn": QKVColumn(n_head=12),   # nanoGPT's attention
                                 "transformer.h.*.attn.c_proj": HeadRow(n_head=12)})
    """
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, str] = {}
    for pattern in plan:
        matches = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matches:
            raise ValueError(f"plan entry {pattern!r} matches no submodule of {type(model).__name__}")
        for name in matches:
            if name in chosen:
                raise ValueError(f"submodule {name!r} is matched by both {chosen[name]!r} and {pattern!r}")
            chosen[name] = pattern
    converters = {pattern: _converter(style, group) for pattern, style in plan.items()}
    for name, pattern in chosen.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        try:
            replacement = converters[pattern](model.get_submodule(name))
            if isinstance(plan[pattern], QKVColumn):
                plan[pattern].update_owner(parent, replacement)
        except TypeError as e:
            raise TypeError(f"cannot parallelize {name!r}: {e}") from None
        except ValueError as e:
            raise ValueError(f"cannot parallelize {name!r}: {e}") from None
        setattr(parent, leaf, replacement)
    return numerics.mark(model)  # in bitwise mode, its norm follows (tensorpar.clip_grad_norm_)
