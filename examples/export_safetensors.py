"""``python examples/export_safetensors.py CHECKPOINT OUT``: a checkpoint's unsharded model as one safetensors
file, without a process group (torch's ``dcp_to_torch_save`` reads a checkpoint as it is, to a torch.save file)."""

import argparse
import os
from pathlib import Path

from tensorpar.checkpoint import CheckpointError, export_state_dict


def export_safetensors(checkpoint: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's unsharded model state dict to the safetensors file ``out_file`` (replaced only when
    complete) through the ``safetensors`` package (``pip install 'tensorpar[hf]'``)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError("exporting to safetensors needs the safetensors package: pip install 'tensorpar[hf]'"
                          ) from None
    out = Path(out_file)
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    save_file({k: v.contiguous() for k, v in export_state_dict(checkpoint).items()}, str(tmp))
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the command: 0, or exit with status 1 and the error for a refused checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory, or the directory whose 'latest' names one")
    parser.add_argument("out", help="the safetensors file to write")
    args = parser.parse_args(argv)
    try:
        print(export_safetensors(args.checkpoint, args.out))
    except CheckpointError as e:
        parser.exit(1, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
