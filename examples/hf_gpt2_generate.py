"""Generate text with a Hugging Face GPT-2, its weights sharded across tensor-parallel ranks.

    python examples/hf_gpt2_generate.py --model-dir path/to/gpt2 --prompt "Hello, I'm a language model,"
    python examples/hf_gpt2_generate.py --model-dir path/to/gpt2 --prompt-ids 15496,11 --temperature 0
    python examples/hf_gpt2_generate.py --model-dir path/to/gpt2 --tp 4 --max-new-tokens 50 --top-k 40

``--model-dir`` is a local directory written by ``save_pretrained`` (nothing is
downloaded). Every rank loads the ``GPT2LMHeadModel`` from it and keeps ``1/tp``
of its weights with ``GPT.from_hf``; ``GPT.generate`` then samples the next
token from logits gathered over the ranks (``--temperature 0``: the most likely
token). When the directory also holds a tokenizer, ``--prompt`` is text and the
result is decoded; without one, give the prompt as token ids (``--prompt-ids 1,2,3``).
Every rank checks that all ranks generated the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tensorpar
from layers import GPT

#: Files whose presence means the directory holds a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


def run(model_dir: str, prompt: str | None, prompt_ids: list[int] | None, max_new_tokens: int,
        temperature: float, top_k: int | None, seed: int) -> dict[str, Any]:
    """On every rank: load and shard the model, generate, and check the ranks agree."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    mesh = tensorpar.init()  # every spawned rank is a tp rank
    hf = GPT2LMHeadModel.from_pretrained(model_dir, local_files_only=True).eval().to(mesh.device)
    tokenizer = None
    if has_tokenizer(Path(model_dir)):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if prompt_ids is None:
        if tokenizer is None:
            raise ValueError(f"{model_dir} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): "
                             "give the prompt as token ids with --prompt-ids")
        prompt_ids = tokenizer.encode(prompt)
        if not prompt_ids:
            raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
    vocab = hf.config.vocab_size
    bad = [i for i in prompt_ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad} are out of range for the model's vocabulary of {vocab} "
                         f"(ids must be in [0, {vocab}))")

    gpt = GPT.from_hf(hf)
    del hf  # this rank keeps only its shards
    tensorpar.manual_seed(seed)  # the same sampling stream on every rank
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=gpt.lm_head.weight.device)  # (1, T)
    tokens = gpt.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)[0].tolist()

    mine = torch.tensor(tokens, device=idx.device)  # (T,); every rank generated T tokens
    lowest, highest = mine.clone(), mine.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=mesh.tp_group)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=mesh.tp_group)
    return {
        "rank": mesh.rank,
        "tokens": tokens,
        "prompt_len": len(prompt_ids),
        "all_ranks_agree": torch.equal(lowest, highest),
        "text": tokenizer.decode(tokens) if tokenizer is not None else None,
        "local_params": sum(p.numel() for p in gpt.parameters()),
    }


def parse_ids(text: str) -> list[int]:
    """``"1,2,3"`` (commas and/or spaces) -> ``[1, 2, 3]``."""
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="a local GPT-2 directory (save_pretrained)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (local processes)")
    parser.add_argument("--prompt", help="prompt text (needs a tokenizer in --model-dir)")
    parser.add_argument("--prompt-ids", type=parse_ids, help="prompt as token ids, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token (greedy)")
    parser.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()

    try:
        have_transformers = importlib.util.find_spec("transformers") is not None
    except ImportError:
        have_transformers = False
    if not have_transformers:
        parser.exit(2, f"{parser.prog}: error: this example reads the model with transformers: "
                       "pip install 'tensorpar[hf]'\n")

    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir} is not a saved model (no config.json in it)")
    tokenizer = has_tokenizer(args.model_dir)
    if args.prompt is not None and args.prompt_ids is not None:
        parser.error("give either --prompt or --prompt-ids, not both")
    if args.prompt is not None and not tokenizer:
        parser.error(f"--prompt needs a tokenizer in {args.model_dir} (none of {', '.join(TOKENIZER_FILES)}); "
                     "give the prompt as token ids with --prompt-ids")
    if args.prompt is None and args.prompt_ids is None:
        if not tokenizer:
            parser.error(f"{args.model_dir} holds no tokenizer: give the prompt as token ids with --prompt-ids")
        args.prompt = "Hello, I'm a language model,"
    vocab = json.loads((args.model_dir / "config.json").read_text()).get("vocab_size")
    bad = [i for i in args.prompt_ids or [] if isinstance(vocab, int) and not 0 <= i < vocab]
    if bad:
        parser.error(f"prompt token ids {bad} are out of range for the model's vocabulary of {vocab} "
                     f"(ids must be in [0, {vocab}))")
    if args.tp < 1:
        parser.error(f"--tp must be a positive integer, got {args.tp}")
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0, got {args.top_k}")

    try:
        results = tensorpar.spawn(run, args.tp, str(args.model_dir), args.prompt, args.prompt_ids,
                                  args.max_new_tokens, args.temperature, args.top_k or None, args.seed)
    except tensorpar.RankError as e:
        if isinstance(e.__cause__, (ValueError, OSError)):  # bad input: say so without the traceback
            parser.exit(2, f"{parser.prog}: error: {e.__cause__}\n")
        raise

    first = results[0]
    n = first["prompt_len"]
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-k {args.top_k or 'off'}"
    shares = ", ".join(f"rank {r['rank']}: {r['local_params']:,}" for r in results)
    print(f"GPT-2 from {args.model_dir}, sharded at tp={args.tp} ({shares} parameters); {mode}")
    print(f"prompt ids: {first['tokens'][:n]}")
    print(f"new ids: {first['tokens'][n:]}")
    print(f"tokens: {first['tokens']}")
    if first["text"] is not None:
        print(f"text: {first['text']!r}")
    if not all(r["all_ranks_agree"] and r["tokens"] == first["tokens"] for r in results):
        for r in results:
            print(f"rank {r['rank']}: {r['tokens']}", file=sys.stderr)
        raise SystemExit("MISMATCH: the ranks generated different tokens")
    print(f"OK: all {args.tp} ranks generated the same {len(first['tokens']) - n} new tokens")


if __name__ == "__main__":
    main()
