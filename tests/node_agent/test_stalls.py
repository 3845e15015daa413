"""A source that trickles (a byte now and then: never silent long enough for a socket's read
timeout) fails as Stalled, retried, instead of holding a download slot for ever; a slow but
steady one is staged. A real HTTP server on 127.0.0.1 that writes its answer slowly."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from loraplex.node_agent.adapter_files import WEIGHTS_FILE
from loraplex.node_agent.cli import Settings
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError
from loraplex.node_agent.warmer import RETRYABLE

from .helpers import make_adapter


class Trickle:
    """GET /<file> of an adapter directory, written `step` bytes every `every` seconds: the
    headers too where `headers` is set, else only the weights' body."""

    def __init__(self, root: Path, *, step: int, every: float, headers: bool = False) -> None:
        self.root, self.step, self.every, self.headers = root, step, every, headers
        self.url = ""
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> "Trickle":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                name = request.split(b" ", 2)[1].decode().lstrip("/")
                body = (self.root / name).read_bytes()
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                slow = name == WEIGHTS_FILE
                if self.headers and slow:
                    await self._trickle(writer, head)
                else:
                    writer.write(head)
                if slow:
                    await self._trickle(writer, body)
                else:
                    writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _trickle(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        for i in range(0, len(data), self.step):
            writer.write(data[i:i + self.step])
            await writer.drain()
            await asyncio.sleep(self.every)


async def _stage(tmp_path: Path, url: str, sha: str, **stall) -> tuple[AdapterStore, object]:
    async with aiohttp.ClientSession() as session:
        store = AdapterStore(tmp_path / "cache", 10**9, session=session, **stall)
        try:
            return store, await store.stage(AdapterRef("slow", url, sha))
        except StoreError as e:
            return store, e


@pytest.mark.parametrize("headers", [False, True], ids=["body", "headers"])
async def test_a_trickling_source_fails_as_stalled(tmp_path, headers):
    sha = make_adapter(tmp_path / "src", rank=8)
    async with Trickle(tmp_path / "src", step=8, every=0.05, headers=headers) as src:  # 160 B/s
        t0 = time.monotonic()
        store, err = await _stage(tmp_path, src.url, sha, stall_seconds=0.5, stall_bytes=1024)
        took = time.monotonic() - t0
    assert isinstance(err, StoreError) and err.reason == "Stalled", err
    assert err.status == 502 and "Stalled" in RETRYABLE
    assert "fewer than 1024 bytes" in str(err) and "0.5 s" in str(err)
    assert took < 3  # (the whole file, 8 bytes every 50 ms, takes minutes)
    assert store.metrics.failures.labels("Stalled")._value.get() == 1
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == [] and store.get("slow") is None
    assert store.metrics.downloads_in_flight._value.get() == 0 and store._reserved == 0


async def test_a_slow_steady_source_is_staged(tmp_path):
    """4 KiB every 50 ms (80 KiB/s) is above 1 KiB each 0.5 s all along: staged."""
    sha = make_adapter(tmp_path / "src", rank=8)
    async with Trickle(tmp_path / "src", step=4096, every=0.05) as src:
        store, staged = await _stage(tmp_path, src.url, sha, stall_seconds=0.5, stall_bytes=1024)
    assert not isinstance(staged, StoreError), staged
    assert Path(staged.path, WEIGHTS_FILE).read_bytes() == (tmp_path / "src" / WEIGHTS_FILE).read_bytes()


async def test_a_local_source_that_trickles_fails_as_stalled(tmp_path):
    """A mounted volume that hangs mid-file (a FIFO here, written a byte at a time)."""
    import os
    import threading

    src = tmp_path / "src"
    make_adapter(src, rank=8)
    os.unlink(src / WEIGHTS_FILE)
    os.mkfifo(src / WEIGHTS_FILE)
    stop = threading.Event()

    def writer():
        with open(src / WEIGHTS_FILE, "wb", buffering=0) as f:
            while not stop.wait(0.05):
                f.write(b"x")

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        store, err = await _stage(tmp_path, str(src), "0" * 64, stall_seconds=0.5, stall_bytes=1024)
    finally:
        stop.set()
        t.join(5)
    assert isinstance(err, StoreError) and err.reason == "Stalled", err
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == []


def test_the_stall_rule_is_set_by_flags():
    s = Settings.from_env_and_args(["--download-stall-seconds", "30", "--download-stall-bytes", "4096"], {})
    c = s.agent_config()
    assert (c.download_stall_seconds, c.download_stall_bytes) == (30.0, 4096)
    d = Settings.from_env_and_args([], {})
    assert (d.download_stall_seconds, d.download_stall_bytes) == (60.0, 65536)
    for bad in (["--download-stall-seconds", "0"], ["--download-stall-seconds", "nan"],
                ["--download-stall-bytes", "-1"]):
        with pytest.raises(ValueError, match=bad[0]):
            Settings.from_env_and_args(bad, {})


async def test_the_agent_passes_the_rule_to_its_store(tmp_path, client_factory):
    from loraplex.node_agent.app import AGENT, AgentConfig

    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9, download_stall_seconds=7.5,
                                              download_stall_bytes=123))
    store = client.app[AGENT].store
    assert (store.stall_seconds, store.stall_bytes) == (7.5, 123)


async def _collect(chunks, pause: float = 0.0) -> list[bytes]:
    out = []
    async for chunk in chunks:
        out.append(chunk)
        await asyncio.sleep(pause)
    return out


async def test_the_readers_own_time_is_not_the_sources():
    """Time spent between chunks by the reader (writing to disk, waiting for budget) does not
    count against the source: a source that answers at once is never Stalled."""
    from loraplex.node_agent.sources import Stall

    async def prompt():
        for _ in range(4):
            yield b"x"

    chunks = await _collect(Stall(0.1, 1024).guard(prompt(), "f"), pause=0.15)
    assert chunks == [b"x"] * 4


async def test_no_bytes_at_all_is_stalled_even_with_min_bytes_0():
    from loraplex.node_agent.sources import SourceError, Stall

    async def silent_after_one():
        yield b"x"
        await asyncio.sleep(30)
        yield b"y"

    with pytest.raises(SourceError, match="the source stalled") as err:
        await asyncio.wait_for(_collect(Stall(0.2, 0).guard(silent_after_one(), "f")), 5)
    assert err.value.reason == "Stalled"
