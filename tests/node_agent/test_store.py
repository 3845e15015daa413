"""The local adapter store: real files, real HTTP on 127.0.0.1, fake clock for LRU."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError

from .helpers import make_adapter


def open_store(root: Path, session, clock=None, budget: int = 10**9, downloads: int = 4) -> AdapterStore:
    kw = {"clock": clock} if clock is not None else {}
    return AdapterStore(root, budget, downloads, session=session, **kw)


def assert_clean(root: Path, absent: list[str]) -> None:
    """Nothing half-done is left: no temp files, no final path for failed adapters."""
    assert list((root / ".tmp").iterdir()) == []
    for name in absent:
        assert not os.path.lexists(root / name)
    linked = {Path(os.readlink(p)).name for p in root.iterdir() if p.is_symlink()}
    assert {p.name for p in (root / ".store").iterdir()} == linked  # no orphan versions


async def test_stage_over_http(tmp_path, object_store, session):
    src = object_store.add("sql-v2", tmp_path)
    store = open_store(tmp_path / "cache", session)
    staged = await store.stage(AdapterRef("sql-v2", src, object_store.adapters["sql-v2"].sha256))
    final = tmp_path / "cache" / "sql-v2"
    assert staged.path == str(final)
    assert (final / WEIGHTS_FILE).read_bytes() == object_store.adapters["sql-v2"].files[WEIGHTS_FILE]
    assert (final / CONFIG_FILE).read_bytes() == object_store.adapters["sql-v2"].files[CONFIG_FILE]
    assert staged.bytes == sum(len(b) for b in object_store.adapters["sql-v2"].files.values())
    assert store.used_bytes == staged.bytes
    assert_clean(tmp_path / "cache", [])
    # Staged already: no second download.
    await store.stage(AdapterRef("sql-v2", src, object_store.adapters["sql-v2"].sha256))
    assert object_store.gets["sql-v2/" + WEIGHTS_FILE] == 1


@pytest.mark.parametrize("form", ["path", "file-uri"])
async def test_stage_from_local_paths(tmp_path, session, form):
    sha = make_adapter(tmp_path / "volume" / "chat", seed=3)
    src = str(tmp_path / "volume" / "chat")
    if form == "file-uri":
        src = (tmp_path / "volume" / "chat").as_uri()
    store = open_store(tmp_path / "cache", session)
    staged = await store.stage(AdapterRef("chat", src, sha))
    assert Path(staged.path, WEIGHTS_FILE).read_bytes() == (tmp_path / "volume" / "chat" / WEIGHTS_FILE).read_bytes()


async def test_chunked_download_without_length(tmp_path, object_store, session):
    src = object_store.add("chunky", tmp_path, mode="chunked")
    store = open_store(tmp_path / "cache", session)
    staged = await store.stage(AdapterRef("chunky", src, object_store.adapters["chunky"].sha256))
    assert Path(staged.path, WEIGHTS_FILE).stat().st_size == len(object_store.adapters["chunky"].files[WEIGHTS_FILE])


FAILURES = [
    # (what the store serves, how the ref is wrong, expected reason)
    ("ok", "wrong-digest", "DigestMismatch"),
    ("ok", "missing", "NotFound"),
    ("cut", "", "Truncated"),
    ("ok", "bad-scheme", "Unsupported"),
    ("ok", "bad-name", "InvalidRequest"),
    ("ok", "bad-sha", "InvalidRequest"),
]


@pytest.mark.parametrize("mode,wrong,reason", FAILURES)
async def test_failures_leave_nothing_that_looks_whole(tmp_path, object_store, session, mode, wrong, reason):
    good = object_store.add("good", tmp_path, seed=1)
    src = object_store.add("bad", tmp_path, seed=2, mode=mode)
    sha = object_store.adapters["bad"].sha256
    name = "bad"
    if wrong == "wrong-digest":
        sha = object_store.adapters["good"].sha256
    elif wrong == "missing":
        src = object_store.source("nowhere")
    elif wrong == "bad-scheme":
        src = "s3://bucket/bad/"
    elif wrong == "bad-name":
        name = "../escape"
    elif wrong == "bad-sha":
        sha = "abc"
    store = open_store(tmp_path / "cache", session)
    await store.stage(AdapterRef("good", good, object_store.adapters["good"].sha256))
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef(name, src, sha))
    assert err.value.reason == reason
    assert assert_clean(tmp_path / "cache", ["bad"]) is None
    assert not (tmp_path / "escape").exists()
    # The other adapter is untouched.
    assert [a.name for a in store.list()] == ["good"]
    assert Path(store.get("good").path, WEIGHTS_FILE).is_file()
    if reason not in ("InvalidRequest", "Unsupported"):
        assert store.metrics.failures.labels(reason)._value.get() == 1


async def test_truncated_source_with_matching_digest_is_refused(tmp_path, session):
    """A source that itself holds a cut file (digest declared for the cut bytes): the
    safetensors header check catches it."""
    make_adapter(tmp_path / "volume" / "cut")
    w = tmp_path / "volume" / "cut" / WEIGHTS_FILE
    w.write_bytes(w.read_bytes()[:-100])
    sha = hashlib.sha256(w.read_bytes()).hexdigest()
    store = open_store(tmp_path / "cache", session)
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef("cut", str(tmp_path / "volume" / "cut"), sha))
    assert err.value.reason == "InvalidAdapter"
    assert "cut short" in str(err.value)
    assert_clean(tmp_path / "cache", ["cut"])


def _size(tmp_path: Path) -> int:
    make_adapter(tmp_path / "probe")
    return sum((tmp_path / "probe" / f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE))


async def _stage_local(store: AdapterStore, tmp_path: Path, name: str, seed: int):
    sha = make_adapter(tmp_path / "volume" / name, seed=seed)
    return await store.stage(AdapterRef(name, str(tmp_path / "volume" / name), sha))


async def test_budget_evicts_lru_with_pinned_last(tmp_path, session, clock):
    size = _size(tmp_path)
    store = open_store(tmp_path / "cache", session, clock, budget=3 * size)
    for i, name in enumerate(["a", "b", "c"]):
        clock.advance()
        await _stage_local(store, tmp_path, name, i)
    clock.advance()
    store.touch("a")  # order by last use: b, c, a
    store.set_pinned({"b"})
    clock.advance()
    await _stage_local(store, tmp_path, "d", 10)  # evicts c: least recently used, unpinned
    assert sorted(a.name for a in store.list()) == ["a", "b", "d"]
    clock.advance()
    await _stage_local(store, tmp_path, "e", 11)  # evicts a (unpinned, older than d)
    clock.advance()
    await _stage_local(store, tmp_path, "f", 12)  # evicts d; b stays although it is oldest
    assert sorted(a.name for a in store.list()) == ["b", "e", "f"]
    assert store.metrics.evictions._value.get() == 3
    for gone in "acd":
        assert not os.path.lexists(tmp_path / "cache" / gone)
    assert_clean(tmp_path / "cache", [])


async def test_unpinned_never_evicts_pinned(tmp_path, session, clock):
    size = _size(tmp_path)
    store = open_store(tmp_path / "cache", session, clock, budget=2 * size)
    await _stage_local(store, tmp_path, "p1", 1)
    clock.advance()
    await _stage_local(store, tmp_path, "p2", 2)
    store.set_pinned({"p1", "p2", "p3"})
    with pytest.raises(StoreError) as err:
        await _stage_local(store, tmp_path, "x", 3)
    assert err.value.reason == "BudgetExceeded" and err.value.status == 507
    assert sorted(a.name for a in store.list()) == ["p1", "p2"]  # nothing evicted for it
    assert_clean(tmp_path / "cache", ["x"])
    # Another pinned adapter may evict the least recently used pinned one.
    clock.advance()
    await _stage_local(store, tmp_path, "p3", 4)
    assert sorted(a.name for a in store.list()) == ["p2", "p3"]


async def test_adapter_larger_than_budget(tmp_path, session):
    size = _size(tmp_path)
    store = open_store(tmp_path / "cache", session, budget=int(1.5 * size))
    await _stage_local(store, tmp_path, "small", 1)
    sha = make_adapter(tmp_path / "volume" / "big", rank=16)
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef("big", str(tmp_path / "volume" / "big"), sha))
    assert err.value.reason == "BudgetExceeded"
    assert [a.name for a in store.list()] == ["small"]  # the overflow evicted nothing
    assert_clean(tmp_path / "cache", ["big"])


async def test_concurrency_cap_holds_under_a_storm(tmp_path, object_store, session):
    refs = [AdapterRef(f"ad-{i}", object_store.add(f"ad-{i}", tmp_path, seed=i), "")
            for i in range(12)]
    refs = [AdapterRef(r.name, r.source, object_store.adapters[r.name].sha256) for r in refs]
    object_store.gate = asyncio.Event()
    store = open_store(tmp_path / "cache", session, downloads=3)
    storm = asyncio.gather(*(store.stage(r) for r in refs))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if object_store.active == 3:
            break
    await asyncio.sleep(0.05)  # give any fourth download the chance to show up
    assert object_store.active == 3
    assert store.metrics.downloads_in_flight._value.get() == 3
    assert store.metrics.downloads_waiting._value.get() == 9
    object_store.gate.set()
    staged = await storm
    assert len(staged) == 12 and object_store.max_active == 3
    assert store.metrics.downloads_in_flight._value.get() == 0


async def test_concurrent_requests_share_one_download(tmp_path, object_store, session):
    src = object_store.add("hot", tmp_path)
    ref = AdapterRef("hot", src, object_store.adapters["hot"].sha256)
    object_store.gate = asyncio.Event()
    store = open_store(tmp_path / "cache", session)
    waiters = [asyncio.ensure_future(store.stage(ref)) for _ in range(10)]
    await asyncio.sleep(0.05)
    waiters[0].cancel()  # one client gives up: the shared download goes on
    object_store.gate.set()
    results = await asyncio.gather(*waiters[1:])
    assert object_store.gets["hot/" + WEIGHTS_FILE] == 1
    assert store.downloads_started == 1
    assert {r.path for r in results} == {str(tmp_path / "cache" / "hot")}


async def test_new_version_replaces_old_and_failed_one_keeps_it(tmp_path, session, object_store):
    store = open_store(tmp_path / "cache", session)
    v1 = await _stage_local(store, tmp_path, "a", 1)
    sha2 = make_adapter(tmp_path / "v2" / "a", seed=2)
    v2 = await store.stage(AdapterRef("a", str(tmp_path / "v2" / "a"), sha2))
    assert v2.sha256 == sha2 != v1.sha256 and v2.path == v1.path
    assert Path(v2.path, WEIGHTS_FILE).read_bytes() == (tmp_path / "v2" / "a" / WEIGHTS_FILE).read_bytes()
    assert_clean(tmp_path / "cache", [])  # the old version's directory is gone
    # A third version whose download is cut: the name still serves version 2.
    src3 = object_store.add("a", tmp_path, seed=3, mode="cut")
    with pytest.raises(StoreError):
        await store.stage(AdapterRef("a", src3, object_store.adapters["a"].sha256))
    assert store.get("a").sha256 == sha2
    assert Path(v2.path, WEIGHTS_FILE).read_bytes() == (tmp_path / "v2" / "a" / WEIGHTS_FILE).read_bytes()
    assert_clean(tmp_path / "cache", [])


async def test_restart_reads_back_and_clears_crash_leftovers(tmp_path, session, clock):
    root = tmp_path / "cache"
    store = open_store(root, session, clock)
    await _stage_local(store, tmp_path, "keep", 1)
    await _stage_local(store, tmp_path, "lost", 2)
    # What a crash can leave: a half download, an orphan version, a link whose version
    # directory went away, and a symlink swap cut short.
    (root / ".tmp" / "keep.x1").mkdir()
    (root / ".tmp" / "keep.x1" / WEIGHTS_FILE).write_bytes(b"half")
    (root / ".store" / "orphan-1234").mkdir()
    lost_blob = Path(os.readlink(root / "lost")).name
    shutil.rmtree(root / ".store" / lost_blob)
    os.symlink(".store/nowhere", root / ".keep.abcd.link")
    again = open_store(root, session, clock)
    assert [a.name for a in again.list()] == ["keep"]
    assert again.get("keep").sha256 == store.get("keep").sha256
    assert again.used_bytes == store.get("keep").bytes
    assert_clean(root, ["lost"])
    assert not os.path.lexists(root / ".keep.abcd.link")


async def test_pinned_adapter_evicts_unpinned_before_older_pinned(tmp_path, session, clock):
    size = _size(tmp_path)
    store = open_store(tmp_path / "cache", session, clock, budget=3 * size)
    store.set_pinned({"p1", "p2", "p3", "p4"})
    for i, name in enumerate(["p1", "u1", "u2"]):  # p1 is the least recently used
        clock.advance()
        await _stage_local(store, tmp_path, name, i)
    for i, (name, left) in enumerate([("p2", ["p1", "p2", "u2"]), ("p3", ["p1", "p2", "p3"]),
                                      ("p4", ["p2", "p3", "p4"])]):
        clock.advance()
        await _stage_local(store, tmp_path, name, 10 + i)
        assert sorted(a.name for a in store.list()) == left, name


async def test_stage_with_a_serving_dtype_writes_its_copy_once(tmp_path, session, clock):
    """An F32 adapter staged for bf16 servers gets its weights in bf16 beside the original,
    counted in the budget and read back at start; one staged before without it gets it at
    the next request that names the dtype; a float32 request writes none."""
    from loraplex.server.adapter_format import serving_weights_name

    root = tmp_path / "cache"
    store = open_store(root, session, clock)
    sha = make_adapter(tmp_path / "volume" / "chat", seed=5)  # F32 tensors
    src = str(tmp_path / "volume" / "chat")
    original = (tmp_path / "volume" / "chat" / WEIGHTS_FILE).read_bytes()
    staged = await store.stage(AdapterRef("chat", src, sha, "bfloat16"))
    copy = root / "chat" / serving_weights_name("bfloat16")
    assert copy.is_file() and (root / "chat" / WEIGHTS_FILE).read_bytes() == original
    assert staged.bytes == _size(tmp_path) + copy.stat().st_size == store.used_bytes
    assert open_store(root, session, clock).used_bytes == staged.bytes  # read back at start
    assert_clean(root, [])

    sha2 = make_adapter(tmp_path / "volume" / "sql", seed=6)
    src2 = str(tmp_path / "volume" / "sql")
    before = await store.stage(AdapterRef("sql", src2, sha2))  # no dtype: no copy
    assert not (root / "sql" / serving_weights_name("bfloat16")).exists()
    await store.stage(AdapterRef("sql", src2, sha2, "float32"))
    assert sorted(p.name for p in (root / "sql").iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE, ".loraplex.json"])
    after = await store.stage(AdapterRef("sql", src2, sha2, "float16"))
    assert (root / "sql" / serving_weights_name("float16")).is_file()
    assert after.bytes == before.bytes + (root / "sql" / serving_weights_name("float16")).stat().st_size
    assert store.used_bytes == staged.bytes + after.bytes

    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef("chat", src, sha, "int8"))
    assert err.value.reason == "InvalidRequest"


async def test_a_serving_copy_takes_only_free_budget(tmp_path, session, clock):
    """The copy is an optimisation: with no free bytes for it the adapter is staged without
    it, and no other adapter is evicted to make room."""
    from loraplex.server.adapter_format import serving_weights_name

    root = tmp_path / "cache"
    size = _size(tmp_path)
    store = open_store(root, session, clock, budget=2 * size + 8)
    await _stage_local(store, tmp_path, "first", 1)
    sha = make_adapter(tmp_path / "volume" / "second", seed=2)
    staged = await store.stage(AdapterRef("second", str(tmp_path / "volume" / "second"), sha, "bfloat16"))
    assert not (root / "second" / serving_weights_name("bfloat16")).exists()
    assert staged.bytes == size and [a.name for a in store.list()] == ["first", "second"]
    assert store.used_bytes == 2 * size
    assert_clean(root, [])


async def test_versions_of_one_name_staged_at_once_leave_the_link_and_the_entry_agreeing(tmp_path, session):
    """A plan that changes a version while the old one still downloads: several versions of one
    name finish together. Whichever wins, the name's link must point at the entry's version,
    whole; the losers' directories go. (The link used to be swapped in a worker thread and the
    entry after it: in 19 of 60 rounds the entry's cleanup deleted the directory the link
    pointed at.)"""
    versions = []
    for v in range(4):
        sha = make_adapter(tmp_path / "src" / f"v{v}" / "a", seed=v, rank=16, hidden=256)
        versions.append(AdapterRef("a", str(tmp_path / "src" / f"v{v}" / "a"), sha))
    store = open_store(tmp_path / "cache", session, downloads=8)
    for round_ in range(30):
        picks = [versions[(round_ + k) % 4] for k in range(3)]
        results = await asyncio.gather(*[store.stage(ref) for ref in picks], return_exceptions=True)
        # One that ends after a version asked for later is dropped (the later request wins).
        assert all(not isinstance(r, BaseException) or getattr(r, "reason", None) == "Superseded"
                   for r in results), results
        entry = store.get("a")
        weights = Path(entry.path, WEIGHTS_FILE).read_bytes()  # through the link
        assert hashlib.sha256(weights).hexdigest() == entry.sha256, round_
        assert_clean(tmp_path / "cache", [])
        assert len(list((tmp_path / "cache" / ".store").iterdir())) == 1


async def test_an_adapter_removed_while_it_downloads_leaves_nothing(tmp_path, object_store, session):
    """The plan drops an adapter whose download is in flight: the download is void when it
    ends (StoreError "Removed"), nothing of it stays on disk, and a stage asked after the
    removal (it came back into the plan) downloads afresh and stays."""
    src = object_store.add("gone", tmp_path)
    ref = AdapterRef("gone", src, object_store.adapters["gone"].sha256)
    object_store.gate = asyncio.Event()
    store = open_store(tmp_path / "cache", session)
    first = asyncio.ensure_future(store.stage(ref))
    while object_store.active == 0:
        await asyncio.sleep(0.005)
    assert await store.remove("gone") is False  # nothing staged yet
    again = asyncio.ensure_future(store.stage(ref))  # back in the plan: not the void download
    object_store.gate.set()
    with pytest.raises(StoreError) as err:
        await first
    assert err.value.reason == "Removed" and err.value.status == 409
    staged = await again
    assert store.downloads_started == 2 and store.get("gone").sha256 == ref.sha256
    assert Path(staged.path, WEIGHTS_FILE).read_bytes() == object_store.adapters["gone"].files[WEIGHTS_FILE]
    assert_clean(tmp_path / "cache", [])
    assert await store.remove("gone") is True
    assert_clean(tmp_path / "cache", ["gone"])
    assert store.used_bytes == 0


async def test_restart_drops_a_serving_copy_cut_short_in_a_staged_version(tmp_path, session, clock):
    """A crash while a serving copy is written beside a staged version (its temporary
    name, half written) must not leave that file there, counted in the budget for good."""
    root = tmp_path / "cache"
    store = open_store(root, session, clock)
    staged = await _stage_local(store, tmp_path, "a", 1)
    blob = root / ".store" / Path(os.readlink(root / "a")).name
    (blob / ".adapter_model.bfloat16.safetensors.1a2b3c4d").write_bytes(b"\0" * 4096)
    last_use = blob.stat().st_mtime
    again = open_store(root, session, clock)
    assert again.get("a").bytes == staged.bytes and again.used_bytes == staged.bytes
    assert again.get("a").last_used == last_use  # the clean-up is not a use
    assert sorted(p.name for p in blob.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE, ".loraplex.json"])


async def test_an_adapter_without_a_digest_is_staged_as_found(tmp_path, session, object_store):
    """The LoRAAdapter CRD makes sha256 optional: without one the source is staged as the agent
    finds it, its digest computed on the way (and shown), staged once per source; a new source
    is a new version; a cut download still leaves nothing that looks whole. (The agent used to
    refuse such an adapter, so a CR the operator accepted could never be served.)"""
    store = open_store(tmp_path / "cache", session)
    src = object_store.add("plain", tmp_path, seed=4)
    staged = await store.stage(AdapterRef("plain", src, None))
    assert staged.sha256 == object_store.adapters["plain"].sha256  # what it got, verified by hashing
    assert Path(staged.path, WEIGHTS_FILE).read_bytes() == object_store.adapters["plain"].files[WEIGHTS_FILE]
    again = await store.stage(AdapterRef("plain", src, None))
    assert again.sha256 == staged.sha256 and object_store.gets["plain/" + WEIGHTS_FILE] == 1
    sha2 = make_adapter(tmp_path / "v2" / "plain", seed=5)
    v2 = await store.stage(AdapterRef("plain", str(tmp_path / "v2" / "plain"), None))  # another source
    assert v2.sha256 == sha2 and v2.path == staged.path
    cut = object_store.add("cut", tmp_path, seed=6, mode="cut")
    with pytest.raises(StoreError):
        await store.stage(AdapterRef("cut", cut, None))
    assert_clean(tmp_path / "cache", ["cut"])
    # Read back after a restart, with the digest it computed.
    reopened = open_store(tmp_path / "cache", session)
    assert reopened.get("plain").sha256 == sha2
    assert (await reopened.stage(AdapterRef("plain", str(tmp_path / "v2" / "plain"), None))).sha256 == sha2


@pytest.mark.parametrize("meta", [{"name": "odd"}, {"name": "odd", "sha256": None, "source": "/x"}, ["odd"]])
async def test_restart_drops_a_version_whose_metadata_does_not_describe_it(tmp_path, session, clock, meta):
    """A version directory whose metadata file parses but lacks its digest or source (edited by
    hand, say) is dropped at start with the others' leftovers; it used to stop the agent's
    start with a KeyError, taking every staged adapter of the node with it."""
    root = tmp_path / "cache"
    store = open_store(root, session, clock)
    await _stage_local(store, tmp_path, "keep", 1)
    await _stage_local(store, tmp_path, "odd", 2)
    blob = Path(os.readlink(root / "odd")).name
    (root / ".store" / blob / ".loraplex.json").write_text(json.dumps(meta))
    again = open_store(root, session, clock)
    assert [a.name for a in again.list()] == ["keep"]
    assert_clean(root, ["odd"])


async def test_a_request_naming_a_dtype_that_joins_a_download_gets_its_copy(tmp_path, object_store, session):
    """Two requests for one version share its download; the second names a serving dtype and
    the first none (the plan's stage and a bf16 server's, say). The second used to be answered
    with the version as the first asked for it, with no bf16 copy, so its server converted
    the F32 weights at every read until some later request named the dtype again."""
    from loraplex.server.adapter_format import serving_weights_name

    src = object_store.add("shared", tmp_path)
    sha = object_store.adapters["shared"].sha256
    object_store.gate = asyncio.Event()
    store = open_store(tmp_path / "cache", session)
    plain = asyncio.ensure_future(store.stage(AdapterRef("shared", src, sha)))
    while object_store.active == 0:
        await asyncio.sleep(0.005)
    bf16 = asyncio.ensure_future(store.stage(AdapterRef("shared", src, sha, "bfloat16")))
    await asyncio.sleep(0.02)
    object_store.gate.set()
    first, second = await asyncio.gather(plain, bf16)
    assert store.downloads_started == 1
    copy = tmp_path / "cache" / "shared" / serving_weights_name("bfloat16")
    assert copy.is_file()
    assert second.bytes == first.bytes + copy.stat().st_size == store.used_bytes


async def test_a_version_asked_for_earlier_never_replaces_one_asked_for_later(tmp_path, object_store, session):
    """Version 1 of an adapter downloads slowly; version 2 is asked for meanwhile and staged
    first. Version 1 used to replace it when its download ended, so the node went back to
    the old version although the newer one was the last asked for (the caller of version 2
    had been told it was there). The later request wins: version 1 is dropped, its caller
    told so (409 Superseded), and version 2 stays."""
    src1 = object_store.add("a", tmp_path, seed=1)
    ref1 = AdapterRef("a", src1, object_store.adapters["a"].sha256)
    sha2 = make_adapter(tmp_path / "v2" / "a", seed=2)
    ref2 = AdapterRef("a", str(tmp_path / "v2" / "a"), sha2)
    object_store.gate = asyncio.Event()
    store = open_store(tmp_path / "cache", session)
    first = asyncio.ensure_future(store.stage(ref1))
    while object_store.active == 0:
        await asyncio.sleep(0.005)
    staged2 = await store.stage(ref2)
    object_store.gate.set()
    with pytest.raises(StoreError) as err:
        await first
    assert err.value.reason == "Superseded" and err.value.status == 409
    assert store.get("a").sha256 == sha2 == staged2.sha256
    assert hashlib.sha256(Path(staged2.path, WEIGHTS_FILE).read_bytes()).hexdigest() == sha2
    assert_clean(tmp_path / "cache", [])
    # Asked for again now, version 1 is the latest request: it replaces version 2.
    again = await store.stage(ref1)
    assert store.get("a").sha256 == again.sha256 == ref1.sha256
    assert_clean(tmp_path / "cache", [])


async def test_requests_at_once_for_a_missing_serving_copy_all_wait_for_it(tmp_path, session, monkeypatch):
    """Several bf16 servers ask at once for a version staged without its bf16 copy. One writes
    it; the others used to be answered at once, before it existed, so their servers read and
    converted the F32 file. All are answered once the copy is there, and it is written once,
    whoever of them goes away meanwhile."""
    import threading

    import loraplex.node_agent.store as store_module
    from loraplex.server.adapter_format import serving_weights_name

    store = open_store(tmp_path / "cache", session)
    staged = await _stage_local(store, tmp_path, "a", 1)  # no dtype: no copy
    ref = AdapterRef("a", str(tmp_path / "volume" / "a"), staged.sha256, "bfloat16")
    calls, go = [], threading.Event()
    real = store_module.write_serving_copy

    def slow(directory, dtype):  # the real conversion, held until the others have asked
        calls.append(dtype)
        go.wait(10)
        return real(directory, dtype)

    monkeypatch.setattr(store_module, "write_serving_copy", slow)
    asks = [asyncio.ensure_future(store.stage(ref)) for _ in range(4)]
    await asyncio.sleep(0.1)
    assert not any(a.done() for a in asks)  # nobody answered before the copy is there
    asks[0].cancel()  # the client whose request started the copy goes away: the copy goes on
    go.set()
    answers = await asyncio.gather(*asks[1:])
    copy = Path(staged.path, serving_weights_name("bfloat16"))
    assert calls == ["bfloat16"] and copy.is_file()
    assert {a.bytes for a in answers} == {staged.bytes + copy.stat().st_size} == {store.used_bytes}
    assert store._reserved == 0  # the copy's reservation became its staged bytes


async def test_an_adapter_with_the_longest_name_a_kubernetes_object_may_have_is_staged(tmp_path, session):
    """A LoRAAdapter's name may be 253 characters. The store named its download folder and the
    name's symlink-to-be after the adapter, with a suffix: past the filesystem's 255 bytes for
    a name, so such an adapter failed with a 500 (ENAMETOOLONG) every time."""
    name = "a" * 240 + "-" + "b" * 12
    assert len(name) == 253
    store = open_store(tmp_path / "cache", session)
    staged = await _stage_local(store, tmp_path, name, 1)
    assert Path(staged.path, WEIGHTS_FILE).is_file() and store.get(name) is not None
    assert_clean(tmp_path / "cache", [])
    assert [a.name for a in open_store(tmp_path / "cache", session).list()] == [name]


async def test_a_disk_error_after_the_version_moved_into_the_store_leaves_no_orphan(tmp_path, session, monkeypatch):
    """The version directory is renamed into .store, then the directory's fsync fails (EIO):
    the directory stayed there, in neither the entries nor the budget, until the next start."""
    import errno

    from loraplex.node_agent import store as store_module

    sha = make_adapter(tmp_path / "src" / "a")
    root = tmp_path / "cache"
    store = open_store(root, session)
    real = store_module.fsync_dir

    def failing(path):
        if Path(path) == root / ".store" and any((root / ".store").iterdir()):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(path)

    monkeypatch.setattr(store_module, "fsync_dir", failing)
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef("a", str(tmp_path / "src" / "a"), sha))
    assert err.value.reason == "DiskError"
    assert list((root / ".store").iterdir()) == [] and store.used_bytes == 0 and store._reserved == 0
    assert_clean(root, ["a"])
    monkeypatch.undo()
    assert (await store.stage(AdapterRef("a", str(tmp_path / "src" / "a"), sha))).sha256 == sha


@pytest.mark.parametrize("how", ["evicted", "removed", "replaced"])
async def test_a_version_that_goes_while_its_serving_copy_is_written_leaves_no_folder(tmp_path, session, monkeypatch,
                                                                                      how):
    """A version staged without its bf16 copy gets one when a bf16 server asks; while the copy
    is written (in a thread) the version goes: evicted for another adapter's room, removed
    from the plan, or replaced by a new version. Deleting its folder lists the files, then
    deletes them and the folder: the copy renamed into place between the two was not listed,
    the folder was not empty, and it stayed in .store (in no entry, over the budget) until the
    next start. Here that interleaving is made certain: the deletion's listing is taken, then
    the gated copy writer runs to its end, then the deletion goes on."""
    import threading

    import loraplex.node_agent.store as store_module
    from loraplex.node_agent.convert import serving_copy_size

    root = tmp_path / "cache"
    sha_a = make_adapter(tmp_path / "volume" / "a", seed=1)
    size = _size(tmp_path)
    copy_size = serving_copy_size(tmp_path / "volume" / "a", "bfloat16")
    # Room for a, its copy and one more adapter but a byte: staging b must evict a.
    budget = 2 * size + copy_size - 1 if how == "evicted" else 10**9
    store = open_store(root, session, budget=budget)
    await store.stage(AdapterRef("a", str(tmp_path / "volume" / "a"), sha_a))  # no dtype: no copy
    blob = root / ".store" / Path(os.readlink(root / "a")).name

    started, go, done = threading.Event(), threading.Event(), threading.Event()
    real_write, real_rmtree = store_module.write_serving_copy, shutil.rmtree

    def gated_write(directory, dtype):  # the real copy, held until the deletion has listed the folder
        started.set()
        go.wait(10)
        try:
            return real_write(directory, dtype)
        finally:
            done.set()

    def racing_rmtree(path, ignore_errors=False, *args, **kwargs):  # rmtree's list-then-delete, with the
        if Path(path) != blob or go.is_set():                        # copy written in between
            return real_rmtree(path, ignore_errors, *args, **kwargs)
        listed = list(Path(path).iterdir())
        go.set()
        done.wait(10)
        for f in listed:
            f.unlink(missing_ok=True)
        try:
            os.rmdir(path)
        except OSError:
            if not ignore_errors:
                raise

    monkeypatch.setattr(store_module, "write_serving_copy", gated_write)
    monkeypatch.setattr(shutil, "rmtree", racing_rmtree)
    asked = asyncio.ensure_future(store.stage(AdapterRef("a", str(tmp_path / "volume" / "a"), sha_a, "bfloat16")))
    assert await asyncio.to_thread(started.wait, 10)
    if how == "evicted":
        await _stage_local(store, tmp_path, "b", 2)
        assert store.get("a") is None
    elif how == "removed":
        assert await store.remove("a")
    else:
        sha_new = make_adapter(tmp_path / "volume" / "a-new", seed=3)
        await store.stage(AdapterRef("a", str(tmp_path / "volume" / "a-new"), sha_new))
    go.set()  # (a deletion that waits for the writer never listed the folder under it)
    if how == "evicted":
        await asked
    else:  # answered as a download of the gone version would be (test_bug_hunt.py)
        with pytest.raises(StoreError) as err:
            await asked
        assert err.value.reason == {"removed": "Removed", "replaced": "Superseded"}[how]
    assert done.is_set()
    assert not blob.exists()
    linked = {Path(os.readlink(p)).name for p in root.iterdir() if p.is_symlink()}
    assert {p.name for p in (root / ".store").iterdir()} == linked  # no orphan versions
    assert store._reserved == 0
    assert store.used_bytes == sum(a.bytes for a in store.list()) == disk_bytes_in(root / ".store")


def disk_bytes_in(store_dir: Path) -> int:
    return sum(f.stat().st_size for f in store_dir.rglob("*") if f.is_file() and f.name != ".loraplex.json")
