"""A tensor's bytes to and from files through a buffer that Python owns, in bounded blocks.

Files take and give bytes-like objects, and a tensor is none (torch's CPU build
offers no buffer of its own without numpy). A view over ``tensor.data_ptr()``
would keep nothing alive: when the tensor is a temporary (``.cpu()`` of a CUDA
tensor, ``.contiguous()`` of a strided view) its memory is freed under the view,
and the file receives whatever lies there next. So the bytes travel through a
``bytearray``: :func:`blocks` copies a tensor of any strides, dtype or device
into it, a block of at most :data:`BLOCK` bytes at a time, in row-major order
(safetensors' layout); :func:`fill` reads a file into it and copies each block
into a contiguous tensor. Neither ever makes a copy of the whole tensor.

Example::

    for block in blocks(weight.t()):   # any strides; a CUDA tensor a block at a time
        file.write(block)
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import torch

BLOCK = 4 << 20  #: bytes staged at a time


def runs(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` that, in order, cover its elements in row-major order, each of at most ``limit``
    (>= 1) elements; ``t`` itself when it is that small."""
    if t.numel() <= limit:
        yield t
        return
    row = t[0].numel()  # t has a dim here: a 0-dim tensor holds 1 element
    step = limit // row
    for i in range(0, t.shape[0], max(step, 1)):
        if step:
            yield t[i:i + step]  # (<= step, *t.shape[1:])
        else:  # one row is more than a block: split it too
            yield from runs(t[i], limit)


def _buffer(nbytes: int, element: int, block: int) -> tuple[bytearray, torch.Tensor]:
    """A ``bytearray`` of whole elements, at most ``block`` bytes (at least one element) and at most
    ``nbytes``, and a uint8 tensor over it (which holds a reference to it)."""
    size = min(nbytes, max(block // element, 1) * element)
    data = bytearray(size)
    return data, torch.frombuffer(data, dtype=torch.uint8)


def blocks(tensor: torch.Tensor, *, block: int = BLOCK) -> Iterator[memoryview]:
    """The bytes of ``tensor`` (any strides, device and dtype) in row-major order, as consecutive views
    of one Python-owned buffer of at most ``block`` bytes; each view holds its bytes until the next is
    asked for."""
    t = tensor.detach()
    element = t.element_size()
    if not t.numel() * element:
        return
    data, staged = _buffer(t.numel() * element, element, block)
    for run in runs(t, len(data) // element):
        n = run.numel() * element
        staged[:n].view(t.dtype).view(run.shape).copy_(run)  # from any strides or device
        yield memoryview(data)[:n]


def fill(file: io.BufferedIOBase, out: torch.Tensor, *, block: int = BLOCK) -> int:
    """Read ``out``'s bytes (a contiguous tensor) from ``file`` at its position; return how many were
    read (fewer only where the file ends)."""
    assert out.is_contiguous()
    nbytes = out.numel() * out.element_size()
    if not nbytes:
        return 0
    # (nbytes,): out's own memory (a contiguous tensor may have any stride along a dim of size 1)
    target = out.as_strided((out.numel(),), (1,)).view(torch.uint8)
    data, staged = _buffer(nbytes, 1, block)
    view, done = memoryview(data), 0
    while done < nbytes:
        want = min(len(data), nbytes - done)
        got = file.readinto(view[:want]) or 0
        if not got:  # the file ends here
            break
        target[done:done + got].copy_(staged[:got])
        done += got
    return done
