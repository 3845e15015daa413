"""Races and cleanup paths of the node agent found by a focused hunt: each test shows what
went wrong before its fix (real files, real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError

from .helpers import make_adapter


def _adapter(tmp_path: Path, name: str, seed: int) -> tuple[str, str]:
    """A PEFT adapter on the 'volume' (a plain path source): (source, sha256)."""
    d = tmp_path / "volume" / name
    return str(d), make_adapter(d, seed=seed)


def _hold_first_serving_copy(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The store's first serving-copy write waits for `go`; `started` is set once it began
    (later writes run as they are)."""
    import loraplex.node_agent.store as store_module

    started, go = threading.Event(), threading.Event()
    real = store_module.write_serving_copy

    def gated(directory, dtype):
        if not started.is_set():
            started.set()
            go.wait(10)
        return real(directory, dtype)

    monkeypatch.setattr(store_module, "write_serving_copy", gated)
    return started, go


def _size(source: str) -> int:
    return sum((Path(source) / f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE))


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob(".store/*/*") if f.is_file() and f.name != ".loraplex.json")


# -- an answer for a version that went while its serving copy was written -------------------


@pytest.mark.parametrize("how", ["removed", "replaced"])
async def test_a_version_that_goes_while_its_serving_copy_is_written_is_not_answered_as_staged(
        tmp_path, session, monkeypatch, how):
    """A bf16 server asks for a version staged without its bf16 copy; while the copy is
    written the version goes (the plan drops the name, or a new version replaces it). The
    request was answered 200 with the gone version (its sha256, at a path that now holds
    nothing or another version's weights), so the server loaded what the answer did not
    describe. It must fail as a download of it would: Removed, or Superseded (both 409)."""
    root = tmp_path / "cache"
    src, sha = _adapter(tmp_path, "a", 1)
    store = AdapterStore(root, 10**9, session=session)
    await store.stage(AdapterRef("a", src, sha))  # no dtype: no copy
    started, go = _hold_first_serving_copy(monkeypatch)
    asked = asyncio.ensure_future(store.stage(AdapterRef("a", src, sha, "bfloat16")))
    assert await asyncio.to_thread(started.wait, 10)
    if how == "removed":
        assert await store.remove("a")
    else:
        new_src, new_sha = _adapter(tmp_path, "a-new", 2)
        await store.stage(AdapterRef("a", new_src, new_sha))
    reason = "Removed" if how == "removed" else "Superseded"
    failures = store.metrics.failures.labels(reason)
    before = failures._value.get()
    go.set()
    with pytest.raises(StoreError) as err:
        await asked
    assert err.value.reason == reason and err.value.status == 409
    assert failures._value.get() == before + 1  # in the failure series, as a download that ends so is
    assert store._reserved == 0
    if how == "replaced":
        assert store.get("a").sha256 == new_sha  # the later version stays


async def test_a_version_evicted_while_its_serving_copy_is_written_is_staged_again(tmp_path, session, monkeypatch):
    """The same, the version evicted for another adapter's room: the request is answered with
    the version on disk again (staged afresh), never with a path that holds nothing."""
    from loraplex.node_agent.convert import serving_copy_size

    root = tmp_path / "cache"
    src, sha = _adapter(tmp_path, "a", 1)
    size = _size(src)
    copy = serving_copy_size(src, "bfloat16")
    # Room for a, its copy and one more adapter but a byte: staging b evicts a.
    store = AdapterStore(root, 2 * size + copy - 1, session=session)
    await store.stage(AdapterRef("a", src, sha))
    started, go = _hold_first_serving_copy(monkeypatch)
    asked = asyncio.ensure_future(store.stage(AdapterRef("a", src, sha, "bfloat16")))
    assert await asyncio.to_thread(started.wait, 10)
    b_src, b_sha = _adapter(tmp_path, "b", 2)
    await store.stage(AdapterRef("b", b_src, b_sha))
    assert store.get("a") is None  # evicted for b
    go.set()
    staged = await asked
    assert store.get("a") is not None and staged.sha256 == sha
    assert Path(staged.path, WEIGHTS_FILE).is_file() and Path(staged.path, CONFIG_FILE).is_file()
    assert store._reserved == 0
    assert store.used_bytes == sum(a.bytes for a in store.list()) == _disk_bytes(root)


# -- a download voided by a removal evicted adapters for its room ---------------------------


