"""Checkpoints on a plain install (torch, einops and numpy: no safetensors)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoints_work_without_safetensors(tmp_path):
    """As after a plain ``pip install tensorpar``: save, verify, load and export the state dict; the
    safetensors export names the extra it needs."""
    code = f"""
import sys
sys.modules["safetensors"] = None  # importing it fails
import torch, tensorpar
from tensorpar import checkpoint
sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT)!r}]
from checkpoint_cases import bitwise_equal
from examples.export_safetensors import export_safetensors
tensorpar.init()
torch.manual_seed(0)
model, other = torch.nn.Linear(3, 2).to(torch.bfloat16), torch.nn.Linear(3, 2).to(torch.bfloat16)
optimizer, other_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(other.parameters())
model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
optimizer.step()
checkpoint.save("ckpt", model, optimizer, step=1)
checkpoint.load("ckpt", other, other_optimizer)
try:
    export_safetensors("ckpt", "model.safetensors")
except ImportError as e:
    print("safetensors" in str(e), end=" ")
print(checkpoint.read_meta("ckpt")["step"], bitwise_equal(model.state_dict(), other.state_dict()),
      bitwise_equal(optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]),
      bitwise_equal(checkpoint.export_state_dict("ckpt"), model.state_dict()))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "1", "True", "True", "True"], done.stdout
