"""The plan watcher: a plan that is not one is refused whole, with the reason, and the last
good plan stays in force; the watcher never dies of a plan."""

from __future__ import annotations

import json
import os
import time

import pytest

from loraplex.server.plan_watch import PlanWatcher

from .test_adapter_cache import make_cache, write_adapter


@pytest.fixture
def cache(tmp_path):
    for name in "abc":
        write_adapter(tmp_path / name, seed=ord(name))
    cache = make_cache(tmp_path, slots=3)
    yield cache
    cache.close()


def _pinned(cache) -> set:
    return {e.name for e in cache.known() if e.pinned}


GOOD = {"pinned": ["a"], "adapters": [{"name": "a", "source": None, "sha256": None, "pinned": True}], "prefetch": []}


@pytest.mark.parametrize("bad, words", [
    ({"adapters": "a"}, "adapters"),
    ({"adapters": [7]}, "adapters"),
    ({"adapters": [{"source": "file:///x"}]}, "name"),
    ({"adapters": [{"name": 5}]}, "name"),
    ({"adapters": [{"name": "b", "sha256": 5}]}, "sha256"),
    ({"adapters": [{"name": "b", "source": ["s3://x"]}]}, "source"),
    ({"pinned": "bc"}, "pinned"),
    ({"pinned": {"b": True}}, "pinned"),
    ({"pinned": [1]}, "pinned"),
    ({"prefetch": "b"}, "prefetch"),
    ({"prefetch": ["b"]}, "prefetch"),
    # Valid up to its last entry: nothing of it may be applied (b registered, c unpinned...).
    ({"pinned": ["b"], "adapters": [{"name": "b", "source": "file:///elsewhere/b"}, 7], "prefetch": []}, "adapters"),
])
def test_a_plan_of_the_wrong_shape_is_refused_whole_and_the_last_one_kept(cache, tmp_path, bad, words):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(GOOD))
    watcher = PlanWatcher(path, cache.apply_plan)
    assert watcher.check() and _pinned(cache) == {"a"}
    before = {e.name: (e.source, e.sha256) for e in cache.known()}
    path.write_text(json.dumps(bad))
    os.utime(path, ns=(1, 1))
    assert not watcher.check()  # no exception out of the watcher, nothing applied
    assert words in (watcher.last_error or ""), watcher.last_error
    assert _pinned(cache) == {"a"}
    assert {e.name: (e.source, e.sha256) for e in cache.known()} == before
    cache.describe()  # every row still describes (no name of another type among them)
    path.write_text(json.dumps({"pinned": ["c"], "adapters": [], "prefetch": []}))
    assert watcher.check() and watcher.last_error is None and _pinned(cache) == {"c"}


def test_an_adapter_that_leaves_the_plan_is_no_longer_served(tmp_path, tmp_path_factory):
    """A LoRAAdapter deleted from the cluster leaves the plan (its finalizer waits for that):
    servers must stop serving it and node agents unstage it. The server only unpinned it: it
    kept serving it from its slot and host copy, and once the agent had removed its files, the
    next load fetched it from its source again (through the agent: back on the node's disk).
    An adapter the API registered from its own folder stays (the admin's, not the plan's)."""
    import shutil

    remote = tmp_path_factory.mktemp("remote")
    write_adapter(remote / "r", seed=7)
    for name in "ab":
        write_adapter(tmp_path / name, seed=ord(name))
    cache = make_cache(tmp_path, slots=3)
    try:
        cache.load("mine", remote / "r")  # the API's, from a folder of its own
        cache.apply_plan({"pinned": ["a"], "prefetch": [], "adapters": [
            {"name": "a", "source": "s3://bucket/a", "sha256": None, "pinned": True},
            {"name": "r", "source": f"file://{remote / 'r'}", "sha256": None, "pinned": False},
            {"name": "mine", "source": "s3://bucket/mine", "sha256": None, "pinned": False}]})
        cache.prefetch("r").result(10)
        cache.prefetch("a").result(10)
        cache.acquire("r")  # a request still runs on r when the plan drops it
        cache.apply_plan({"pinned": [], "prefetch": [], "adapters": []})
        assert not cache.has("r"), "r left the plan and is still served"
        assert "r" in cache.ready_slots()  # the running request finishes on it...
        cache.release("r")
        assert "r" not in cache.ready_slots() and "r" not in cache.host  # ...then it is gone
        shutil.rmtree(tmp_path / "a")  # the node agent removes what left the plan
        assert not cache.has("a") and "a" not in cache.ready_slots()
        assert cache.has("b")  # on disk, never in a plan: found there as before
        assert cache.has("mine") and cache.tier_of("mine") == "gpu"
        rows = {r["name"]: r for r in cache.describe()}
        assert rows["mine"]["path"] == str(remote / "r")
        assert sorted(rows) == ["b", "mine"]
    finally:
        cache.close()