@pytest.mark.parametrize("mode", ["ok", "chunked"])  # its size known up front, or reserved as it comes
async def test_a_download_removed_in_flight_evicts_nothing_for_its_room(tmp_path, session, object_store, mode):
    """The cache is full; a download of c waits on its source; the plan drops c (its download
    is void from then on). The source then answers: the void download still reserved room for
    c's bytes, evicting a staged adapter a server may be using, and wrote them all before it
    ended as Removed. It must stop at once, evicting nothing."""
    root = tmp_path / "cache"
    a_src, a_sha = _adapter(tmp_path, "a", 1)
    b_src, b_sha = _adapter(tmp_path, "b", 2)
    store = AdapterStore(root, 2 * _size(a_src) + 100, session=session)
    await store.stage(AdapterRef("a", a_src, a_sha))
    await store.stage(AdapterRef("b", b_src, b_sha))
    c = object_store.add("c", tmp_path, seed=3, mode=mode)
    object_store.gate = asyncio.Event()
    downloading = asyncio.ensure_future(store.stage(AdapterRef("c", c, object_store.adapters["c"].sha256)))
    while object_store.active == 0:
        await asyncio.sleep(0.005)
    assert await store.remove("c") is False  # not staged yet: its download is void
    evicted = []
    store.on_evict = evicted.append
    object_store.gate.set()
    with pytest.raises(StoreError) as err:
        await downloading
    assert err.value.reason == "Removed"
    assert evicted == [] and sorted(a.name for a in store.list()) == ["a", "b"]
    assert store._reserved == 0 and list((root / ".tmp").iterdir()) == []


async def test_a_download_removed_while_it_waits_for_a_slot_fetches_nothing(tmp_path, session, object_store):
    """One download slot, held by x; c waits for it, and the plan drops c: c is void, and it
    must end as Removed without a byte fetched, not download whole once x is done."""
    x = object_store.add("x", tmp_path, seed=1)
    c = object_store.add("c", tmp_path, seed=2)
    object_store.gate = asyncio.Event()
    store = AdapterStore(tmp_path / "cache", 10**9, 1, session=session)
    first = asyncio.ensure_future(store.stage(AdapterRef("x", x, object_store.adapters["x"].sha256)))
    while object_store.active == 0:
        await asyncio.sleep(0.005)
    queued = asyncio.ensure_future(store.stage(AdapterRef("c", c, object_store.adapters["c"].sha256)))
    await asyncio.sleep(0.05)
    assert not queued.done()
    await store.remove("c")
    object_store.gate.set()
    await first
    with pytest.raises(StoreError) as err:
        await queued
    assert err.value.reason == "Removed"
    assert object_store.gets["c/adapter_config.json"] == 0 and object_store.gets["c/adapter_model.safetensors"] == 0
    assert store.downloads_started == 2 and store._reserved == 0


# -- a status.nodes entry left behind by an adapter that left the plan unstaged ---------------


async def test_an_adapter_that_leaves_the_plan_after_its_staging_failed_leaves_no_failed_report(
        tmp_path, session, object_store, kube_api):
    """The plan's "bad" fails to stage here (its source cuts the body: Failed on the node's
    status entry); the plan then drops it. Only an adapter on disk had its node entry deleted,
    so its LoRAAdapter said Failed on this node for good, about a staging nobody will retry."""
    from loraplex.node_agent.kube import KubeAPI, StatusReporter
    from loraplex.node_agent.warmer import Warmer

    from .helpers import ConfigMapDir, plan_json

    object_store.add("keep", tmp_path)
    object_store.add("bad", tmp_path, seed=1, mode="cut")
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=["keep", "bad"]))
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    reporter = StatusReporter(KubeAPI(kube_api.url, session), "ml", "node-7")
    warmer = Warmer(store, cm.path, session, reporter=reporter)
    await warmer.check_plan()
    await warmer.reconcile()
    await reporter.flush()
    bad = [body["status"]["nodes"]["node-7"] for _, name, body, _ in kube_api.patches if name == "bad"]
    assert bad[-1]["phase"] == "Failed"
    previous = warmer.plan
    cm.write(plan_json(object_store, pinned=["keep"]))  # "bad" left the plan
    assert await warmer.check_plan()
    await warmer.reconcile(previous)
    await reporter.flush()
    bad = [body["status"]["nodes"]["node-7"] for _, name, body, _ in kube_api.patches if name == "bad"]
    assert bad[-1] is None  # the node's key deleted: nothing of it is, or will be, on this node
    assert "bad" not in warmer.errors
    # An adapter this run never reported (nor staged) is not patched for nothing.
    cm.write(plan_json(object_store, pinned=["keep"], others=["bad"]))
    previous = warmer.plan
    assert await warmer.check_plan()
    await warmer.reconcile(previous)
    n = len(kube_api.patches)
    previous = warmer.plan
    cm.write(plan_json(object_store, pinned=["keep"]))
    assert await warmer.check_plan()
    await warmer.reconcile(previous)
    await reporter.flush()
    assert len(kube_api.patches) == n


