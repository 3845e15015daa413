"""The adapter cache on the CPU: real PEFT files on disk, the tiny shape, real load workers.

Rules under test: pinned adapters are never evicted; an adapter held by a request is never
evicted; at most --max-concurrent-loads loads run under a storm of cold requests; a failed
load fails only that adapter and leaves its slot free; a slot loaded through the host tier
holds exactly what a direct write puts there.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraplex.server.adapter_cache import AdapterCache
from loraplex.server.adapter_format import AdapterError, BaseSpec, read_adapter, write_adapter_config
from loraplex.server.adapter_sources import AdapterLoadError
from loraplex.server.adapters import LoRABuffers, random_adapter, slot_groups
from loraplex.server.config import named_shape
from loraplex.server.host_tier import read_into_host
from loraplex.server.plan_watch import PlanWatcher
from loraplex.server.slot_sizing import max_loras_from_memory

CFG = named_shape("tiny")
RANK = 8
GB = 10**9


def write_adapter(path: Path, seed: int, rank: int = 4, cfg=CFG, targets=("q_proj", "v_proj", "o_proj", "down_proj")
                  ) -> Path:
    spec, tensors = random_adapter(cfg, rank, targets=targets, seed=seed)
    write_adapter_config(path, r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def base_spec() -> BaseSpec:
    return BaseSpec(num_layers=CFG.num_layers, module_shapes=CFG.module_shapes(), max_rank=RANK)


def make_cache(tmp_path: Path, slots: int = 3, **kw) -> AdapterCache:
    buffers = LoRABuffers(CFG, slots, RANK, torch.device("cpu"), torch.float32)
    kw.setdefault("cache_dir", tmp_path)
    return AdapterCache(buffers, base_spec(), **kw)


@pytest.fixture
def disk(tmp_path) -> Path:
    for i, name in enumerate("abcdefgh"):
        write_adapter(tmp_path / name, seed=i)
    return tmp_path


def wait_ready(cache: AdapterCache, name: str, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = cache.ready_slots()
        if name in slots:
            return slots[name]
        time.sleep(0.002)
    raise AssertionError(f"{name} not resident; {cache.describe()}")


def settled(cache: AdapterCache, timeout: float = 10) -> None:
    """Wait until no row is staging: rows with files not checked yet go through a check thread
    (AdapterLoader.needs_stage) before they wait for a slot (pending) or load."""
    deadline = time.monotonic() + timeout
    while True:
        with cache._lock:
            staging = [n for n, e in cache.table.entries.items() if e.state == "staging"]
        if not staging:
            return
        assert time.monotonic() < deadline, f"{staging} still staging; {cache.describe()}"
        time.sleep(0.002)


def check_invariants(cache: AdapterCache) -> None:
    """Every slot is free or held by exactly one loading/ready adapter; ready_slots agrees."""
    table = cache.table
    with cache._lock:
        held = [e.slot for e in table.entries.values() if e.state in ("loading", "ready")]
        assert sorted(held + table.free) == list(range(cache.buffers.num_slots))
        assert table.ready == {n: e.slot for n, e in table.entries.items() if e.ready}
        assert all(e.refs >= 0 for e in table.entries.values())
        # A row marked as holding a replaced version has a slot (or a load) to replace.
        assert all(table.entries[n].state in ("ready", "loading") for n in table.stale), table.stale


def use(cache: AdapterCache, name: str) -> int:
    """One request for `name`, start to finish: acquire, wait until resident, release."""
    cache.acquire(name)
    slot = wait_ready(cache, name)
    cache.release(name)
    return slot


@pytest.mark.parametrize("free_gb, slot_mb, want", [
    (120, 84, 256),  # H200 after an 8B base: capped
    (10, 84, 74),  # (10 - 2.147) GB * 0.8 / 84 MB = 74.8
    (2, 84, 1),  # less than the headroom: still one slot
    (0, 84, 1),
    (50, 1000, 38),
])
def test_max_loras_from_memory(free_gb, slot_mb, want):
    assert max_loras_from_memory(free_gb * GB, slot_mb * 10**6) == want


@pytest.mark.parametrize("dtype, short_reads", [(torch.float32, False), (torch.float16, False),
                                                (torch.float32, True)])
def test_slot_loaded_through_host_tier_equals_a_direct_write(disk, monkeypatch, dtype, short_reads):
    if short_reads:  # the kernel may return less than asked: the reader goes on from there
        preadv = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, views, off: preadv(fd, [views[0][:333]], off))
    buffers = LoRABuffers(CFG, 2, RANK, torch.device("cpu"), dtype)  # float16: the f32 file is converted
    cache = AdapterCache(buffers, base_spec(), cache_dir=disk)
    slot = cache.prefetch("a").result(10)
    direct = LoRABuffers(CFG, 2, RANK, torch.device("cpu"), dtype)
    spec = read_adapter(disk / "a", base_spec())
    from safetensors.torch import load_file
    direct.write(1, spec, load_file(str(disk / "a" / "adapter_model.safetensors")))
    read = buffers.layout.read_mask(direct.ranks[1].tolist())  # what the kernels read of the slot
    assert torch.equal(cache.buffers.flat[slot][read], direct.flat[1][read])
    assert torch.equal(cache.buffers.scales[slot], direct.scales[1])
    # Per projection: q, v, o and down targeted at rank 4, k, gate and up not at all (the
    # kernels skip them).
    assert cache.buffers.ranks[slot].tolist() == direct.ranks[1].tolist() == [4, 0, 4, 4, 0, 0, 4]
    assert cache.tier_of("a") == "gpu"


@pytest.mark.parametrize("chunk_bytes", [0, 100, 4 << 20], ids=["whole", "100-bytes", "default"])
def test_a_host_copy_lands_in_its_slot_as_written_view_by_view(disk, monkeypatch, chunk_bytes):
    """A load is whole-buffer copies into the slot's rows (the slot-major layout), the weights
    in chunks: the slot becomes the host copy byte for byte, which is what writing each
    tensor into its view gives wherever the kernels read, and no other slot is touched."""
    from safetensors.torch import load_file

    from loraplex.server import host_tier

    monkeypatch.setattr(host_tier, "SLOT_COPY_CHUNK_BYTES", chunk_bytes)

    spec = read_adapter(disk / "a", base_spec())
    buffers = LoRABuffers(CFG, 3, RANK, torch.device("cpu"), torch.float32)
    buffers.write(0, spec, load_file(str(disk / "a" / "adapter_model.safetensors")))
    host = read_into_host(disk / "a", spec, buffers, pin=False)
    buffers.flat[1:].normal_(), buffers.scales[1:].normal_()  # poison: slot 2 must be overwritten whole
    buffers.ranks[2] = -7
    untouched = buffers.flat[1].clone()
    host.copy_to(buffers, 2)
    assert torch.equal(buffers.flat[2].view(torch.int32), host.flat.view(torch.int32))
    read = buffers.layout.read_mask(host.rank.tolist())
    assert torch.equal(buffers.flat[2][read], buffers.flat[0][read])
    assert torch.equal(buffers.scales[2], buffers.scales[0])
    assert torch.equal(buffers.flat[1], untouched)
    assert float(buffers.flat[2][read].abs().sum()) > 0
    assert torch.equal(buffers.ranks[2], buffers.ranks[0]) and buffers.ranks[0].max() == spec.max_rank


@pytest.mark.parametrize("chunk_bytes", [256, 4 << 20], ids=["256-bytes", "default"])
def test_a_disk_load_copied_chunk_by_chunk_holds_what_a_direct_write_does(disk, monkeypatch, chunk_bytes):
    """A load from disk copies each chunk's tensors into the slot as soon as they are read:
    the slot ends up as the host copy, byte for byte, and equal to a direct write where the
    kernels read; a load from the host tier after it gives the same bytes again."""
    from safetensors.torch import load_file

    from loraplex.server import disk_read

    monkeypatch.setattr(disk_read, "READ_CHUNK_BYTES", chunk_bytes)
    cache = make_cache(disk, slots=2)
    cache.buffers.flat.normal_()  # poison: every byte of the slot must come from the load
    slot = cache.prefetch("a").result(10)
    host = cache.host.get("a")
    assert torch.equal(cache.buffers.flat[slot].view(torch.int32), host.flat.view(torch.int32))
    clean = LoRABuffers(CFG, 1, RANK, torch.device("cpu"), torch.float32)
    spec = read_adapter(disk / "a", base_spec())
    clean.write(0, spec, load_file(str(disk / "a" / "adapter_model.safetensors")))
    read = clean.layout.read_mask(host.rank.tolist())
    assert torch.equal(cache.buffers.flat[slot][read], clean.flat[0][read])
    assert torch.equal(cache.buffers.scales[slot], clean.scales[0])
    cache.evict("a")
    cache.buffers.flat.normal_()
    slot = cache.prefetch("a").result(10)  # from the host tier now
    assert torch.equal(cache.buffers.flat[slot][read], clean.flat[0][read])
    cache.close()


def test_a_reload_from_disk_reads_the_files_again_only_when_they_changed(disk, monkeypatch):
    """A load after the host copy was dropped reuses the spec the last read checked and its read
    plan, while the adapter's files are the same ones, and lands the same bytes; a new version
    put in place (renamed over, as the node agent stages one) is read and checked again, and
    its own scaling lands in the slot."""
    import loraplex.server.adapter_loader as loader

    reads = []
    real = loader.read_adapter
    monkeypatch.setattr(loader, "read_adapter", lambda path, base: reads.append(path) or real(path, base))
    cache = make_cache(disk, slots=2)

    def reload() -> int:
        cache.evict("a")
        cache.host.discard("a")
        return cache.prefetch("a").result(10)

    slot = cache.prefetch("a").result(10)
    first_scale = cache.buffers.scales[slot].clone()
    first = cache.buffers.flat[slot].clone()
    read = cache.buffers.layout.read_mask(cache.host.get("a").rank.tolist())
    assert len(reads) == 1
    reload()
    cache.buffers.flat.normal_()  # poison: the planned reload must write every byte read
    slot = reload()
    assert len(reads) == 1, "unchanged files were parsed again"
    assert torch.equal(cache.buffers.flat[slot][read], first[read])
    new = write_adapter(disk / "a-next", seed=42, rank=4)
    cfg = json.loads((new / "adapter_config.json").read_text())
    (new / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": 3 * cfg["r"]}))
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        os.replace(new / name, disk / "a" / name)
    slot = reload()
    assert len(reads) == 2
    scales = cache.buffers.scales[slot]
    assert torch.allclose(scales[first_scale != 0], 1.5 * first_scale[first_scale != 0])
    cache.close()


def test_a_reload_racing_a_new_version_loads_the_new_version(disk, monkeypatch):
    """The node agent renames a new version over an adapter's file after the loader saw the old
    stamp: the kept read plan must not run on the new file (its offsets moved); the load reads
    the new file as a new one, and the slot holds its weights."""
    from safetensors.torch import load_file

    import loraplex.server.adapter_loader as loader

    cache = make_cache(disk, slots=2)
    cache.prefetch("a").result(10)
    old_stamp = cache._lookup("a").disk_read.stamp
    cache.evict("a")
    cache.host.discard("a")
    spec, tensors = random_adapter(CFG, 4, targets=("q_proj", "v_proj", "o_proj", "down_proj"), seed=77)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(disk / "new.safetensors"),
              metadata={"pad": "x" * 200})  # the data's offsets move
    os.replace(disk / "new.safetensors", disk / "a" / "adapter_model.safetensors")
    real_stamp, calls = loader.files_stamp, []

    def stamp_read_before_the_rename(*a):  # the load's first look at the files predates the rename
        calls.append(a)
        return old_stamp if len(calls) == 1 else real_stamp(*a)

    monkeypatch.setattr(loader, "files_stamp", stamp_read_before_the_rename)
    cache.buffers.flat.normal_()
    slot = cache.prefetch("a").result(10)
    clean = LoRABuffers(CFG, 1, RANK, torch.device("cpu"), torch.float32)
    clean.write(0, read_adapter(disk / "a", base_spec()), load_file(str(disk / "a" / "adapter_model.safetensors")))
    read = clean.layout.read_mask(cache.host.get("a").rank.tolist())
    assert torch.equal(cache.buffers.flat[slot][read], clean.flat[0][read])
    cache.close()


def test_loads_racing_new_versions_land_one_whole_version(disk):
    """A storm: four adapters paged through two slots (a host tier of one copy, so reloads read
    the disk, through kept read plans) while another thread swaps each adapter's folder to a
    new version, as the node agent stages one (a symlink renamed over the name). Versions differ
    in their weights' values, in their data's offsets (a longer or shorter header) and in
    their config's lora_alpha. Whenever an adapter is resident and held, its slot holds one
    whole version: that version's weights and that version's scaling, never a mix of two, never
    bytes read at another version's offsets."""
    import random

    from safetensors.torch import load_file

    names, targets = ["a", "b", "c", "d"], ("q_proj", "v_proj", "o_proj", "down_proj")
    clean = LoRABuffers(CFG, 1, RANK, torch.device("cpu"), torch.float32)
    read = clean.layout.read_mask([4 if p in targets else 0 for p in
                                   ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")])
    versions: dict[str, list[Path]] = {}
    want: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (weights where read, scales)
    for i, name in enumerate(names):
        versions[name], want[name] = [], []
        for v in range(3):
            d = disk / f"{name}.v{v}"
            d.mkdir()
            _, tensors = random_adapter(CFG, 4, targets=targets, seed=100 + 10 * i + v)
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(d / "adapter_model.safetensors"),
                      metadata={"pad": "x" * (40 * v)})
            write_adapter_config(d, r=4, lora_alpha=4 * (v + 1), target_modules=list(targets))
            clean.write(0, read_adapter(d, base_spec()), load_file(str(d / "adapter_model.safetensors")))
            versions[name].append(d)
            want[name].append((clean.flat[0][read].clone(), clean.scales[0].clone()))

    def publish_version(name: str, v: int) -> None:
        link = disk / f".{name}.link"
        link.unlink(missing_ok=True)
        link.symlink_to(versions[name][v].name)
        os.replace(link, disk / name)  # the name now means version v, all at once

    for name in names:
        for f in (disk / name).iterdir():
            f.unlink()
        (disk / name).rmdir()
        publish_version(name, 0)
    cache = make_cache(disk, slots=2, max_cpu_loras=1, max_concurrent_loads=2)
    stop, errors, checks = threading.Event(), [], [0]

    def publish():
        rng = random.Random(1)
        while not stop.is_set():
            publish_version(rng.choice(names), rng.randrange(3))
            time.sleep(0.002)

    churned = []  # loads that gave up: the files changed during each of their reads

    def client(seed):
        rng = random.Random(seed)
        try:
            for _ in range(150):
                name = rng.choice(names)
                cache.acquire(name)
                try:
                    try:
                        slot = cache.prefetch(name).result(10)
                    except AdapterLoadError as e:
                        assert "changed during each of" in str(e), e
                        churned.append(name)
                        continue
                    got = (cache.buffers.flat[slot][read], cache.buffers.scales[slot])
                    if not any(torch.equal(got[0], w) and torch.equal(got[1], s) for w, s in want[name]):
                        errors.append(f"{name} in slot {slot} is no whole version")
                    checks[0] += 1
                finally:
                    cache.release(name)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    publisher = threading.Thread(target=publish)
    clients = [threading.Thread(target=client, args=(s,)) for s in range(2)]
    publisher.start()
    for t in clients:
        t.start()
    for t in clients:
        t.join(60)
    stop.set()
    publisher.join(10)
    assert errors == [] and checks[0] + len(churned) == 300 and len(churned) < 30
    assert cache.metrics.evictions.labels("gpu")._value.get() > 20  # really paged, through the disk
    check_invariants(cache)
    cache.close()


def test_slot_views_are_aligned_and_disjoint():
    buffers = LoRABuffers(CFG, 2, RANK, torch.device("cpu"), torch.float16)
    spans = []
    for layer in buffers.layers:
        for g in layer.values():
            for t in (g.a, g.b):
                assert t.stride(0) == buffers.layout.slot_elems and t[1].is_contiguous()
                start = t.data_ptr() - buffers.flat.data_ptr()
                assert start % 128 == 0
                spans.append((start, start + t[0].numel() * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= buffers.layout.slot_elems * 2


def test_pinned_adapter_is_never_evicted(disk):
    cache = make_cache(disk, slots=3)
    pinned_slot = cache.pin("a").result(10)
    for name in "bcdefgh" * 2:  # 14 cold misses through the 2 unpinned slots
        assert use(cache, name) != pinned_slot
        assert cache.ready_slots()["a"] == pinned_slot
    assert cache.metrics.evictions.labels("gpu")._value.get() >= 12
    cache.unpin("a")
    for name in "bcd":
        use(cache, name)
    assert "a" not in cache.ready_slots()  # unpinned, it pages like the rest
    check_invariants(cache)


def test_pins_take_all_slots_but_one_and_the_rest_stay_pending(disk):
    cache = make_cache(disk, slots=3)
    futures = [cache.pin(n) for n in "abc"]
    futures[0].result(10), futures[1].result(10)
    settled(cache)
    rows = {r["name"]: r for r in cache.describe()}
    assert rows["c"]["pin_pending"] and rows["c"]["state"] == "pending"
    assert use(cache, "d") not in (rows["a"]["slot"], rows["b"]["slot"])  # requests still page
    cache.unpin("a")
    assert futures[2].result(10) == rows["a"]["slot"]  # the pending pin took the freed share


@pytest.mark.parametrize("how", ["pinned while resident", "loaded for its own request"])
def test_pins_never_keep_the_last_slot_from_requests(disk, how):
    """Two slots, both taken by pins the pending rule could not stop: a and b pinned while
    resident, or b (pinned, pending behind a) loaded for a request of its own. A request for c
    still gets a slot: the newest pin (b, the one over the share) gives its slot and waits
    pending, as a pin over the share does."""
    cache = make_cache(disk, slots=2)
    if how == "pinned while resident":
        for name in "ab":
            use(cache, name)
            cache.pin(name)
    else:
        cache.pin("a").result(10)
        fut = cache.pin("b")
        assert [r["pin_pending"] for r in cache.describe() if r["name"] == "b"] == [True]
        use(cache, "b")
        assert fut.result(10) in (0, 1)
    assert set(cache.ready_slots()) == {"a", "b"}
    slot_c = use(cache, "c")
    rows = {r["name"]: r for r in cache.describe()}
    assert rows["b"]["pinned"] and rows["b"]["pin_pending"] and rows["b"]["state"] == "pending"
    assert rows["c"]["slot"] == slot_c and cache.ready_slots().keys() == {"a", "c"}
    assert use(cache, "d") == slot_c  # c (unpinned, idle) pages; a, the older pin, stays
    cache.unpin("a")
    wait_ready(cache, "b")  # the pending pin takes the freed share
    check_invariants(cache)


def test_adapter_in_use_is_never_evicted(disk):
    cache = make_cache(disk, slots=2)
    cache.acquire("a")  # a running request
    slot_a = wait_ready(cache, "a")
    cache.acquire("b")  # a queued request: its adapter loads and stays until it runs
    wait_ready(cache, "b")
    assert cache.acquire("c") == -1  # no evictable slot: c waits
    settled(cache)
    time.sleep(0.05)
    assert cache.ready_slots() == {"a": slot_a, "b": 1 - slot_a}
    assert [r["state"] for r in cache.describe() if r["name"] == "c"] == ["pending"]
    cache.release("b")  # b's request finished: b is the only candidate
    assert wait_ready(cache, "c") == 1 - slot_a
    assert cache.ready_slots()["a"] == slot_a
    check_invariants(cache)


def test_load_cap_holds_under_a_storm_of_cold_requests(disk, tmp_path, monkeypatch):
    for i in range(24):
        write_adapter(disk / f"s{i}", seed=100 + i)
    cache = make_cache(disk, slots=6, max_concurrent_loads=2)
    running, peak = 0, 0
    lock = threading.Lock()
    copy = cache.loader.copy_to_slot

    def slow_copy(host, slot, *rest):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01)
        copy(host, slot, *rest)
        with lock:
            running -= 1

    monkeypatch.setattr(cache.loader, "copy_to_slot", slow_copy)
    names = [f"s{i}" for i in range(24)]
    errors = []

    def client(batch):
        try:
            for n in batch:
                use(cache, n)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(names[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert peak == 2 and cache.max_in_flight_seen == 2
    assert cache.in_flight == 0
    hist = cache.metrics.load_seconds.labels("disk")
    assert sum(b.get() for b in hist._buckets) == 24
    check_invariants(cache)


def corrupt(path: Path) -> None:
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def garbled(path: Path) -> None:
    f = path / "adapter_model.safetensors"
    f.write_bytes(b"\xff" * 64 + f.read_bytes()[64:])


def missing(path: Path) -> None:
    (path / "adapter_model.safetensors").unlink()


def wrong_shape(path: Path) -> None:
    other = named_shape("tiny").__class__(**{**named_shape("tiny").__dict__, "hidden_size": 32})
    write_adapter(path, seed=9, cfg=other)


@pytest.mark.parametrize("damage, reason", [(corrupt, "corrupt"), (garbled, "corrupt"), (missing, "missing"),
                                           (wrong_shape, "mismatch")])
def test_failed_load_fails_only_its_requests_and_frees_the_slot(disk, damage, reason):
    cache = make_cache(disk, slots=2)
    damage(disk / "b")
    assert cache.acquire("b") == -1
    with pytest.raises(AdapterLoadError) as err:
        cache.prefetch("b").result(10)
    assert err.value.reason == reason and "'b'" in str(err.value)
    deadline = time.monotonic() + 5
    while not cache.take_failures() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert cache.num_free == 2 and "b" not in cache.ready_slots()
    assert cache.metrics.load_failures.labels(reason)._value.get() >= 1
    assert use(cache, "a") in (0, 1) and use(cache, "c") in (0, 1)  # the rest are served
    row = {r["name"]: r for r in cache.describe()}["b"]
    assert row["state"] == "failed" and row["error"]
    cache.release("b")
    check_invariants(cache)


def test_out_of_memory_fails_only_that_load(disk, monkeypatch):
    cache = make_cache(disk, slots=2)
    import loraplex.server.adapter_loader as loader

    real = loader.read_into_host

    def oom(path, *a, **kw):
        if Path(path).name == "b":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 84.00 MiB")
        return real(path, *a, **kw)

    monkeypatch.setattr(loader, "read_into_host", oom)
    with pytest.raises(AdapterLoadError, match="out of memory") as err:
        cache.prefetch("b").result(10)
    assert err.value.reason == "oom" and cache.num_free == 2
    assert cache.prefetch("a").result(10) in (0, 1)


def test_unloaded_while_its_load_fails_the_row_stays_until_its_requests_leave(disk, monkeypatch):
    """unload_lora_adapter during a load that then fails, with requests holding the adapter: the
    row must outlive the load until they release it. It used to go at once; a request then found
    the folder on disk again under a new row, and the old requests' releases took that row's
    references below zero."""
    import loraplex.server.adapter_loader as loader

    cache = make_cache(disk, slots=2)
    started, fail = threading.Event(), threading.Event()

    def failing_read(path, *a, **kw):
        started.set()
        assert fail.wait(10)
        raise OSError("disk gone")

    monkeypatch.setattr(loader, "read_into_host", failing_read)
    assert cache.acquire("a") == -1 and cache.acquire("a") == -1  # two queued requests
    assert started.wait(10)
    assert cache.unload("a") is False  # deferred: requests hold it
    fail.set()
    deadline = time.monotonic() + 10
    while cache.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert "disk gone" in cache.take_failures()["a"]
    assert not cache.has("a")  # unloading: unknown to new requests, the folder on disk notwithstanding
    cache.release("a")
    assert not cache.has("a")
    cache.release("a")  # the last one: now the row goes
    monkeypatch.setattr(loader, "read_into_host", read_into_host)
    assert use(cache, "a") in (0, 1)  # found on disk again, a fresh row
    assert [r["requests"] for r in cache.describe() if r["name"] == "a"] == [0]
    check_invariants(cache)


def test_drain_skips_a_pending_name_whose_row_was_unloaded(disk):
    """A prefetch waits for a slot (pending), then is unloaded: its row goes at once, its name
    stays in the pending queue until pump meets it. The engine's ready_slots, with every slot
    busy, runs the anti-starvation check over that queue; it raised KeyError there, on the
    engine thread, which stopped serving for every adapter."""
    cache = make_cache(disk, slots=2)
    for name in "ab":
        cache.acquire(name)
        wait_ready(cache, name)  # both slots busy: nothing evictable
    cache.prefetch("c")
    settled(cache)
    assert [r["state"] for r in cache.describe() if r["name"] == "c"] == ["pending"]
    assert cache.unload("c") is True
    assert "c" in cache.table.pending and "c" not in cache.table.entries
    assert cache.ready_slots({"a", "b"}).keys() == {"a", "b"}
    check_invariants(cache)


def test_host_tier_serves_a_reload_and_drops_least_recent_by_bytes(disk):
    cache = make_cache(disk, slots=1, max_cpu_loras=2)
    for name in "abc":
        use(cache, name)
    assert cache.host.names() == ["b", "c"]  # a dropped: two slot-sized copies fit
    assert cache.tier_of("b") == "host" and cache.tier_of("a") == "disk"
    use(cache, "b")
    assert cache.metrics.load_seconds.labels("host")._sum.get() > 0
    assert cache.metrics.hits.labels("host")._value.get() == 1
    assert cache.metrics.evictions.labels("host")._value.get() == 1


def test_host_tier_counts_copies_of_the_slots_size(tmp_path):
    """--max-cpu-loras counts adapters: with slots that hold q/k/v alone, the host tier holds
    that many copies of the smaller slot, not as many bytes as full slots would take."""
    qv = ("q_proj", "v_proj")
    for i, name in enumerate("abc"):
        write_adapter(tmp_path / name, seed=i, targets=qv)
    buffers = LoRABuffers(CFG, 1, RANK, torch.device("cpu"), torch.float32, groups=slot_groups(qv))
    cache = AdapterCache(buffers, base_spec(), cache_dir=tmp_path, max_cpu_loras=2)
    assert buffers.bytes_per_slot == LoRABuffers.slot_bytes(CFG, RANK, torch.float32, ("qkv",))
    assert cache.host.capacity_bytes == 2 * buffers.bytes_per_slot
    for name in "abc":
        use(cache, name)
    assert cache.host.names() == ["b", "c"]


def test_lazy_discovery_unknown_names_and_paths(disk, tmp_path):
    cache = make_cache(disk, slots=2)
    assert cache.has("a") and not cache.has("nope")
    with pytest.raises(KeyError):
        cache.acquire("nope")
    (disk / "sub").mkdir()
    write_adapter(disk / "sub" / "x", seed=3)
    assert not cache.has("sub/x") and not cache.has("../" + disk.name + "/a")


def test_load_registers_and_evicts_when_full_unload_frees(disk, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    write_adapter(other / "z", seed=7)
    cache = make_cache(disk, slots=1)
    use(cache, "a")
    assert cache.load("zed", other / "z") == 0  # full: a is evicted, not refused
    assert cache.ready_slots() == {"zed": 0}
    assert cache.unload("zed") and cache.num_free == 1 and not cache.has("zed")


def test_lfu_policy_keeps_the_frequent_adapter(disk):
    cache = make_cache(disk, slots=2, policy="lfu-aged")
    for _ in range(5):
        use(cache, "a")
    for name in "bcdef":
        use(cache, name)
        assert "a" in cache.ready_slots()


@pytest.mark.parametrize("policy", ["lru", "lfu-aged"])
def test_an_ended_warm_up_window_is_evicted_first_until_requested(disk, policy):
    """The plan's prefetch list holds open warm-up windows: "a" and "b" are a campaign, warm
    and much used. When their windows end (they leave the list), the next loads take their
    slots before the policy's pick ("c": used once, least recently); a request for "b" makes
    it ordinary again."""
    cache = make_cache(disk, slots=3, policy=policy)
    window = {"name": "a", "start": "2026-05-01T08:00:00Z", "end": "2026-05-02T08:00:00Z"}
    cache.apply_plan({"prefetch": [window, window | {"name": "b"}]})
    use(cache, "c")
    for _ in range(5):
        use(cache, "a")
        use(cache, "b")
    cache.apply_plan({"prefetch": []})  # the campaign is over
    rows = {r["name"]: r for r in cache.describe()}
    assert rows["a"]["expired"] and rows["b"]["expired"] and not rows["c"]["expired"]
    use(cache, "b")  # requested again: no longer expired
    use(cache, "d")
    assert set(cache.ready_slots()) == {"b", "c", "d"}  # "a" went, not the policy's pick "c"
    use(cache, "e")
    assert set(cache.ready_slots()) == {"b", "d", "e"}  # back to the policy: "c"
    # A window that opens again, or a prefetch (a session), makes an adapter wanted again.
    cache.apply_plan({"prefetch": [window | {"name": "d"}]})
    cache.apply_plan({"prefetch": []})
    assert cache.table.entries["d"].expired
    cache.apply_plan({"prefetch": [window | {"name": "d"}]})
    assert not cache.table.entries["d"].expired
    cache.apply_plan({"prefetch": []})
    assert cache.table.entries["d"].expired
    cache.prefetch("d").result(5)
    assert not cache.table.entries["d"].expired
    check_invariants(cache)


def test_an_adapter_entering_the_plans_prefetch_list_is_loaded_at_once(disk):
    """The operator lists a warm-up window warmupLeadSeconds before its start: the server
    loads it then, on its own (the node agent's prefetch call may come before this server
    has read the plan, and finds the adapter unknown), and not again at every later plan."""
    cache = make_cache(disk, slots=3)
    window = {"name": "a", "start": "2026-05-01T08:00:00Z", "end": "2026-05-02T08:00:00Z"}
    cache.apply_plan({"adapters": [], "pinned": [], "prefetch": [window]})
    wait_ready(cache, "a")
    row = next(r for r in cache.describe() if r["name"] == "a")
    assert row["hits"] == 0 and not row["pinned"]
    cache.evict("a")
    cache.apply_plan({"adapters": [], "pinned": [], "prefetch": [window]})  # the same list again
    time.sleep(0.1)
    assert "a" not in cache.ready_slots() and cache.in_flight == 0
    check_invariants(cache)


def test_plan_file_pins_follow_a_symlink_swap(disk, tmp_path, tmp_path_factory):
    cache = make_cache(disk, slots=3)
    mount = tmp_path / "mount"
    mount.mkdir()

    def publish(version: str, plan: dict, gz: bool = False) -> None:  # the kubelet's update: new dir, swap
        d = mount / f"..{version}"
        d.mkdir()
        raw = json.dumps(plan).encode()
        (d / "plan.json").write_bytes(gzip.compress(raw) if gz else raw)
        tmp = mount / "..data_tmp"
        tmp.symlink_to(d.name)
        os.replace(tmp, mount / "..data")
        if not (mount / "plan.json").is_symlink():
            (mount / "plan.json").symlink_to("..data/plan.json")

    src = write_adapter(tmp_path_factory.mktemp("remote") / "r", seed=42)
    publish("v1", {"pinned": ["a"], "adapters": [
        {"name": "a", "source": str(disk / "a"), "sha256": None, "pinned": True},
        {"name": "remote", "source": f"file://{src}", "sha256": None, "pinned": False}], "prefetch": []})
    watcher = PlanWatcher(mount / "plan.json", cache.apply_plan, interval=0.01)
    assert watcher.check() and not watcher.check()  # unchanged: nothing to do
    wait_ready(cache, "a")
    assert {r["name"]: r["pinned"] for r in cache.describe()} == {n: n == "a" for n in [*"abcdefgh", "remote"]}
    use(cache, "remote")  # not on disk: fetched from its source (a local path here)
    assert cache.metrics.load_seconds.labels("source")._sum.get() > 0
    publish("v2", {"pinned": ["b"], "adapters": [], "prefetch": []}, gz=True)  # a large plan comes gzipped
    assert watcher.check()
    wait_ready(cache, "b")
    rows = {r["name"]: r for r in cache.describe()}
    assert rows["b"]["pinned"] and not rows["a"]["pinned"]
    (mount / "..v2" / "plan.json").write_text("{not json")  # a broken plan keeps the last one
    os.utime(mount / "..v2" / "plan.json", ns=(1, 1))
    assert not watcher.check() and watcher.last_error
    assert {r["name"] for r in cache.describe() if r["pinned"]} == {"b"}


class _Files(threading.Thread):
    """A loopback HTTP server: GET serves `root` (each path asked for kept in `gets`); POST /v1/stage acts as the node agent (copies
    the named source folder into `cache_dir/<name>/` and answers 200, or 404 if absent). With
    `delay`, each GET and POST waits that many seconds first (a slow source or agent)."""

    def __init__(self, root: Path, cache_dir: Path | None = None, delay: float = 0.0):
        import functools
        import http.server
        import shutil

        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.gets.append(self.path)
                time.sleep(outer.delay)
                super().do_GET()

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.staged.append(body)
                outer.authorization.append(self.headers.get("Authorization"))
                time.sleep(outer.delay)
                src = root / body["source"].rsplit("/", 1)[-1]
                if cache_dir is None or not src.is_dir():
                    self.send_response(404)
                    self.end_headers()
                    self.wfile.write(b'{"error": {"reason": "NotFound"}}')
                    return
                shutil.copytree(src, cache_dir / body["name"], dirs_exist_ok=True)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(json.dumps({"adapter": {"name": body["name"]}}).encode())

            def log_message(self, *a):
                pass

        self.delay = delay
        self.staged: list[dict] = []
        self.gets: list[str] = []
        self.authorization: list[str | None] = []  # each POST's Authorization header
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        super().__init__(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()


def test_a_disk_miss_is_staged_through_the_node_agent(tmp_path_factory):
    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(remote / "sql-v2", seed=5)
    with _Files(remote, cache_dir) as agent:
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        cache.register("sql", source="s3://bucket/sql-v2", sha256="ab" * 32)
        cache.register("gone", source="s3://bucket/nothing-here")
        assert cache.tier_of("sql") == "source"
        cache.prefetch("sql").result(10)
        # The slots' dtype goes along: the agent stages a copy of F32 weights in it.
        assert agent.staged[0] == {"name": "sql", "source": "s3://bucket/sql-v2", "sha256": "ab" * 32,
                                   "dtype": "float32"}
        assert (cache_dir / "sql" / "adapter_config.json").is_file()
        assert cache.metrics.load_seconds.labels("source")._sum.get() > 0
        with pytest.raises(AdapterLoadError, match="node agent could not stage it") as err:
            cache.prefetch("gone").result(10)
        assert err.value.reason == "fetch" and cache.num_free == 1


def test_a_disk_miss_is_fetched_directly_over_http_and_checked(tmp_path_factory):
    import hashlib

    remote, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(remote / "sql-v2", seed=5)
    digest = hashlib.sha256((remote / "sql-v2" / "adapter_model.safetensors").read_bytes()).hexdigest()
    with _Files(remote, cache_dir) as files:
        cache = make_cache(cache_dir, slots=2)
        cache.register("sql", source=f"{files.url}/sql-v2?token=secret", sha256=digest)
        cache.register("tampered", source=f"{files.url}/sql-v2", sha256="00" * 32)
        cache.prefetch("sql").result(10)
        assert (cache_dir / "sql" / "adapter_model.safetensors").read_bytes() == (
            remote / "sql-v2" / "adapter_model.safetensors").read_bytes()
        assert {r["name"]: r["source"] for r in cache.describe()}["sql"] == f"{files.url}/sql-v2"  # no token
        with pytest.raises(AdapterLoadError, match="does not match sha256") as err:
            cache.prefetch("tampered").result(10)
        assert err.value.reason == "corrupt" and not (cache_dir / "tampered").exists()
        assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".")] == []  # no half download left


def test_install_from_memory_with_and_without_a_host_copy(disk):
    cache = make_cache(disk, slots=2)
    spec, tensors = random_adapter(CFG, 4, targets=("q_proj", "down_proj"), seed=1)
    from loraplex.server.adapters import AdapterId

    kept = cache.install(AdapterId("kept", "d1", "memory"), spec, tensors, keep_host_copy=True)
    once = cache.install(AdapterId("once", "d2", "memory"), spec, tensors)
    assert {kept, once} == {0, 1}
    read = cache.buffers.layout.read_mask(cache.buffers.ranks[kept].tolist())
    assert torch.equal(cache.buffers.ranks[kept], cache.buffers.ranks[once]) and read.any()
    flat = cache.buffers.flat
    assert torch.equal(flat[kept][read], flat[once][read])  # both paths lay the adapter out alike
    use(cache, "a")
    use(cache, "b")  # both evicted: "once" is forgotten, "kept" pages back in from its host copy
    assert not cache.has("once") and cache.tier_of("kept") == "host"
    assert use(cache, "kept") in (0, 1)
    check_invariants(cache)


def test_unload_while_in_use_or_pending(disk):
    cache = make_cache(disk, slots=1)
    cache.acquire("a")
    slot = wait_ready(cache, "a")
    waiting = cache.prefetch("b")  # no slot: a is in use
    settled(cache)
    assert cache.unload("b")  # pending, unused: gone now, its waiter told
    with pytest.raises(AdapterLoadError, match="unloaded"):
        waiting.result(5)
    assert not cache.unload("a")  # in use: goes when its request ends
    assert not cache.has("a")  # new requests cannot name it
    with pytest.raises(AdapterError, match="being unloaded"):
        cache.register("a", path=disk / "a")
    cache.release("a")
    assert cache.num_free == 1 and cache.ready_slots() == {}
    assert use(cache, "c") == slot
    check_invariants(cache)


def test_a_starved_load_drains_one_busy_adapter_after_its_running_requests(disk):
    now = [0.0]
    cache = make_cache(disk, slots=2, clock=lambda: now[0])
    cache.drain_after = 5.0
    for name in "ab":  # each held by a request (running or queued)
        cache.acquire(name)
        wait_ready(cache, name)
    slots = cache.ready_slots()
    assert cache.acquire("c") == -1  # no slot free or evictable
    settled(cache)
    now[0] = 4.9
    assert cache.ready_slots({"a", "b"}) == slots  # not starved long enough
    now[0] = 5.0
    assert cache.ready_slots({"a", "b"}) == {"b": slots["b"]}  # a (least recent) admits no more
    assert cache.ready_slots({"a", "b"}) == {"b": slots["b"]} and "c" not in cache.ready_slots()  # a still runs
    cache.ready_slots({"b"})  # a's running requests are done: its slot goes to c
    assert wait_ready(cache, "c") == slots["a"]
    rows = {r["name"]: r for r in cache.describe()}
    assert rows["a"]["state"] == "pending" and rows["a"]["requests"] == 1  # a's queued request waits its turn
    check_invariants(cache)
    cache.release("c")  # c's request done: a pages back in
    assert wait_ready(cache, "a") == slots["a"]
    check_invariants(cache)


def test_unloaded_while_loading_and_its_last_request_leaves_the_row_stays_until_the_load_ends(disk):
    """unload_lora_adapter during a load, then the only request leaves (aborted) before the load
    ends: the row must stay (unknown to new requests) until the load ends, as unload promised.
    release dropped it at once; a request then found the folder on disk again under a new row
    that loaded into the other slot, and the old load's end took the name out of `ready`: the
    new row was "ready" but never admitted its requests."""
    cache = make_cache(disk, slots=2)
    started, go = threading.Event(), threading.Event()
    real = cache.loader.copy_to_slot

    def slow_first(host, slot, *rest):
        if not started.is_set():
            started.set()
            assert go.wait(10)
        real(host, slot, *rest)

    cache.loader.copy_to_slot = slow_first
    assert cache.acquire("a") == -1
    assert started.wait(10)
    assert cache.unload("a") is False  # deferred: a request holds it and it loads
    cache.release("a")  # the request is aborted while the load still runs
    assert not cache.has("a")  # still unloading: unknown until its load ends
    go.set()
    deadline = time.monotonic() + 10
    while cache.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    check_invariants(cache)
    assert cache.num_free == 2 and cache.has("a")  # gone, then found on disk again: a fresh row
    slot = use(cache, "a")
    assert cache.ready_slots() == {"a": slot}
    check_invariants(cache)


def test_loads_pending_counts_only_loads_still_pending(disk):
    """An unloaded pending row leaves its name in the pending queue until pump meets it, and
    pump stops at the first load that finds no slot: loraplex_adapter_loads_pending counted
    the queue's names, so it stayed one too high while every slot was busy."""
    cache = make_cache(disk, slots=1)
    cache.acquire("a")
    wait_ready(cache, "a")  # the only slot busy
    cache.acquire("b")  # a request waits for a slot
    cache.prefetch("b")  # and a session start (it keeps the load wanted once the request leaves)
    cache.prefetch("c")
    settled(cache)
    cache.refresh_metrics()
    assert cache.metrics.loads_pending._value.get() == 2
    assert cache.unload("c") is True
    cache.refresh_metrics()
    assert cache.metrics.loads_pending._value.get() == 1
    cache.release("b")  # pump runs: b still finds no slot, c's name stays behind it
    assert cache.metrics.loads_pending._value.get() == 1
    cache.release("a")
    wait_ready(cache, "b")
    cache.refresh_metrics()
    assert cache.metrics.loads_pending._value.get() == 0
    check_invariants(cache)


def test_a_prefetch_loads_a_pin_waiting_over_its_share_as_a_request_does(disk):
    """Two slots: a pinned and resident, b pinned over the pins' share (pending), one slot
    free. A session start or the warmer's prefetch of b waited for ever (503 after the
    session's timeout) while a prefetch of an unpinned adapter loaded at once and a request
    for b would too: a prefetch asks for the adapter as a request does, so the pin loads;
    requests still page, through the newest idle pin's slot."""
    cache = make_cache(disk, slots=2)
    cache.pin("a").result(10)
    pin_b = cache.pin("b")
    assert [r["pin_pending"] for r in cache.describe() if r["name"] == "b"] == [True]
    assert cache.num_free == 1
    slot_b = cache.prefetch("b").result(10)
    assert pin_b.result(10) == slot_b and set(cache.ready_slots()) == {"a", "b"}
    assert use(cache, "c") == slot_b  # b, the newest idle pin, gives its slot to a request
    rows = {r["name"]: r for r in cache.describe()}
    assert rows["b"]["pin_pending"] and rows["a"]["state"] == "ready"
    time.sleep(0.05)
    assert "b" not in cache.ready_slots()  # back to waiting over the share: no new prefetch asked
    check_invariants(cache)


class _CancelledAfterTheCheck(concurrent.futures.Future):
    """A prefetch's future whose client gives up (a session start's timeout: asyncio cancels
    the future it wraps) just after the load's end checked that it is not done."""

    def done(self) -> bool:
        was = super().done()
        self.cancel()
        return was


@pytest.mark.parametrize("end", ["loaded", "unloaded"])
def test_a_waiter_cancelled_as_its_load_ends_leaves_the_others_told(disk, end):
    """The load's end resolved each waiting future after checking it was not done; a future
    cancelled in between (a client's timeout, from the event loop's thread) raised
    InvalidStateError in the load worker: the other waiters were never told (a second session
    start hung to its timeout), and the engine was not woken for the requests queued on it.
    The same in unload's drop of a pending adapter."""
    cache = make_cache(disk, slots=1)
    woken = []
    cache.wake = lambda: woken.append(1)
    if end == "loaded":
        gate = threading.Event()
        real = cache.loader.copy_to_slot
        cache.loader.copy_to_slot = lambda *a: gate.wait(10) and real(*a)
    else:
        cache.acquire("b")
        wait_ready(cache, "b")  # the only slot busy: a stays pending
    first = cache.prefetch("a")
    settled(cache)
    with cache._lock:
        cache.table.entries["a"].waiters.insert(0, _CancelledAfterTheCheck())
    second = cache.prefetch("a")
    if end == "loaded":
        gate.set()
        assert first.result(10) == second.result(10) == 0
        assert woken
    else:
        assert cache.unload("a") is True
        for fut in (first, second):
            with pytest.raises(AdapterLoadError, match="unloaded"):
                fut.result(1)
    check_invariants(cache)


def test_unloading_an_idle_adapter_starts_a_load_waiting_for_its_slot(disk):
    """Two slots: a pinned and idle, b held by a long request, a request for c waiting for a
    slot. unload_lora_adapter a freed its slot but started nothing: c's request waited until
    some other event (b's request ending) ran the pending loads, and the engine's starvation
    check stands aside while a slot is free."""
    cache = make_cache(disk, slots=2)
    cache.pin("a").result(10)
    cache.acquire("b")
    wait_ready(cache, "b")
    assert cache.acquire("c") == -1
    settled(cache)
    time.sleep(0.05)
    assert [r["state"] for r in cache.describe() if r["name"] == "c"] == ["pending"]
    slot_a = cache.table.entries["a"].slot
    assert cache.unload("a") is True
    assert wait_ready(cache, "c", timeout=5) == slot_a
    check_invariants(cache)


def test_two_loads_of_one_name_at_once_register_it_once(disk, tmp_path_factory):
    """Two load_lora_adapter calls for one name (two paths) at once: load checked the name
    under the lock, let go of it, then registered: both calls passed the check, both answered
    success, and the second's path silently replaced the first's. One must be refused."""
    other = write_adapter(tmp_path_factory.mktemp("other") / "z", seed=7)
    cache = make_cache(disk, slots=2)
    both_in = threading.Barrier(2, timeout=1)
    real = cache.register

    def register(*a, **kw):
        try:
            both_in.wait()  # the other call is past its check too (never, when the check holds the lock)
        except threading.BrokenBarrierError:
            pass
        return real(*a, **kw)

    cache.register = register
    outcomes = {}

    def load(path):
        try:
            outcomes[path] = cache.load("zed", path, timeout=10)
        except Exception as e:  # noqa: BLE001
            outcomes[path] = e

    threads = [threading.Thread(target=load, args=(p,)) for p in (disk / "a", other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    refused = [p for p, o in outcomes.items() if isinstance(o, Exception)]
    assert len(refused) == 1 and "already loaded" in str(outcomes[refused[0]])
    (served,) = set(outcomes) - set(refused)
    assert cache.table.entries["zed"].path == served
    check_invariants(cache)


def test_a_plan_applied_as_an_old_pin_is_unloaded_still_pins_its_set(disk):
    """apply_plan lists the plan's old pins, then unpins those that left it; an unload_lora_adapter
    in between made unpin raise KeyError out of apply_plan, before the new pins were made, and
    the plan watcher does not apply a plan it has seen again: the new pinned set stayed unpinned
    until the next plan."""
    cache = make_cache(disk, slots=3)
    cache.apply_plan({"pinned": ["a"], "adapters": [], "prefetch": []})
    wait_ready(cache, "a")
    real = cache.unpin

    def unpin(name, **kw):
        cache.unpin = real
        cache.unload(name)  # the admin's unload, just after apply_plan listed the old pins
        return real(name, **kw)

    cache.unpin = unpin
    cache.apply_plan({"pinned": ["b"], "adapters": [], "prefetch": []})
    wait_ready(cache, "b")
    assert {r["name"] for r in cache.describe() if r["pinned"]} == {"b"}
    check_invariants(cache)


@pytest.mark.parametrize("policy", ["lru", "lfu-aged", "wtinylfu"])
def test_a_session_start_on_a_resident_adapter_keeps_it_for_the_first_request(disk, policy):
    """A session start prefetches its adapter so that the first request hits. Resident already
    (and the policy's next victim), the prefetch answered at once without telling the policy,
    which evicts on the next miss what the session is about to use; a load for a prefetch
    tells it (record_insert(prefetch=True)), so a resident one must be told too."""
    cache = make_cache(disk, slots=3, policy=policy)
    use(cache, "a")
    use(cache, "d")
    for _ in range(3):
        use(cache, "b")  # b: recent and frequent
    assert cache.table.policy.select_victim({"a", "b", "d"}) == "a"
    slot_a = cache.prefetch("a").result(5)  # the session starts: a is resident
    use(cache, "c")  # another tenant's miss takes a slot
    assert cache.ready_slots().get("a") == slot_a  # d went, not the session's adapter
    assert set(cache.ready_slots()) == {"a", "b", "c"}
    check_invariants(cache)


def test_a_load_whose_read_fails_registers_nothing_and_can_be_made_again(tmp_path, monkeypatch):
    """load_lora_adapter whose load fails after the adapter checked out (the files unreadable,
    out of memory) leaves no name behind, as in vLLM: the same call made again loads it, where
    it used to answer "already loaded" until an unload."""
    import loraplex.server.adapter_loader as loader

    src = write_adapter(tmp_path / "src" / "x", seed=3)
    cache = make_cache(tmp_path / "cache", slots=2)

    def broken(*a, **kw):
        raise OSError("disk gone")

    monkeypatch.setattr(loader, "read_into_host", broken)
    with pytest.raises(AdapterError, match="disk gone"):
        cache.load("x", src)
    assert not cache.has("x") and "x" not in {r["name"] for r in cache.describe()}
    assert cache.take_failures() == {}  # no request of it waits to be failed
    monkeypatch.setattr(loader, "read_into_host", read_into_host)
    assert cache.load("x", src) in (0, 1)
    check_invariants(cache)


def test_a_pin_whose_load_failed_is_loaded_again_on_its_own(disk, monkeypatch):
    """A pinned adapter (a plan's, say) whose load fails (the node agent down for a moment) is
    loaded again after a back-off, with no request for it; it used to stay cold until a
    request or a new plan came. An unpinned one waits for its next request, as before."""
    import loraplex.server.adapter_cache as cache_module
    import loraplex.server.adapter_loader as loader

    monkeypatch.setattr(cache_module, "PIN_RETRY_FIRST_S", 0.05)
    cache = make_cache(disk, slots=3)
    calls = {"a": 0, "b": 0}

    def flaky(path, *a, **kw):
        name = Path(path).name
        calls[name] = calls.get(name, 0) + 1
        if calls[name] <= 2:  # the first two reads fail: the retry backs off once, then loads
            raise OSError("node agent unreachable")
        return read_into_host(path, *a, **kw)

    monkeypatch.setattr(loader, "read_into_host", flaky)
    with pytest.raises(AdapterLoadError):
        cache.pin("a").result(10)
    with pytest.raises(AdapterLoadError):
        cache.prefetch("b").result(10)
    wait_ready(cache, "a")
    assert calls["a"] == 3 and {r["name"]: r["error"] for r in cache.describe()}["a"] is None
    time.sleep(0.3)
    assert calls["b"] == 1 and "b" not in cache.ready_slots()  # not pinned: no retry of its own
    check_invariants(cache)


def test_a_version_registered_during_a_load_keeps_the_old_copy_out_of_the_host_tier(disk, monkeypatch):
    """The plan registers a new sha256 for an adapter while its load reads the old files: the
    slot gets what was read, and gives it up as soon as nothing holds it (a slot of a replaced
    version is reloaded: test_cache_rollout.py), but the host tier must not keep that copy, or
    every later load would serve the old version from it."""
    import loraplex.server.adapter_loader as loader

    cache = make_cache(disk, slots=2)
    cache.register("a", sha256="1" * 64)
    reading, go = threading.Event(), threading.Event()

    def slow(path, *a, **kw):
        reading.set()
        assert go.wait(10)
        return read_into_host(path, *a, **kw)

    monkeypatch.setattr(loader, "read_into_host", slow)
    fut = cache.prefetch("a")
    assert reading.wait(10)
    cache.register("a", sha256="2" * 64)  # the node agent stages version 2 meanwhile
    go.set()
    assert fut.result(10) in (0, 1)
    assert "a" not in cache.host  # the next load reads the files again, not this copy
    monkeypatch.setattr(loader, "read_into_host", read_into_host)
    assert "a" not in cache.ready_slots()  # held by nothing: its slot of version 1 is given up
    assert cache.prefetch("b").result(10) in (0, 1) and cache.prefetch("a").result(10) in (0, 1)
    assert "a" in cache.host  # read at version 2: kept
    check_invariants(cache)


def test_a_pending_load_whose_requests_all_left_is_called_off(disk):
    """One slot, held by a running request for "a"; a request for "b" queues its load, then is
    aborted. When "a" is released, "b" must not load (evicting "a" for nobody); it used to."""
    cache = make_cache(disk, slots=1)
    assert use(cache, "a") == 0  # loaded, and held again
    assert cache.acquire("a") == 0
    assert cache.acquire("b") == -1  # pending: the only slot is in use
    cache.release("b")  # its request is aborted before the load could start
    cache.release("a")
    time.sleep(0.2)
    assert cache.ready_slots() == {"a": 0} and cache.in_flight == 0
    assert {r["name"]: r["state"] for r in cache.describe()}["b"] == "idle"
    assert cache.acquire("b") == -1  # a new request for it queues the load again
    cache.release("b")
    check_invariants(cache)


def test_a_pending_load_unpinned_then_left_by_its_requests_is_called_off(disk):
    """As above, with a pin in between: "b" pinned (its load waits, the only slot in use), a
    request for it, the pin taken off (the request still wants it), the request aborted. The
    pin's own wait, which wants nothing once unpinned, was taken for a prefetch waiting, so
    the load ran when "a" was released, evicting "a" for nobody."""
    cache = make_cache(disk, slots=1)
    assert use(cache, "a") == 0
    assert cache.acquire("a") == 0
    pin = cache.pin("b")
    assert cache.acquire("b") == -1  # pending: the only slot is in use
    assert cache.unpin("b") is False
    cache.release("b")  # its request is aborted before the load could start
    cache.release("a")
    time.sleep(0.2)
    assert cache.ready_slots() == {"a": 0} and cache.in_flight == 0
    assert {r["name"]: r["state"] for r in cache.describe()}["b"] == "idle"
    assert pin.cancelled()
    check_invariants(cache)


def test_a_server_start_removes_what_a_crash_of_its_fetches_left(tmp_path):
    """Without a node agent the server downloads into its cache dir itself; a folder a killed
    fetch left there (idle past ABANDONED_FETCH_SECONDS) is removed when a cache starts on it,
    and adapters staged there stay. With a node agent the folder is the agent's, left alone."""
    from loraplex.server.adapter_sources import ABANDONED_FETCH_SECONDS

    write_adapter(tmp_path / "a", seed=1)
    old = time.time() - ABANDONED_FETCH_SECONDS - 5
    for name in (".b.abcdefgh", ".c.12345678"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        for p in (tmp_path / name / "adapter_model.safetensors", tmp_path / name):
            os.utime(p, (old, old))
    AdapterCache(LoRABuffers(CFG, 2, RANK, torch.device("cpu"), torch.float32), base_spec(), cache_dir=tmp_path,
                 node_agent_url="http://127.0.0.1:9").close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".b.abcdefgh", ".c.12345678", "a"]
    cache = make_cache(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert cache.prefetch("a").result(10) >= 0
    cache.close()
