"""Pictures of which rank holds which elements of a weight matrix, for the notebooks.

The input is what the ranks report from :func:`nb_workers.held_indices`: each
rank's local tensors after loading a full state dict whose elements are their
own flat indices. So every picture here is drawn from where the elements really
landed, with no formula for the split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Patch

# One colour per rank (Okabe and Ito's colour-blind-safe palette), and the grey of "not here".
RANK_COLOURS = ((0.90, 0.62, 0.00), (0.34, 0.71, 0.91), (0.00, 0.62, 0.45), (0.84, 0.37, 0.00))
GREY = (0.88, 0.88, 0.88)


def holders(shape: Sequence[int], held: Sequence[torch.Tensor]) -> np.ndarray:
    """``(ranks, *shape)`` booleans: which ranks hold each element of a full tensor of ``shape``,
    given the flat element indices each rank holds."""
    out = np.zeros((len(held), math.prod(shape)), dtype=bool)
    for rank, indices in enumerate(held):
        flat = indices.reshape(-1).numpy()
        if len(np.unique(flat)) != flat.size:
            raise ValueError(f"rank {rank} holds an element twice")
        out[rank, flat] = True
    return out.reshape(len(held), *shape)


def owner(held_by: np.ndarray) -> np.ndarray:
    """The one rank holding each element (``held_by`` from :func:`holders`); every element
    must be held by exactly one rank."""
    count = held_by.sum(0)
    if not (count == 1).all():
        raise ValueError(f"elements held by {sorted(set(count.reshape(-1).tolist()))} ranks, expected 1 each")
    return held_by.argmax(0)


def spans(owners: np.ndarray, axis: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each rank's block along ``axis`` of a 2-D owner map, checking that
    every rank owns whole lines (rows for ``axis=0``, columns for 1), one contiguous run of them."""
    lines = np.moveaxis(owners, axis, 0)                      # (split dim, other dim)
    if not (lines == lines[:, :1]).all():
        raise ValueError(f"some {('row', 'column')[axis]} is split between ranks")
    line_owner = lines[:, 0]
    out = []
    for rank in range(int(owners.max()) + 1):
        where = np.flatnonzero(line_owner == rank)
        if where.size and (np.diff(where) != 1).any():
            raise ValueError(f"rank {rank}'s {('row', 'column')[axis]}s are not contiguous: {where.tolist()}")
        out.append((int(where[0]), int(where.size)) if where.size else (0, 0))
    return out


def paint(owners: np.ndarray, *, heads: np.ndarray | None = None, shown: np.ndarray | None = None) -> np.ndarray:
    """An RGB image ``(*owners.shape, 3)``: each element in its rank's colour, paler on odd
    ``heads`` (so head boundaries show inside a rank's block), grey where ``shown`` is False."""
    image = np.array(RANK_COLOURS)[owners]
    if heads is not None:
        pale = 0.65 * image + 0.35
        image = np.where((heads % 2 == 1)[..., None], pale, image)
    if shown is not None:
        image[~shown] = GREY
    return image


def draw(ax: plt.Axes, image: np.ndarray, title: str, *, ylabel: str, xlabel: str,
         head_dim: int | None = None, head_axis: int = 0, head_name: str = "h") -> None:
    """Show ``image`` with a thin white line between elements; with ``head_dim``, a thick one between
    heads along ``head_axis``, labelled ``h0``, ``h1``, ... instead of the element numbers."""
    ax.imshow(image, interpolation="nearest")
    rows, cols = image.shape[:2]
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="both", length=0, labelsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    for axis, n in ((0, rows), (1, cols)):
        set_ticks = ax.set_yticks if axis == 0 else ax.set_xticks
        if head_dim is not None and axis == head_axis:
            centres = np.arange(n // head_dim) * head_dim + (head_dim - 1) / 2
            set_ticks(centres, [f"{head_name}{h}" for h in range(n // head_dim)])
            line = ax.axhline if axis == 0 else ax.axvline
            for boundary in range(head_dim, n, head_dim):
                line(boundary - 0.5, color="white", linewidth=2.5)
        else:
            set_ticks(range(0, n, max(1, n // 4)))


def rank_legend(fig: plt.Figure, ranks: int, *, extra: Sequence[tuple[str, tuple[float, ...]]] = ()) -> None:
    """A legend of the rank colours (and ``extra`` ``(label, colour)`` entries) below the figure."""
    handles = [Patch(color=RANK_COLOURS[r], label=f"rank {r}") for r in range(ranks)]
    handles += [Patch(color=colour, label=label) for label, colour in extra]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
