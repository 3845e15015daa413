"""The cache's tiers when what is below them moves: files and versions that change around a
load (a rename during a read, a new sha256 or source, a stale staged folder or download), a
source's credentials and a name that climbs out of the cache directory, a pin whose loads
keep failing."""

from __future__ import annotations

import json
import os
import time

import loraplex.server.adapter_loader as loader

from .test_adapter_cache import _Files, check_invariants, make_cache, write_adapter


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


def test_a_new_version_is_staged_not_served_from_the_old_versions_staged_copy(tmp_path_factory):
    """The plan moves an adapter to a new version (sha256) while the node agent's cache still
    holds the old one under its name (the agent stages the new one when it gets to it; its
    .loraplex.json says which version a folder holds). A load must stage the new version
    (through the agent, or from the source), not read the old files and keep them in the host
    tier as the new version, where they were served from after every later eviction."""
    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(cache_dir / "sql", seed=1)  # v1, staged before
    (cache_dir / "sql" / ".loraplex.json").write_text(json.dumps({"name": "sql", "sha256": "1" * 64, "source": "x"}))
    v2 = write_adapter(remote / "sql-v2", seed=2)
    cfg = json.loads((v2 / "adapter_config.json").read_text())
    (v2 / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": 3 * cfg["r"]}))  # scaling 3, v1's 2
    (v2 / ".loraplex.json").write_text(json.dumps({"name": "sql", "sha256": "2" * 64, "source": "s3://bucket/sql-v2"}))
    with _Files(remote, cache_dir) as agent:
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        try:
            cache.register("sql", source="s3://bucket/sql-v1", sha256="1" * 64)
            slot = cache.prefetch("sql").result(10)
            assert not agent.staged and cache.buffers.scales[slot].max().item() == 2.0  # v1 is staged: read
            cache.register("sql", source="s3://bucket/sql-v2", sha256="2" * 64)
            cache.evict("sql")
            slot = cache.prefetch("sql").result(10)
            assert [b["sha256"] for b in agent.staged] == ["2" * 64]
            assert cache.buffers.scales[slot].max().item() == 3.0, "the old version was served as the new one"
            assert cache.describe()[0]["tier"] == "gpu"
        finally:
            cache.close()


def test_a_sources_credentials_never_reach_the_api_or_its_errors(tmp_path_factory):
    """GET /v1/adapters shows each adapter's source, and a failed fetch's error names it: the
    query string (presigned signatures) was dropped, but a password in the URL's userinfo
    (https://user:password@host/...) was shown as it was."""
    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    with _Files(remote, cache_dir) as files:
        host = files.url.removeprefix("http://")
        cache = make_cache(cache_dir, slots=2)
        try:
            cache.register("private", source=f"http://reader:s3cr3t@{host}/nothing-here?X-Amz-Signature=abc")
            try:
                cache.prefetch("private").result(10)
            except Exception as e:  # noqa: BLE001 - the fetch fails (404): its message is checked below
                message = str(e)
            row = cache.describe()[0]
            for shown in (row["source"], row["error"], message):
                assert "s3cr3t" not in shown and "X-Amz-Signature" not in shown, shown
            assert row["source"] == f"http://{host}/nothing-here"
        finally:
            cache.close()


def test_a_new_version_is_fetched_not_read_from_the_servers_own_download_of_the_old(tmp_path_factory):
    """Without a node agent the server downloads an http(s) source into --adapter-cache-dir
    itself. When the plan moves the adapter to a new version, the next load must fetch the new
    one, not read the old download and keep it as the new version."""
    import hashlib

    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(remote / "v1", seed=1)
    v2 = write_adapter(remote / "v2", seed=2)
    cfg = json.loads((v2 / "adapter_config.json").read_text())
    (v2 / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": 3 * cfg["r"]}))  # scaling 3, v1's 2
    digest = {v: hashlib.sha256((remote / v / "adapter_model.safetensors").read_bytes()).hexdigest()
              for v in ("v1", "v2")}
    with _Files(remote, cache_dir) as files:
        cache = make_cache(cache_dir, slots=2)
        try:
            cache.register("sql", source=f"{files.url}/v1", sha256=digest["v1"])
            slot = cache.prefetch("sql").result(10)
            assert cache.buffers.scales[slot].max().item() == 2.0
            cache.register("sql", source=f"{files.url}/v2", sha256=digest["v2"])
            cache.evict("sql")
            slot = cache.prefetch("sql").result(10)
            assert cache.buffers.scales[slot].max().item() == 3.0, "the old download was served as the new version"
            assert (cache_dir / "sql" / "adapter_model.safetensors").read_bytes() == (
                v2 / "adapter_model.safetensors").read_bytes()
        finally:
            cache.close()


def test_a_plan_name_that_is_not_a_folder_name_is_never_fetched_outside_the_cache(tmp_path_factory):
    """A plan's adapter names the folder its download goes to, --adapter-cache-dir/<name>/,
    which is removed first if it exists. A name that climbs out of it ("/../../<path>", from a
    hand-edited plan; the operator writes Kubernetes names) removed the folder at <path> and
    put the download there. Such a name is neither registered nor fetched, touching nothing."""
    import pytest

    from loraplex.server.adapter_sources import AdapterLoadError, fetch_adapter

    remote, root = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("node")
    write_adapter(remote / "x", seed=1)
    cache_dir, victim = root / "cache", root / "victim"
    cache_dir.mkdir()
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    name = "/" + "../" * 40 + str(victim).lstrip("/")
    with _Files(remote, cache_dir) as files:
        cache = make_cache(cache_dir, slots=2)
        try:
            cache.apply_plan({"pinned": [], "prefetch": [], "adapters": [{"name": name, "source": f"{files.url}/x"}]})
            with pytest.raises(KeyError):
                cache.prefetch(name)
            with pytest.raises(AdapterLoadError):
                fetch_adapter(name, f"{files.url}/x", None, cache_dir, None)
            assert (victim / "precious").read_text() == "keep me"
            assert sorted(p.name for p in root.iterdir()) == ["cache", "victim"]
        finally:
            cache.close()


def test_without_a_sha256_a_new_source_is_a_new_version(tmp_path_factory):
    """A LoRAAdapter may leave out its sha256: then, as for the node agent, a new source is a
    new version. The server only changed the row's source: the old version's host copy stayed
    (served after each eviction), and the old version's staged folder was read as the new."""
    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(remote / "sql-v1", seed=1)
    v2 = write_adapter(remote / "sql-v2", seed=2)
    cfg = json.loads((v2 / "adapter_config.json").read_text())
    (v2 / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": 3 * cfg["r"]}))  # scaling 3, v1's 2
    for v in ("sql-v1", "sql-v2"):  # what the node agent writes into the folder it stages
        (remote / v / ".loraplex.json").write_text(json.dumps({"name": "sql", "sha256": v * 8, "source": f"s3://b/{v}"}))
    with _Files(remote, cache_dir) as agent:
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        try:
            cache.register("sql", source="s3://b/sql-v1")
            slot = cache.prefetch("sql").result(10)  # staged through the agent
            assert cache.buffers.scales[slot].max().item() == 2.0 and "sql" in cache.host
            cache.register("sql", source="s3://b/sql-v2")  # the agent has not staged it yet
            assert "sql" not in cache.host, "the old version's host copy is kept for the new one"
            cache.evict("sql")
            slot = cache.prefetch("sql").result(10)
            assert [b["source"] for b in agent.staged] == ["s3://b/sql-v1", "s3://b/sql-v2"]
            assert cache.buffers.scales[slot].max().item() == 3.0, "the old version was served as the new one"
        finally:
            cache.close()


def test_a_pin_failing_for_a_long_time_is_still_retried(tmp_path, monkeypatch):
    """A pin's retry waits 2 s doubled per failure in a row, up to 2 minutes: the doubling was
    computed as a float of 2 ** failures, which overflows past 1,024 failures (some 34 hours
    of a node agent down). The OverflowError ended the retries for good, in the load worker,
    unseen, and the pin stayed cold once its source came back."""
    import loraplex.server.adapter_cache as cache_module

    write_adapter(tmp_path / "a", seed=1)
    weights = tmp_path / "a" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # every load fails
    delays = []

    class Timer:  # records the retry instead of waiting for it
        def __init__(self, delay, fn, args):
            delays.append(delay)
            self.daemon = True

        def start(self):
            pass

    monkeypatch.setattr(cache_module.threading, "Timer", Timer)
    cache = make_cache(tmp_path, slots=2)
    try:
        cache.register("a")
        cache.table.entries["a"].failed_in_row = 5_000
        fut = cache.pin("a")
        try:
            fut.result(10)
        except Exception:  # noqa: BLE001 - the load fails, as it should
            pass
        deadline = time.monotonic() + 5
        while not delays and time.monotonic() < deadline:
            time.sleep(0.01)
        assert delays == [cache_module.PIN_RETRY_MAX_S]
    finally:
        cache.close()


def test_a_sha256_given_with_a_new_source_is_a_new_version(tmp_path_factory):
    """A LoRAAdapter without a sha256 rolled out to a new source with one (the user starts
    pinning digests at that rollout): a new version by every rule (a new source, a new digest),
    as the node agent takes it. The server compared versions only of the same kind (sha256
    against sha256, source against source), so this one kept the old version in its slot and
    its host copy, and served it after every eviction."""
    import hashlib

    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(remote / "sql-v1", seed=1)
    v2 = write_adapter(remote / "sql-v2", seed=2)
    cfg = json.loads((v2 / "adapter_config.json").read_text())
    (v2 / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": 3 * cfg["r"]}))  # scaling 3, v1's 2
    sha = hashlib.sha256((v2 / "adapter_model.safetensors").read_bytes()).hexdigest()
    cache = make_cache(cache_dir, slots=2)
    try:
        cache.register("sql", source=str(remote / "sql-v1"))
        slot = cache.prefetch("sql").result(10)
        assert cache.buffers.scales[slot].max().item() == 2.0 and "sql" in cache.host
        cache.register("sql", source=str(remote / "sql-v2"), sha256=sha)
        assert "sql" not in cache.host, "the old version's host copy is kept for the new one"
        assert "sql" not in cache.ready_slots(), "the slot still serves the old version"
        slot = cache.prefetch("sql").result(10)
        assert cache.buffers.scales[slot].max().item() == 3.0, "the old version was served as the new one"
        check_invariants(cache)
    finally:
        cache.close()


def test_a_sha256_the_plan_no_longer_gives_is_forgotten(tmp_path_factory):
    """A LoRAAdapter's sha256 taken out (rolled out to a new source without one): the plan's
    entry then has no sha256, but register kept the old one, as if not given. The row kept
    its old version (served from its slot and its host copy), and every later load of the
    new source was checked against the old digest and failed."""
    import hashlib

    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    v1 = write_adapter(remote / "sql-v1", seed=1)
    v2 = write_adapter(remote / "sql-v2", seed=2)
    cfg = json.loads((v2 / "adapter_config.json").read_text())
    (v2 / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": 3 * cfg["r"]}))  # scaling 3, v1's 2
    sha = hashlib.sha256((v1 / "adapter_model.safetensors").read_bytes()).hexdigest()
    cache = make_cache(cache_dir, slots=2)
    try:
        cache.apply_plan({"adapters": [{"name": "sql", "source": str(v1), "sha256": sha}]})
        slot = cache.prefetch("sql").result(10)
        assert cache.buffers.scales[slot].max().item() == 2.0
        cache.apply_plan({"adapters": [{"name": "sql", "source": str(v2), "sha256": None}]})
        assert cache.table.entries["sql"].sha256 is None
        assert "sql" not in cache.host and "sql" not in cache.ready_slots(), "the old version is served on"
        slot = cache.prefetch("sql").result(10)
        assert cache.buffers.scales[slot].max().item() == 3.0
        check_invariants(cache)
    finally:
        cache.close()
