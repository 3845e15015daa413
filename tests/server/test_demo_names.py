"""The demo's own requests, as a first-time user reads them.

With `--served-model-name NAME` they went to "base" whatever the base was called, got 404s,
and the demo printed httpx's "Client error '404 Not Found'" (with a link to a web page on
HTTP status codes) instead of the four answers. A request the server refuses (a
--max-model-len too short for the demo's prompts) said only "400 Bad Request", not why, and
the demo then printed nothing about how to reach the server that went on serving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def demo_log(tmp_path, *args: str, until: str = "models:") -> str:
    """The demo's output up to the line holding `until` (the server keeps running: stopped here)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from loraplex.server.cli import main; sys.exit(main())",
                             "--demo", "--port", "0", *args],
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
            if until in line:
                break
        return "".join(lines)
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_demo_requests_use_the_served_model_name(tmp_path):
    log = demo_log(tmp_path, "--served-model-name", "tiny-base")
    assert "demo requests failed" not in log, log
    assert "model=tiny-base" in log and "model=poet" in log, log


def test_the_demo_shows_an_adapter_held_to_a_json_schema(tmp_path):
    import json

    import pytest

    from loraplex.server.cli import DEMO_SCHEMA
    from loraplex.server.structured import available

    if not available():
        pytest.skip("xgrammar is not installed")
    log = demo_log(tmp_path)
    line = next((ln for ln in log.splitlines() if "held to a JSON schema" in ln), None)
    assert line is not None, log
    value = json.loads(line.split("-> ", 1)[1])
    assert set(value) == set(DEMO_SCHEMA["required"]) and value["table"] in ("users", "orders", "items"), line


def test_a_refused_demo_request_says_why_and_how_to_reach_the_server(tmp_path):
    log = demo_log(tmp_path, "--max-model-len", "16")
    assert "demo requests failed" in log and "400" in log and "maximum context length" in log, log
    assert "developer.mozilla.org" not in log, log
    assert "try it:" in log and "models:" in log, log