def test_a_plan_file_half_written_deleted_and_recreated(cache, tmp_path):
    """A writer that truncates and writes in place is seen half way (not a plan: the last one
    stays, and the whole file is read once its write ends); a deleted file keeps the last plan;
    one created again is followed."""
    path = tmp_path / "plan.json"
    watcher = PlanWatcher(path, cache.apply_plan)
    assert not watcher.check()  # no plan yet: nothing to do, nothing wrong
    path.write_text(json.dumps(GOOD))
    assert watcher.check() and _pinned(cache) == {"a"}
    whole = json.dumps({"pinned": ["b"], "adapters": [], "prefetch": []})
    path.write_text(whole[: len(whole) // 2])  # the writer, half way
    assert not watcher.check() and watcher.last_error and _pinned(cache) == {"a"}
    path.write_text(whole)
    assert watcher.check() and watcher.last_error is None and _pinned(cache) == {"b"}
    path.unlink()
    assert not watcher.check() and _pinned(cache) == {"b"}
    path.write_text(json.dumps({"pinned": ["c"], "adapters": [], "prefetch": []}))
    assert watcher.check() and _pinned(cache) == {"c"}


def test_an_adapter_that_left_the_plan_is_not_found_again_on_disk(tmp_path):
    """Its folder stays in the node agent's cache until the agent removes it (on its next look
    at the plan; never, for an agent not told to follow the plan). Meanwhile a request found it
    there again, as any staged adapter is found, and it was resident and served once more. A
    later plan that lists it again, or an explicit load, brings it back."""
    write_adapter(tmp_path / "a", seed=1)
    cache = make_cache(tmp_path, slots=2, plan_scoped=True)  # as a server given --plan-file
    try:
        plan = {"pinned": [], "prefetch": [], "adapters": [{"name": "a", "source": "s3://b/a", "sha256": None}]}
        cache.apply_plan(plan)
        cache.prefetch("a").result(10)
        cache.apply_plan({"pinned": [], "prefetch": [], "adapters": []})
        assert (tmp_path / "a" / "adapter_config.json").is_file()  # not removed yet
        assert not cache.has("a") and "a" not in {r["name"] for r in cache.describe()}
        with pytest.raises(KeyError):
            cache.acquire("a")
        cache.apply_plan(plan)  # listed again
        assert cache.prefetch("a").result(10) >= 0
        cache.apply_plan({"pinned": [], "prefetch": [], "adapters": []})
        assert not cache.has("a")
        assert cache.load("a", tmp_path / "a") >= 0  # the admin loads it on purpose
        assert cache.has("a")
    finally:
        cache.close()


def test_a_good_plan_whose_apply_fails_is_tried_again_until_applied(tmp_path):
    """apply raising (a bug, or a fault of the moment) used to mark the file seen: the plan
    was never applied until the file changed again, and at start the error took the server
    down. Now the watcher starts, and applies the plan at a later check, with no new file."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(GOOD))
    applied, faults = [], [RuntimeError("busy"), RuntimeError("busy")]

    def apply(plan):
        if faults:
            raise faults.pop(0)
        applied.append(plan)

    watcher = PlanWatcher(plan_file, apply, interval=3600)
    watcher.start()  # the first apply fails: start goes on
    try:
        assert applied == [] and watcher.last_error == "RuntimeError: busy"
        assert watcher.check() is False and applied == []
        assert watcher.check() is True and applied == [GOOD] and watcher.last_error is None
        assert watcher.check() is False and watcher.applied == 1  # applied once; unchanged since
    finally:
        watcher.stop()


def test_an_adapter_back_in_the_plan_while_its_unload_waits_is_registered_once_it_can_be(tmp_path):
    """Adapters leave the plan while requests run on them (their unload waits for the
    requests), and come back, a pinned and b in a warm-up window, before the requests end (a
    LoRAAdapter deleted and created again, a base moved and back). register refuses a name
    being unloaded, and apply_plan only logged that: the plan counted as applied, the rows were
    dropped when the requests ended, and with no new plan file the adapters stayed unknown
    (their sources with them: requests for them were a 404), a unpinned and b not warmed up.
    Now the plan is applied again until they can be registered."""
    srcs = {n: write_adapter(tmp_path / "bucket" / n, seed=ord(n)) for n in "ab"}  # their sources only
    cache = make_cache(tmp_path / "cache", slots=3, plan_scoped=True)
    plan_file = tmp_path / "plan.json"
    back = {"pinned": ["a"], "prefetch": [{"name": "b"}],
            "adapters": [{"name": n, "source": str(src), "sha256": None} for n, src in srcs.items()]}
    try:
        plan_file.write_text(json.dumps(back | {"prefetch": []}))
        watcher = PlanWatcher(plan_file, cache.apply_plan)
        assert watcher.check()
        for name in "ab":
            cache.prefetch(name).result(10)
            assert cache.acquire(name) >= 0  # a request runs on it
        plan_file.write_text(json.dumps({"pinned": [], "prefetch": [], "adapters": []}))
        os.utime(plan_file, ns=(1, 1))
        assert watcher.check() and not cache.has("a") and not cache.has("b")  # unloading, once their requests end
        plan_file.write_text(json.dumps(back))
        os.utime(plan_file, ns=(2, 2))
        watcher.check()  # back in the plan: still being unloaded
        for name in "ab":
            cache.release(name)  # the requests end: the old rows go
        watcher.check()  # the next look at the plan (the file unchanged since)
        assert cache.has("a") and cache.has("b") and _pinned(cache) == {"a"}
        assert watcher.last_error is None
        deadline = time.monotonic() + 10
        while set(cache.ready_slots()) != {"a", "b"}:  # the pin and the warm-up window loaded
            assert time.monotonic() < deadline, cache.describe()
            time.sleep(0.005)
    finally:
        cache.close()
