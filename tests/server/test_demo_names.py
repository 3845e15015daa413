"""`loraplex-server --demo --served-model-name NAME`: the demo's own requests go to NAME.

They went to "base" whatever the base was called, got 404s, and the demo printed httpx's
"Client error '404 Not Found'" (with a link to a web page on HTTP status codes) instead of
the four answers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def test_demo_requests_use_the_served_model_name(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from loraplex.server.cli import main; sys.exit(main())",
                             "--demo", "--port", "0", "--served-model-name", "tiny-base"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).parent)  # not the repository root: its operator/ folder
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "try it:" in line or "demo requests failed" in line:
                break
        log = "".join(lines)
        assert "demo requests failed" not in log, log
        assert "model=tiny-base" in log and "model=poet" in log, log
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