async def test_a_plan_let_go_while_it_stages_leaves_no_staging_report(tmp_path, session, object_store, kube_api):
    """A found plan goes (its BaseModel deleted) while its loop stages "a": the loop is
    cancelled, then the plan retired. "a" was not on disk yet, so its node entry stayed
    Staging for good; it must be deleted, as the void download leaves nothing here."""
    from .helpers import plan_json, reporting_warmer

    object_store.add("a", tmp_path)
    _, store, reporter, warmer = reporting_warmer(tmp_path, session, kube_api, plan_json(object_store, pinned=["a"]))
    await warmer.check_plan()
    object_store.gate = asyncio.Event()
    loop = asyncio.ensure_future(warmer.reconcile())
    while object_store.active == 0:
        await asyncio.sleep(0.005)
    await reporter.flush()  # Staging is on the CR
    loop.cancel()  # Agent._let_go: the plan's loops stopped, then the plan retired
    await asyncio.gather(loop, return_exceptions=True)
    await warmer.retire()
    object_store.gate.set()
    await reporter.flush()
    states = [body["status"]["nodes"]["node-7"] for _, name, body, _ in kube_api.patches if name == "a"]
    assert states[0] == {"phase": "Staging", "message": ""} and states[-1] is None
    await asyncio.sleep(0.1)  # the void download ends, leaving nothing
    assert store.get("a") is None and store._reserved == 0


# -- a body nested too deep for the JSON decoder ---------------------------------------------


@pytest.mark.parametrize("path", ["/v1/stage", "/v1/sessions"])
async def test_a_body_nested_too_deep_is_a_400_in_the_api_shape(tmp_path, client_factory, path):
    """A JSON body of 100,000 nested arrays (200 KB, well under the body limit) made the
    decoder raise RecursionError, which is no ValueError: aiohttp answered a plain-text 500
    and logged a traceback, for a body that is simply not one the API takes."""
    from loraplex.node_agent.app import AgentConfig

    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9))
    r = await client.post(path, data=b"[" * 100_000 + b"]" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status == 400 and r.content_type == "application/json", await r.text()
    assert (await r.json())["error"]["reason"] == "InvalidRequest"
    assert (await client.get("/healthz")).status == 200


# -- a plan adapter whose source is not a string ---------------------------------------------


@pytest.mark.parametrize("source", [7, None, ["/mnt/adapters/x"]])
async def test_a_plan_adapter_whose_source_is_not_a_string_makes_the_plan_bad(tmp_path, session, source):
    """parse_plan took any value for an adapter's source. Without a digest, the plan guard of
    /v1/stage then compared it as a string (AttributeError: a plain-text 500 to every server
    asking for the name), as did the plan loop's version checks of a staged adapter of that
    name (the loop crashed, /healthz went 500). It is a bad plan, as a name of the wrong type is."""
    from loraplex.node_agent.warmer import PlanError, Warmer, parse_plan

    from .helpers import ConfigMapDir

    doc = {"baseModel": "b", "adapters": [{"name": "x", "source": source}]}
    with pytest.raises(PlanError, match="source"):
        parse_plan(doc)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(doc)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session)
    assert await warmer.check_plan() is False and warmer.plan is None
    src, sha = _adapter(tmp_path, "x", 1)
    staged = await warmer.stage_on_request(AdapterRef("x", src, None))  # a name no plan it has lists
    assert staged.sha256 == sha


# -- a disk error once the new version is linked ---------------------------------------------


async def test_a_disk_error_after_a_new_version_is_linked_leaves_no_old_version_behind(tmp_path, session, monkeypatch):
    """Version 2 of a replaces version 1: its symlink is renamed over the old one, then the
    folder's fsync fails (EIO). Version 1's directory, in no entry now, was left on disk
    outside the budget (a full adapter's bytes) until the next start."""
    import errno

    from loraplex.node_agent import store as store_module

    root = tmp_path / "cache"
    src1, sha1 = _adapter(tmp_path, "a1", 1)
    src2, sha2 = _adapter(tmp_path, "a2", 2)
    store = AdapterStore(root, 10**9, session=session)
    await store.stage(AdapterRef("a", src1, sha1))
    real = store_module.fsync_dir

    def failing(path):
        if Path(path) == root:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(path)

    monkeypatch.setattr(store_module, "fsync_dir", failing)
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef("a", src2, sha2))
    assert err.value.reason == "DiskError"
    monkeypatch.undo()
    # Whatever the answer, the disk and the books agree: one version of a, counted once.
    linked = {Path(os.readlink(p)).name for p in root.iterdir() if p.is_symlink()}
    assert {p.name for p in (root / ".store").iterdir()} == linked
    assert store.used_bytes == sum(a.bytes for a in store.list()) == _disk_bytes(root)
    assert store._reserved == 0
