"""The server's own fetch path (no node agent: `fetch_adapter` downloads http(s) itself) against
a source that misbehaves: a body cut short with no Content-Length (an HTTP/1.0-style answer
read to the connection's close) must never be renamed into the cache as the adapter."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from loraplex.server.adapter_sources import AdapterLoadError, fetch_adapter


def _adapter(d: Path) -> None:
    d.mkdir(parents=True)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": np.ones((4, 32), np.float32),
               f"{key}.lora_B.weight": np.ones((32, 4), np.float32)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"]}))


class _Source:
    """GET <root>/<path>; the weights' body in `mode`: ok, or cut (half of it, no
    Content-Length, the connection closed: the client sees a normal end of body)."""

    def __init__(self, root: Path, mode: str = "ok") -> None:
        outer = self
        self.mode = mode

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                body = (root / self.path.lstrip("/")).read_bytes()
                cut = outer.mode == "cut" and self.path.endswith(".safetensors")
                self.send_response(200)
                if not cut:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if cut else body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_body_cut_short_without_content_length_is_not_staged_as_the_adapter(tmp_path):
    """With no Content-Length and no sha256, a cut body was renamed into <cache>/<name>/ with
    its record: every later load took the half file for the adapter (and failed on it) instead
    of fetching it again. It fails as a fetch and leaves nothing in the cache."""
    _adapter(tmp_path / "src" / "a")
    cache = tmp_path / "cache"
    with _Source(tmp_path / "src", "cut") as src:
        with pytest.raises(AdapterLoadError) as info:
            fetch_adapter("a", f"{src.url}/a", None, cache, None)
    assert info.value.reason == "fetch"
    assert "not a whole adapter" in str(info.value)
    assert list(cache.iterdir()) == []


def test_a_failed_refetch_leaves_the_version_staged_before(tmp_path):
    _adapter(tmp_path / "src" / "a")
    cache = tmp_path / "cache"
    with _Source(tmp_path / "src") as src:
        path = fetch_adapter("a", f"{src.url}/a", None, cache, None)
        whole = (path / "adapter_model.safetensors").read_bytes()
        src.mode = "cut"
        with pytest.raises(AdapterLoadError):
            fetch_adapter("a", f"{src.url}/a", None, cache, None)
    assert (cache / "a" / "adapter_model.safetensors").read_bytes() == whole
    assert sorted(p.name for p in cache.iterdir()) == ["a"]


def test_a_crashed_fetch_s_folder_is_removed_once_idle_and_nothing_else(tmp_path):
    """A server killed mid-download left <cache>/.<name>.<random>/ with part of the adapter's
    bytes, and no later start or fetch ever removed it: a node's disk filled with them. A fetch
    (and a server's start) removes the ones nothing has written for ABANDONED_FETCH_SECONDS; a
    fetch in flight elsewhere, adapters, and the node agent's folders stay."""
    import os
    import time

    from loraplex.server.adapter_sources import ABANDONED_FETCH_SECONDS, sweep_abandoned_fetches

    cache = tmp_path / "cache"
    _adapter(cache / "kept")
    old = time.time() - ABANDONED_FETCH_SECONDS - 5

    def folder(name: str, touched: float) -> Path:
        d = cache / name
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"\0" * 1024)
        for p in (d / "adapter_model.safetensors", d):
            os.utime(p, (touched, touched))
        return d

    folder(".sql-v2.k3j_9x0a", old)  # a crash's
    folder(".tmp", old)  # the node agent's downloads folder, were the cache its
    live = folder(".chat.abcd1234", time.time() - 30)  # a fetch in flight, written 30 s ago
    stale_dir_fresh_file = folder(".qa.zzzzzzzz", old)
    os.utime(stale_dir_fresh_file / "adapter_model.safetensors")  # still being written
    for p in (cache / "kept", cache / "kept" / "adapter_config.json"):
        os.utime(p, (old, old))

    _adapter(tmp_path / "src" / "a")
    with _Source(tmp_path / "src") as src:
        fetch_adapter("a", f"{src.url}/a", None, cache, None)
    assert sorted(p.name for p in cache.iterdir()) == [".chat.abcd1234", ".qa.zzzzzzzz", ".tmp", "a", "kept"]
    # Once the one in flight is idle as long, it goes too.
    later = time.time() + ABANDONED_FETCH_SECONDS
    assert sorted(sweep_abandoned_fetches(cache, now=later)) == [live.name, stale_dir_fresh_file.name]
    assert sorted(p.name for p in cache.iterdir()) == [".tmp", "a", "kept"]
