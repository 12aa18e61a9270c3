"""Record a benchmark's figures as one section of benchmarks/RESULTS.md, keeping the others."""

import datetime
import os
import platform
import re
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    return (f"Measured {datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, "
            f"{platform.python_implementation()} {platform.python_version()}, torch {torch.__version__}")


def write_section(title: str, body: str) -> None:
    """Replace (or add) the ``## title`` section of RESULTS.md with ``body``."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")
