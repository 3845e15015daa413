"""Lets a benchmark import `loraplex` from a bare checkout, with nothing installed; and the
command-line arguments the engine benchmarks share.

The GPU machine runs `python3 bench/<name>.py` on a copy of the working tree; when
`loraplex` is not installed there, the package folders are mapped under a temporary
`loraplex` namespace, as pyproject's package-dir does for an install. Each benchmark
calls `use_checkout()` before its first `loraplex` import.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "server", "node_agent", "operator")


def use_checkout() -> None:
    try:
        import loraplex.kernels  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="loraplex-checkout-")) / "loraplex"
        shim.mkdir()
        for name in PACKAGES:
            (shim / name).symlink_to(ROOT / name)
        sys.path.insert(0, str(shim.parent))


def engine_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the arguments every engine-level benchmark takes: --out, and the
    dummy-weights model it builds (--shape, --device, --dtype, --rank)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--shape", default="llama-3-8b", help="dummy-weights shape (default llama-3-8b)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default auto)")
    p.add_argument("--dtype", default="auto", help="bfloat16 on CUDA, float32 on CPU by default")
    p.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    return p
