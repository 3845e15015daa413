"""Lets a benchmark import `loraplex` from a bare checkout, with nothing installed.

The GPU machine runs `python3 bench/<name>.py` on a copy of the working tree; when
`loraplex` is not installed there, the package folders are mapped under a temporary
`loraplex` namespace, as pyproject's package-dir does for an install. Each benchmark
calls `use_checkout()` before its first `loraplex` import.
"""

from __future__ import annotations

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
