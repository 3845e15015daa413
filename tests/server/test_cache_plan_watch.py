"""The plan watcher: a plan that is not one is refused whole, with the reason, and the last
good plan stays in force; the watcher never dies of a plan."""

from __future__ import annotations

import json
import os

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
