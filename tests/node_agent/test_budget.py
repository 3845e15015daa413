"""The disk budget while bytes are written, and the disk itself: a source that does not say
how big its file is (no Content-Length) must not take the cache over its budget before the
download ends; a serving copy without room is never written; a smaller budget at restart is
kept; a full disk is a clear failure that leaves nothing behind.

The streaming sources here are real HTTP servers on 127.0.0.1 that send the weights in small
chunks, with no Content-Length, and measure the cache directory on disk between chunks.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError

from .helpers import make_adapter

CHUNK = 16 * 1024


def disk_bytes(root: Path) -> int:
    """Bytes of every regular file under `root` (staged versions and downloads in progress)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath, f)
            if not p.is_symlink():
                total += p.stat().st_size
    return total


@dataclass
class StreamingSource:
    """GET /<name>/<file>: the config whole, the weights chunked without a length (or for ever)."""

    url: str = ""
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    endless: set[str] = field(default_factory=set)
    watch: Path | None = None  # a cache directory measured between chunks
    peak: int = 0

    def add(self, name: str, directory: Path) -> str:
        self.files[name] = {f: (directory / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE)}
        return f"{self.url}/{name}/"

    def measure(self) -> None:
        if self.watch is not None:
            self.peak = max(self.peak, disk_bytes(self.watch))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name, filename = request.match_info["name"], request.match_info["file"]
        files = self.files.get(name)
        if files is None:
            raise web.HTTPNotFound()
        if filename == CONFIG_FILE:
            return web.Response(body=files[CONFIG_FILE])
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        body = files[WEIGHTS_FILE]
        sent = 0
        while sent < len(body) or name in self.endless:
            await resp.write(body[sent:sent + CHUNK] if sent < len(body) else b"\0" * CHUNK)
            sent += CHUNK
            await asyncio.sleep(0.002)  # the agent writes what it got
            self.measure()
        await resp.write_eof()
        return resp


@pytest.fixture
async def streaming_source():
    src = StreamingSource()
    app = web.Application()
    app.router.add_get("/{name}/{file}", src.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    src.url = str(server.make_url("")).rstrip("/")
    yield src
    await server.close()


def _adapter(tmp_path: Path, name: str, seed: int) -> tuple[Path, str]:
    d = tmp_path / "volume" / name
    sha = make_adapter(d, seed=seed, rank=16, hidden=256)
    return d, sha


def _size(d: Path) -> int:
    return sum((d / f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE))


async def test_a_download_of_unknown_size_evicts_as_it_grows(tmp_path, session, streaming_source):
    """The cache is full of unpinned adapters; an adapter whose source gives no length
    arrives. It used to be written whole beside them (the budget checked only once it had
    ended: the disk held 4 adapters under a budget of 3); it must evict the least recently
    used as it grows, so the disk never holds more than the budget."""
    root = tmp_path / "cache"
    dirs = [_adapter(tmp_path, n, i) for i, n in enumerate(["a", "b", "c", "d"])]
    size = _size(dirs[0][0])
    budget = 3 * size + 1024
    store = AdapterStore(root, budget, session=session)
    for name, (d, sha) in zip("abc", dirs):
        await store.stage(AdapterRef(name, str(d), sha))
    streaming_source.watch = root
    src = streaming_source.add("d", dirs[3][0])
    staged = await store.stage(AdapterRef("d", src, dirs[3][1]))
    assert staged.bytes == size
    assert streaming_source.peak <= budget, (streaming_source.peak, budget)
    assert sorted(a.name for a in store.list()) == ["b", "c", "d"]  # a: least recently used
    assert store.used_bytes <= budget and disk_bytes(root) <= budget
    assert list((root / ".tmp").iterdir()) == []


async def test_a_download_of_unknown_size_stops_once_it_cannot_fit(tmp_path, session, streaming_source):
    """Pinned adapters fill the budget; an unpinned adapter's source streams without a
    length, and never ends. The download must stop as soon as it outgrows the room it may
    take (it used to write a whole budget's worth beside the pinned set first), fail with
    BudgetExceeded saying so, evict nothing and leave nothing behind."""
    root = tmp_path / "cache"
    dirs = [_adapter(tmp_path, n, i) for i, n in enumerate(["p1", "p2", "x"])]
    size = _size(dirs[0][0])
    budget = 3 * size
    store = AdapterStore(root, budget, session=session)
    store.set_pinned({"p1", "p2"})
    for name, (d, sha) in zip(["p1", "p2"], dirs):
        await store.stage(AdapterRef(name, str(d), sha))
    streaming_source.watch = root
    src = streaming_source.add("x", dirs[2][0])
    streaming_source.endless.add("x")
    with pytest.raises(StoreError) as err:
        await asyncio.wait_for(store.stage(AdapterRef("x", src, None)), 30)
    assert err.value.reason == "BudgetExceeded" and err.value.status == 507
    assert "budget" in str(err.value)
    assert streaming_source.peak <= budget, (streaming_source.peak, budget)
    assert sorted(a.name for a in store.list()) == ["p1", "p2"]
    assert list((root / ".tmp").iterdir()) == [] and not os.path.lexists(root / "x")
    assert store.metrics.failures.labels("BudgetExceeded")._value.get() == 1


async def test_downloads_of_unknown_size_at_once_share_the_budget(tmp_path, session, streaming_source):
    """Two downloads without a length run together into an empty cache with room for one
    adapter and a half. They used to be written whole side by side (two adapters on disk),
    the budget checked only at their ends; now at most one fails, while it runs (not both:
    the later one waits for room the earlier one holds), one ends staged, and the disk never
    holds more than the budget."""
    root = tmp_path / "cache"
    dirs = [_adapter(tmp_path, n, i) for i, n in enumerate(["e", "f"])]
    size = _size(dirs[0][0])
    budget = int(1.5 * size)
    store = AdapterStore(root, budget, session=session)
    streaming_source.watch = root
    refs = [AdapterRef(n, streaming_source.add(n, d), sha) for n, (d, sha) in zip("ef", dirs)]
    results = await asyncio.gather(*(store.stage(r) for r in refs), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, StoreError) and r.reason == "BudgetExceeded" for r in failed), results
    # The earlier fails when it meets room the later one holds; the later waits when it meets
    # room the earlier one holds, then evicts it once it is staged. Never both fail.
    assert len(failed) <= 1 and len(store.list()) == 1
    assert streaming_source.peak <= budget, (streaming_source.peak, budget)
    assert store.used_bytes <= budget and list((root / ".tmp").iterdir()) == []


