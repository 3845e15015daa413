"""A weights body that announces no length (no Content-Length, not chunked: an HTTP/1.0-style
answer read to the connection's close) and is cut mid-body ends with no HTTP error. The store
must still call it what it is, a cut download (Truncated: the warmer retries it with backoff),
not a bad adapter (DigestMismatch / InvalidAdapter: given up on until the plan changes)."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import aiohttp
import pytest

from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError
from loraplex.node_agent.warmer import RETRYABLE

from .helpers import make_adapter


class _CloseDelimited:
    """GET <root>/<path>, weights sent with no Content-Length, the connection closed at the end;
    `body(bytes) -> bytes` changes what is sent of them (default: half)."""

    def __init__(self, root: Path, body=lambda b: b[: len(b) // 2]) -> None:
        outer = self
        self.body = body

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                data = (root / self.path.lstrip("/")).read_bytes()
                weights = self.path.endswith(".safetensors")
                self.send_response(200)
                if not weights:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(outer.body(data) if weights else data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


async def _stage(tmp_path: Path, src: _CloseDelimited, sha: str | None):
    async with aiohttp.ClientSession() as session:
        store = AdapterStore(tmp_path / "cache", 1 << 20, session=session)
        with pytest.raises(StoreError) as info:
            await store.stage(AdapterRef("a", f"{src.url}/a/", sha))
    return store, info.value


@pytest.mark.parametrize("with_sha", [False, True])
@pytest.mark.parametrize("keep", [0, 5, 40, 0.5, -1])
async def test_a_close_delimited_body_cut_short_is_truncated_and_retried(tmp_path, with_sha, keep):
    sha = make_adapter(tmp_path / "src" / "a")
    cut = (lambda b: b[:-1]) if keep == -1 else (lambda b: b[: int(len(b) * keep) if isinstance(keep, float) else keep])
    with _CloseDelimited(tmp_path / "src", cut) as src:
        store, err = await _stage(tmp_path, src, sha if with_sha else None)
    assert err.reason == "Truncated", err
    assert err.reason in RETRYABLE and err.status == 502
    assert store.list() == []
    root = tmp_path / "cache"
    assert list((root / ".tmp").iterdir()) == [] and list((root / ".store").iterdir()) == []
    assert not (root / "a").exists()


async def test_a_close_delimited_body_that_is_whole_but_wrong_stays_a_bad_adapter(tmp_path):
    """Bytes past the last tensor are not a cut: still InvalidAdapter (not retried)."""
    make_adapter(tmp_path / "src" / "a")
    with _CloseDelimited(tmp_path / "src", lambda b: b + b"junk") as src:
        _, err = await _stage(tmp_path, src, None)
    assert err.reason == "InvalidAdapter"


async def test_a_close_delimited_whole_body_with_a_wrong_sha256_stays_a_digest_mismatch(tmp_path):
    make_adapter(tmp_path / "src" / "a")
    with _CloseDelimited(tmp_path / "src", lambda b: b) as src:
        _, err = await _stage(tmp_path, src, "0" * 64)
    assert err.reason == "DigestMismatch"
