"""A new version of an adapter that holds a slot (a rollout: the plan gives it a new sha256,
the node agent stages the new files under its name) replaces the old one in the slot.

It used to take effect "at the next load" only, and a pinned adapter is never evicted, nor
is a hot one under LRU: they served the old version until the server restarted. Now the
slot is reloaded once none of the adapter's requests runs; requests already running finish
on the version they started with, new ones wait in the queue for the new version.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from loraplex.server.adapter_format import read_adapter
from loraplex.server.adapters import LoRABuffers

from .test_adapter_cache import CFG, RANK, base_spec, check_invariants, make_cache, write_adapter

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")  # write_adapter's
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sha(directory: Path) -> str:
    return hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()


def _slot_holds(cache, slot: int, directory: Path) -> bool:
    """Whether `slot` holds exactly the adapter in `directory`, as a direct write puts it."""
    clean = LoRABuffers(CFG, 1, RANK, torch.device("cpu"), torch.float32)
    clean.write(0, read_adapter(directory, base_spec()), load_file(str(directory / "adapter_model.safetensors")))
    read = clean.layout.read_mask([4 if p in TARGETS else 0 for p in PROJECTIONS])
    return torch.equal(cache.buffers.flat[slot][read], clean.flat[0][read])


def _stage_new_version(disk: Path, name: str, seed: int) -> Path:
    """What the node agent does: the new version's files put in place under the name."""
    new = write_adapter(disk / f".{name}-next", seed=seed)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        os.replace(new / f, disk / name / f)
    return disk / name


def _until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := check()) is not None and got is not False:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {check}")


def test_a_pinned_resident_adapter_is_replaced_by_its_new_version(tmp_path):
    disk = tmp_path
    write_adapter(disk / "a", seed=1)
    cache = make_cache(disk, slots=2)
    cache.register("a", sha256=_sha(disk / "a"))
    cache.pin("a")
    slot = _until(lambda: cache.ready_slots().get("a"))
    assert _slot_holds(cache, slot, disk / "a")
    old = cache.buffers.flat[slot].clone()

    _stage_new_version(disk, "a", seed=2)
    cache.register("a", sha256=_sha(disk / "a"))  # the plan's new digest
    # Nothing uses it: the slot is reloaded at once, the pin kept.
    slot = _until(lambda: (s := cache.ready_slots().get("a")) is not None and _slot_holds(cache, s, disk / "a")
                  and s)
    assert not torch.equal(cache.buffers.flat[slot], old)
    row = next(r for r in cache.describe() if r["name"] == "a")
    assert row["pinned"] and row["state"] == "ready" and row["sha256"] == _sha(disk / "a")
    check_invariants(cache)
    cache.close()


def test_running_requests_finish_on_their_version_and_new_ones_wait_for_the_new(tmp_path):
    disk = tmp_path
    write_adapter(disk / "a", seed=1)
    v1 = write_adapter(disk / "a-v1-copy", seed=1)  # what the slot held first, for the check
    cache = make_cache(disk, slots=2)
    cache.register("a", sha256=_sha(disk / "a"))
    assert cache.acquire("a") == -1  # a request: loads it
    slot = _until(lambda: cache.ready_slots().get("a"))

    _stage_new_version(disk, "a", seed=2)
    cache.register("a", sha256=_sha(disk / "a"))
    # The request runs on: its slot keeps version 1, and no new request is admitted to it.
    for _ in range(3):
        assert "a" not in cache.ready_slots(running={"a"})
    assert cache.table.entries["a"].slot == slot and _slot_holds(cache, slot, v1)
    assert cache.acquire("a") == -1  # a second request, queued: not resident for it
    cache.release("a")  # the first request finishes
    # The step after it: the slot is given up and version 2 loads for the waiting request.
    assert "a" not in cache.ready_slots(running=set())
    slot = _until(lambda: cache.ready_slots(running=set()).get("a"))
    assert _slot_holds(cache, slot, disk / "a") and not _slot_holds(cache, slot, v1)
    cache.release("a")
    check_invariants(cache)
    cache.close()


def test_an_idle_unpinned_adapter_gives_up_its_slot_and_loads_the_new_version_when_asked(tmp_path):
    disk = tmp_path
    write_adapter(disk / "a", seed=1)
    cache = make_cache(disk, slots=2)
    cache.register("a", sha256=_sha(disk / "a"))
    cache.prefetch("a").result(10)
    _stage_new_version(disk, "a", seed=3)
    cache.register("a", sha256=_sha(disk / "a"))
    assert "a" not in cache.ready_slots()  # no old version served, nothing loaded for nobody
    assert cache.in_flight == 0
    slot = cache.prefetch("a").result(10)
    assert _slot_holds(cache, slot, disk / "a")
    check_invariants(cache)
    cache.close()


def test_a_new_version_reloads_when_its_last_request_leaves_with_no_step_after(tmp_path):
    """A rollout while a request runs on the adapter: its slot is refreshed once none of its
    requests runs, which only a step's ready_slots did. The engine releases a finished
    request at the end of the step it finished in, and an engine with nothing else to run
    takes no further step: the slot kept the old version, admitting nothing, so a pin stayed
    unloaded and a prefetch or session start for it waited until its timeout (a 503)."""
    disk = tmp_path
    write_adapter(disk / "a", seed=1)
    cache = make_cache(disk, slots=2)
    try:
        cache.register("a", sha256=_sha(disk / "a"))
        cache.pin("a")
        _until(lambda: cache.ready_slots().get("a") is not None)
        assert cache.acquire("a") >= 0  # a request runs on version 1
        _stage_new_version(disk, "a", seed=2)
        cache.register("a", sha256=_sha(disk / "a"))
        assert "a" not in cache.ready_slots(running={"a"})
        cache.release("a")  # it finishes: the engine has no other work, no step follows
        # The pin loads its new version on its own, and a prefetch answers once it is in.
        slot = cache.prefetch("a").result(10)
        assert _slot_holds(cache, slot, disk / "a")
        assert cache.table.entries["a"].slot == slot and "a" not in cache.table.stale
        check_invariants(cache)
    finally:
        cache.close()
