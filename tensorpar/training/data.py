"""Byte-level token data with deterministic, resumable batches for tp x dp training.

Tokens are the bytes of a text (vocabulary 256). The batch of optimizer step
``s`` is drawn from a generator seeded by ``(seed, s)`` alone, so it does not
depend on what ran before: a run resumed at step ``s`` (at any tp or dp) sees
exactly the batches an uninterrupted run would. Each step's ``batch_size``
rows are split into ``accum`` micro-batches, and each micro-batch into ``dp``
parts: data-parallel rank ``r`` gets part ``r``; tensor-parallel ranks of one
dp rank get the same rows.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ..random import mix_seed

VOCAB_SIZE = 256


def default_corpus(n_chars: int = 200_000) -> str:
    """A deterministic English-like corpus made offline from a small grammar (no download).

    Example::

        text = default_corpus()   # the same ~200 kB of text on every machine
    """
    rng = random.Random(0)
    names = ["the old keeper", "a young sailor", "the miller", "my sister", "the captain", "a tired horse",
             "the quiet child", "our neighbour", "the baker", "a grey cat", "the stranger", "the king"]
    verbs = ["watched", "carried", "found", "followed", "mended", "remembered", "painted", "lost", "counted",
             "opened", "sold", "feared", "wanted", "cleaned", "named"]
    things = ["the lantern", "a broken wheel", "the long road", "seven apples", "the letter", "a small boat",
              "the river", "an empty cup", "the north wind", "a silver key", "the garden gate", "the map"]
    places = ["by the harbour", "in the morning", "under the bridge", "at the market", "before the storm",
              "near the mill", "after supper", "on the hill", "in the dark", "beside the well"]
    joins = ["and then", "but", "so", "while", "because"]
    out, size = [], 0
    while size < n_chars:
        clause = f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(things)} {rng.choice(places)}"
        if rng.random() < 0.4:
            clause += f", {rng.choice(joins)} {rng.choice(names)} {rng.choice(verbs)} {rng.choice(things)}"
        sentence = clause[0].upper() + clause[1:] + rng.choice([".", ".", ".", "!", "?"])
        sentence += "\n" if rng.random() < 0.15 else " "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


class ByteData:
    """A text as byte tokens, cut into deterministic ``(x, y)`` batches by step.

    Example::

        data = ByteData.from_text(default_corpus())
        x, y = data.batch(step, micro=0, batch_size=16, block_size=64, dp=2, dp_rank=1)   # (8, 64) each
    """

    def __init__(self, tokens: torch.Tensor, *, seed: int = 0) -> None:
        if tokens.dim() != 1 or tokens.dtype != torch.uint8:
            raise TypeError(f"tokens must be a 1-D uint8 tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        self.tokens, self.seed = tokens, seed

    @classmethod
    def from_text(cls, text: str, *, seed: int = 0) -> ByteData:
        return cls(torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8), seed=seed)

    @classmethod
    def from_file(cls, path: str | Path, *, seed: int = 0) -> ByteData:
        return cls(torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8), seed=seed)

    def __len__(self) -> int:
        return self.tokens.numel()

    def batch(self, step: int, micro: int = 0, *, batch_size: int, block_size: int, accum: int = 1,
              dp: int = 1, dp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's part of micro-batch ``micro`` of step ``step``: inputs and next-byte targets,
        each ``(batch_size / (accum * dp), block_size)`` int64."""
        if batch_size % (accum * dp):
            raise ValueError(f"batch_size ({batch_size}) is not divisible by grad accumulation ({accum}) x dp ({dp})")
        if len(self) <= block_size:
            raise ValueError(f"the text has {len(self)} tokens, fewer than block_size + 1 ({block_size + 1})")
        g = torch.Generator().manual_seed(mix_seed(self.seed, step))
        starts = torch.randint(0, len(self) - block_size, (batch_size,), generator=g)  # the whole step's rows
        rows = batch_size // (accum * dp)
        mine = starts.view(accum, dp, rows)[micro, dp_rank]  # (rows,)
        window = mine[:, None] + torch.arange(block_size + 1)  # (rows, block_size + 1)
        chunk = self.tokens[window].long()
        return chunk[:, :-1], chunk[:, 1:]

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
