"""``python -m tensorpar.checkpoint``: a checkpoint's unsharded model in torch's DCP format or as one
safetensors file, without a process group.

Example::

    python -m tensorpar.checkpoint to-dcp out out-dcp                 # the newest checkpoint of out
    python -m tensorpar.checkpoint safetensors out/step-000100 model.safetensors
"""

from __future__ import annotations

import argparse
import sys

from . import CheckpointError, export_safetensors, to_dcp


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names; return the exit status (1, with the error, for a refused checkpoint)."""
    parser = argparse.ArgumentParser(prog="python -m tensorpar.checkpoint",
                                     description="a checkpoint's unsharded model, without a process group")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, what in (("to-dcp", "a new torch.distributed.checkpoint directory"),
                       ("safetensors", "a safetensors file")):
        command = commands.add_parser(name, help=f"write the unsharded model as {what}")
        command.add_argument("checkpoint", help="a checkpoint directory, or the directory whose 'latest' names one")
        command.add_argument("out", help=what)
    args = parser.parse_args(argv)
    try:
        out = (to_dcp if args.command == "to-dcp" else export_safetensors)(args.checkpoint, args.out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
