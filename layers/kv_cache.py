"""The keys and values a GPT keeps while it generates: each rank holds those of its own heads.

A :class:`KVCache` holds, for every layer, the keys and values of the KV heads the rank holds (grouped-query
attention: its KV heads; fewer KV heads than ranks: all of them), preallocated for ``block_size`` tokens:
``(B, held KV heads, block_size, head_dim)`` each, so the shapes never change while decoding. Each row
keeps its own length (per-row positions): a token at position ``p`` of its row is stored in slot ``p``, and a
query at position ``p`` attends to slots ``0..p`` of its row. Prompts of different lengths are therefore
given right-padded, with their lengths (:meth:`KVCache.truncate_`): the padding's slots are masked until the
row's own tokens overwrite them.

Example::

    cache = gpt.new_cache(batch_size=2)
    logits = gpt(prompt, cache=cache)          # prefill: (2, P, V); the cache now holds P tokens per row
    logits = gpt(next_tokens, cache=cache)     # decode: (2, 1, V), attending to P + 1 tokens
"""

from __future__ import annotations

import torch

from tensorpar.checks import check_int


class LayerCache:
    """One layer's keys and values ``(B, held KV heads, block_size, d)``, allocated at the first write (in the
    dtype of the keys written: under autocast, its compute dtype), and the positions being written."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``(B, held KV heads, S, d)`` at the positions of this forward; returns every
        slot's keys and values ``(B, held KV heads, L, d)`` up to ``L`` (the longest row after the write)."""
        cache, s = self.cache, k.shape[2]
        keys, values = self.keys, self.values
        if keys is None or values is None:
            shape = (cache.batch_size, k.shape[1], cache.block_size, k.shape[3])
            self.keys, self.values = keys, values = k.new_zeros(shape), v.new_zeros(shape)
        at = cache.uniform
        if at is not None:  # every row at the same length: a slice
            keys[:, :, at:at + s] = k
            values[:, :, at:at + s] = v
        else:
            index = cache.positions[:, None, :, None].expand(k.shape)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
        end = cache.end
        return keys[:, :, :end], values[:, :, :end]


class KVCache:
    """Every layer's keys and values for ``batch_size`` rows of up to ``block_size`` tokens (see the module).

    ``lengths`` (B,) holds how many tokens each row has; a forward with the cache appends its ``S`` tokens to
    every row and advances them by ``S``. It is read-only (while the rows agree, a view of the slot numbers):
    :meth:`truncate_` sets it.
    """

    def __init__(self, batch_size: int, block_size: int, n_layer: int, device: torch.device | str | None = None
                 ) -> None:
        check_int(batch_size, "batch_size")
        self.batch_size, self.block_size = batch_size, block_size
        self.layers = [LayerCache(self) for _ in range(n_layer)]
        self.slots = torch.arange(block_size + 1, device=device)  # slot numbers, read as positions and lengths
        self.lengths = self.slots[:1].expand(batch_size)
        self._host_lengths = [0] * batch_size  # the same, on the host: no device sync to plan a step
        self.positions = self.lengths[:, None]  # (B, S) of the forward running now
        self.uniform: int | None = 0  # every row's length when they agree (writes are slices), else None
        self.end = 0  # the longest row's length after the forward running now
        self.mask: torch.Tensor | None = None  # (B, 1, S, L) the slots each query reads; None: see begin

    def begin(self, s: int) -> torch.Tensor:
        """Plan a forward of ``s`` tokens per row: their positions ``(B, s)``, and the slots each query reads,
        for every layer: ``mask`` ``(B, 1, s, L)``, or ``None`` where rows agree and no mask is needed (a
        prefill from slot 0 is causal; one token per row reads every slot). Raises past ``block_size``."""
        longest = max(self._host_lengths)
        if longest + s > self.block_size:
            raise ValueError(f"the KV cache holds {self.block_size} tokens per row (block_size); a row of "
                             f"{longest} cannot take {s} more")
        at = self.uniform
        if at is None:
            self.positions = self.lengths[:, None] + self.slots[:s]  # (B, S)
        else:  # every row alike: a view of the slot numbers, no op
            self.positions = self.slots[at:at + s].expand(self.batch_size, s)
        self.end = longest + s
        if at is not None and (at == 0 or s == 1):
            self.mask = None
        else:
            self.mask = self.slots[:self.end] <= self.positions[:, None, :, None]  # (B, 1, S, L)
        return self.positions

    def advance(self, s: int) -> None:
        """Every row now holds ``s`` more tokens."""
        self._host_lengths = [n + s for n in self._host_lengths]
        if self.uniform is None:
            self.lengths = self.lengths + s
        else:
            self.uniform += s
            self.lengths = self.slots[self.uniform].expand(self.batch_size)

    def truncate_(self, lengths: torch.Tensor | list[int]) -> KVCache:
        """Keep only each row's first ``lengths[r]`` tokens (after a right-padded prefill, the prompts' own
        lengths); the slots beyond are masked until overwritten. Returns the cache."""
        host = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if len(host) != self.batch_size or any(not 0 <= n <= h for n, h in zip(host, self._host_lengths,
                                                                                 strict=False)):
            raise ValueError(f"truncate_ needs {self.batch_size} lengths, each at most the row's length "
                             f"{self._host_lengths}, got {host}")
        self._host_lengths = host
        self.lengths = torch.tensor(host, dtype=torch.long, device=self.lengths.device)
        self.uniform = host[0] if len(set(host)) == 1 else None
        return self