async def test_a_smaller_budget_at_restart_is_kept(tmp_path, session):
    """The agent restarts with a smaller --budget-bytes (the node's disk is wanted for
    something else). What it had staged stayed on disk over the new budget until some
    download happened to evict (for ever, on a node whose plan does not change); now it
    evicts least recently used adapters at start until the staged bytes fit."""
    root = tmp_path / "cache"
    dirs = [_adapter(tmp_path, n, i) for i, n in enumerate("abc")]
    size = _size(dirs[0][0])
    store = AdapterStore(root, 3 * size, session=session)
    for i, (name, (d, sha)) in enumerate(zip("abc", dirs)):
        await store.stage(AdapterRef(name, str(d), sha))
        os.utime(root / ".store" / Path(os.readlink(root / name)).name, (1000 + i, 1000 + i))
    smaller = AdapterStore(root, 2 * size, session=session)
    assert sorted(a.name for a in smaller.list()) == ["b", "c"]  # a: least recently used
    assert smaller.used_bytes <= 2 * size
    assert not os.path.lexists(root / "a")
    assert smaller.metrics.evictions._value.get() == 1
    assert AdapterStore(root, 3 * size, session=session).used_bytes == 2 * size  # nothing more to do


@pytest.mark.parametrize("staged_before", [False, True])
async def test_a_serving_copy_without_room_is_never_written(tmp_path, session, monkeypatch, staged_before):
    """The bf16 copy of an adapter's F32 weights takes only free budget. It used to be written
    first and measured after, then deleted when it did not fit: for that while the disk held
    up to half an adapter more than the budget. Its size is known from the header, so a copy
    without room is never written at all (at staging, and for a version staged before)."""
    import loraplex.node_agent.store as store_module

    root = tmp_path / "cache"
    (d1, sha1), (d2, sha2) = _adapter(tmp_path, "first", 1), _adapter(tmp_path, "second", 2)
    size = _size(d1)
    budget = 2 * size + 1024
    store = AdapterStore(root, budget, session=session)
    await store.stage(AdapterRef("first", str(d1), sha1))
    if staged_before:
        await store.stage(AdapterRef("second", str(d2), sha2))
    peaks = []
    real = store_module.write_serving_copy

    def measured(directory, dtype):  # the real conversion, and the disk right after it
        out = real(directory, dtype)
        peaks.append(disk_bytes(root))
        return out

    monkeypatch.setattr(store_module, "write_serving_copy", measured)
    staged = await store.stage(AdapterRef("second", str(d2), sha2, "bfloat16"))
    assert staged.bytes == size and store.used_bytes == 2 * size
    assert all(p <= budget for p in peaks), (peaks, budget)
    assert not any(p.name.startswith("adapter_model.bfloat16") for p in (root / "second").iterdir())


async def test_a_full_disk_is_a_clear_507_and_leaves_nothing(tmp_path, session, monkeypatch):
    """The disk fills up under the budget (a budget larger than the disk, or other files on
    it): the write's ENOSPC (here as a filesystem with delayed allocation reports it, at
    fsync) was a 500 DiskError with a traceback, as if the agent had a bug. It is a 507
    DiskFull saying so, with nothing left in .tmp and no budget left reserved."""
    import errno

    root = tmp_path / "cache"
    d, sha = _adapter(tmp_path, "a", 1)
    store = AdapterStore(root, 10**9, session=session)
    real_fsync = os.fsync

    def full(fd):
        if os.fstat(fd).st_size > 1 << 16:  # the weights, not a small file or a directory
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef("a", str(d), sha))
    assert err.value.reason == "DiskFull" and err.value.status == 507
    assert "no space left" in str(err.value).lower() and str(root) in str(err.value)
    assert list((root / ".tmp").iterdir()) == [] and store.get("a") is None
    assert store._reserved == 0 and store.metrics.failures.labels("DiskFull")._value.get() == 1
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert (await store.stage(AdapterRef("a", str(d), sha))).sha256 == sha  # room again: it stages


async def test_a_full_disk_when_linking_leaves_no_orphan_version(tmp_path, session, monkeypatch):
    """The disk fills up at the last step, the name's symlink (a full inode table, say): the
    verified version directory had been moved into .store already and stayed there, in
    neither the entries nor the budget, until the next start."""
    import errno

    root = tmp_path / "cache"
    d, sha = _adapter(tmp_path, "a", 1)
    store = AdapterStore(root, 10**9, session=session)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "symlink", full)
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef("a", str(d), sha))
    assert err.value.reason == "DiskFull"
    assert list((root / ".store").iterdir()) == [] and list((root / ".tmp").iterdir()) == []
    assert store.used_bytes == 0 and store._reserved == 0 and disk_bytes(root) == 0
