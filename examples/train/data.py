"""Token data with deterministic, resumable batches for tp x dp training, and its train/val splits.

Tokens are a 1-D sequence of ids: the bytes of a text (vocabulary 256), or
nanoGPT's ``train.bin`` / ``val.bin`` (flat ``uint16`` ids, memory-mapped, never
read whole). The batch of optimizer step ``s`` is drawn from a generator seeded
by ``(seed, s)`` alone, so it does not depend on what ran before: a run resumed
at step ``s`` (at any tp or dp) sees exactly the batches an uninterrupted run
would. Each step's ``batch_size`` rows are split into ``accum`` micro-batches,
and each micro-batch into ``dp`` parts: data-parallel rank ``r`` gets part
``r``; tensor-parallel ranks of one dp rank get the same rows.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from tensorpar.random import mix_seed

VOCAB_SIZE = 256
#: token files up to this many ids are checked against the vocabulary whole, before training starts;
#: larger ones batch by batch
SCANNED_TOKENS = 1 << 24


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


def _mapped(path: Path, dtype: torch.dtype) -> torch.Tensor:
    """The file's contents as a 1-D tensor of ``dtype``, memory-mapped read-only (pages read on use)."""
    size, item = path.stat().st_size, torch.empty((), dtype=dtype).element_size()
    if size % item:
        raise ValueError(f"{path} holds {size} bytes, not a whole number of {dtype} tokens ({item} bytes each)")
    if size == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(str(path), shared=False, size=size // item, dtype=dtype)


class TokenData:
    """Token ids, cut into deterministic ``(x, y)`` batches by step.

    ``vocab_size``, when given, bounds the ids: a batch holding a larger one
    raises ``ValueError`` (the whole file is checked at once by :meth:`check_ids`).

    Example::

        data = TokenData.from_bin("data/shakespeare/train.bin", vocab_size=50257)   # nanoGPT's uint16 ids
        x, y = data.batch(step, micro=0, batch_size=16, block_size=64, dp=2, dp_rank=1)   # (8, 64) each
    """

    DTYPES = (torch.uint8, torch.uint16, torch.int32, torch.int64)

    def __init__(self, tokens: torch.Tensor, *, seed: int = 0, vocab_size: int | None = None) -> None:
        if tokens.dim() != 1 or tokens.dtype not in self.DTYPES:
            raise TypeError(f"tokens must be a 1-D tensor of {', '.join(map(str, self.DTYPES))}, "
                            f"got {tuple(tokens.shape)} {tokens.dtype}")
        self.tokens, self.seed, self.vocab_size = tokens, seed, vocab_size

    @classmethod
    def from_bin(cls, path: str | Path, *, seed: int = 0, vocab_size: int | None = None) -> TokenData:
        """nanoGPT's token file: flat ``uint16`` ids, memory-mapped."""
        return cls(_mapped(Path(path), torch.uint16), seed=seed, vocab_size=vocab_size)

    def __len__(self) -> int:
        return self.tokens.numel()

    def split(self, val_fraction: float) -> tuple[TokenData, TokenData]:
        """``(train, val)``: the first ``1 - val_fraction`` of the tokens, and the rest (views, no copy);
        the validation part draws its batches from its own generator stream."""
        cut = len(self) - round(len(self) * val_fraction)
        return (type(self)(self.tokens[:cut], seed=self.seed, vocab_size=self.vocab_size),
                type(self)(self.tokens[cut:], seed=mix_seed(self.seed, 1), vocab_size=self.vocab_size))

    def check_ids(self, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` if an id is not below ``vocab_size`` (reads every token)."""
        if self.vocab_size is None or not len(self):
            return
        largest = max(int(chunk.to(torch.int64).max()) for chunk in self.tokens.split(1 << 22))
        if largest >= self.vocab_size:
            raise ValueError(f"{name} holds token id {largest}, not below the vocabulary size {self.vocab_size}")

    def batch(self, step: int, micro: int = 0, *, batch_size: int, block_size: int, accum: int = 1,
              dp: int = 1, dp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's part of micro-batch ``micro`` of step ``step``: inputs and next-token targets,
        each ``(batch_size / (accum * dp), block_size)`` int64."""
        if batch_size % (accum * dp):
            raise ValueError(f"batch_size ({batch_size}) is not divisible by grad accumulation ({accum}) x dp ({dp})")
        if len(self) <= block_size:
            raise ValueError(f"the data has {len(self)} tokens, fewer than block_size + 1 ({block_size + 1})")
        g = torch.Generator().manual_seed(mix_seed(self.seed, step))
        starts = torch.randint(0, len(self) - block_size, (batch_size,), generator=g)  # the whole step's rows
        rows = batch_size // (accum * dp)
        mine = starts.view(accum, dp, rows)[micro, dp_rank]  # (rows,)
        window = mine[:, None] + torch.arange(block_size + 1)  # (rows, block_size + 1)
        chunk = self.tokens[window].long()
        if self.vocab_size is not None and chunk.numel() and int(chunk.max()) >= self.vocab_size:
            raise ValueError(f"step {step}: the data holds token id {int(chunk.max())}, not below the vocabulary "
                             f"size {self.vocab_size}")
        return chunk[:, :-1], chunk[:, 1:]

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        """The ids as text: ``"[id, id, ...]"`` (no tokenizer here)."""
        return str([int(t) for t in tokens])


class ByteData(TokenData):
    """A text as byte tokens (vocabulary 256), cut into deterministic ``(x, y)`` batches by step.

    Example::

        data = ByteData.from_text(default_corpus())
        train, val = data.split(0.1)                                       # the last 10% for validation
        x, y = train.batch(step, micro=0, batch_size=16, block_size=64, dp=2, dp_rank=1)   # (8, 64) each
    """

    def __init__(self, tokens: torch.Tensor, *, seed: int = 0, vocab_size: int | None = None) -> None:
        if tokens.dim() != 1 or tokens.dtype != torch.uint8:
            raise TypeError(f"tokens must be a 1-D uint8 tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        super().__init__(tokens, seed=seed, vocab_size=None)  # every byte is below any vocabulary >= 256

    @classmethod
    def from_text(cls, text: str, *, seed: int = 0) -> ByteData:
        return cls(torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8), seed=seed)

    @classmethod
    def from_file(cls, path: str | Path, *, seed: int = 0) -> ByteData:
        """The file's bytes, memory-mapped."""
        return cls(_mapped(Path(path), torch.uint8), seed=seed)

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def open_splits(data: str | None, *, seed: int, val_fraction: float,
                vocab_size: int | None = None) -> tuple[TokenData, TokenData]:
    """``(train, val)`` for a run: the built-in corpus (``data=None``) or a text file as bytes, split
    ``val_fraction`` from the end; or a directory holding nanoGPT's ``train.bin`` and ``val.bin``.

    Example::

        train, val = open_splits("data/shakespeare", seed=1337, val_fraction=0.1, vocab_size=50257)
    """
    if data is None:
        return ByteData.from_text(default_corpus(), seed=seed).split(val_fraction)
    path = Path(data)
    if not path.is_dir():
        return ByteData.from_file(path, seed=seed).split(val_fraction)
    return (TokenData.from_bin(path / "train.bin", seed=seed, vocab_size=vocab_size),
            TokenData.from_bin(path / "val.bin", seed=mix_seed(seed, 1), vocab_size=vocab_size))
