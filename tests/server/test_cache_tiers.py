"""The cache's tiers under stress: files that change during a load, the host tier's byte
bound under concurrent loads, and what an eviction frees."""

from __future__ import annotations

import os

import loraplex.server.adapter_loader as loader

from .test_adapter_cache import check_invariants, make_cache, write_adapter


def test_a_new_version_with_other_tensors_renamed_in_during_a_load_is_read_again(tmp_path, monkeypatch):
    """The node agent stages a new version whose tensors differ (other target modules) between
    the load's check of the files (read_adapter) and its read of the weights: the read planned
    for keys the new file does not have. The load must read the new version again, as for any
    change during a read, not fail with a bare KeyError."""
    write_adapter(tmp_path / "a", seed=1, targets=("q_proj", "v_proj"))
    new = write_adapter(tmp_path / "a-next", seed=2, targets=("o_proj", "down_proj"))
    real, swapped = loader.read_adapter, []

    def read_then_swap(path, base):
        spec = real(path, base)
        if not swapped:
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                os.replace(new / name, tmp_path / "a" / name)
            swapped.append(path)
        return spec

    monkeypatch.setattr(loader, "read_adapter", read_then_swap)
    cache = make_cache(tmp_path, slots=2)
    try:
        cache.prefetch("a").result(10)
        assert swapped
        assert cache.table.entries["a"].spec.target_modules == ("o_proj", "down_proj")
        assert cache.buffers.ranks[cache.slot_of("a")].tolist() == [0, 0, 0, 4, 0, 0, 4]
        check_invariants(cache)
    finally:
        cache.close()


def test_a_new_version_registered_as_a_load_ends_never_leaves_the_old_one_in_the_host_tier(tmp_path, monkeypatch):
    """A plan registers a new sha256 for an adapter while its load of the old files ends: the
    load checks that its version is still current, then keeps its copy in the host tier. A
    registration between the two discarded nothing (no copy yet) and the old version's copy
    went in after it: the next load served the old version from host memory."""
    import threading

    from loraplex.server.host_tier import HostTier

    write_adapter(tmp_path / "a", seed=1)
    cache = make_cache(tmp_path, slots=2)
    real_add, registered, threads = HostTier.add, threading.Event(), []

    def add_with_a_plan_racing(self, name, copy):
        if name == "a" and not threads:
            threads.append(threading.Thread(target=lambda: (cache.register("a", sha256="1" * 64), registered.set())))
            threads[0].start()
            registered.wait(0.5)  # it lands now, unless the add is atomic with the version check
        return real_add(self, name, copy)

    monkeypatch.setattr(HostTier, "add", add_with_a_plan_racing)
    try:
        cache.register("a", sha256="0" * 64)
        cache.prefetch("a").result(10)
        threads[0].join(5)
        assert registered.is_set()
        assert "a" not in cache.host, "the host tier keeps a version the plan replaced"
    finally:
        cache.close()
