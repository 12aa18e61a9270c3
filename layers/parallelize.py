"""Convert a dense model to tensor parallelism by a plan, in place.

A plan maps submodule names (glob patterns allowed) to styles: a name from
:data:`STYLES`, any class with ``from_linear``/``from_embedding``, or any
callable that takes the dense module and returns its replacement. Nothing is
registered anywhere: a style of your own is just passed in the plan.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Union

from torch import nn
from torch.distributed import ProcessGroup

from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear

#: A plan value: a style name (a key of ``STYLES``), a class with ``from_linear``, or a converter.
Style = Union[str, type, Callable[[nn.Module], nn.Module]]

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
    (``RowParallelLinear``), ``"embedding"`` (``VocabParallelEmbedding``), a
    class with ``from_linear``/``from_embedding``, or any callable
    taking the dense module and returning its replacement. Every rank must hold
    the same dense weights. Returns ``model``, changed in place.

    Example::

        tensorpar.init(tp=2)
        layers.parallelize(model, {"blocks.*.mlp.fc1": "column", "blocks.*.mlp.fc2": "row"})
        layers.parallelize(model, {"head": lambda linear: MyShardedHead(linear)})   # a style of your own
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
        try:
            replacement = converters[pattern](model.get_submodule(name))
        except TypeError as e:
            raise TypeError(f"cannot parallelize {name!r}: {e}") from None
        setattr(model.get_submodule(parent_name), leaf, replacement)
    return model
