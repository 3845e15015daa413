"""read_into_host on real safetensors files: what lands in a HostCopy, element by element.

Rules under test: a HostCopy starts as garbage (torch.empty; on CUDA a recycled pinned block)
and `fill` writes every element the kernels read: every real element equals the file's
tensor, and where a layer's module has a lower rank than its projection's rank in the slot
(or is not targeted in that layer), the rank rows and columns up to that rank are exactly
zero. What lies past a projection's rank stays garbage, and add_lora on the slot (torch and
Triton paths) gives the same term as a clean write: it is never read. A file read as many
chunks on a thread pool lands byte for byte as a read in one go, converted tensors through
a staging buffer kept per thread; a file cut short (before or during the read) raises
AdapterError once no read is left running, and a load of it leaves nothing behind.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.kernels import LoRABatch, add_lora
from loraplex.server import disk_read, host_tier
from loraplex.server.adapter_cache import AdapterCache
from loraplex.server.adapter_format import WEIGHTS_FILE, AdapterError, BaseSpec, read_adapter, write_adapter_config
from loraplex.server.adapter_sources import AdapterLoadError
from loraplex.server.adapters import GROUPS, PROJECTIONS, LoRABuffers, projection_ranks, random_adapter
from loraplex.server.config import named_shape
from loraplex.server.disk_read import plan_reads
from loraplex.server.host_tier import host_copy_from_tensors, read_into_host

# Sizes that are not multiples of ALIGN_ELEMS, so the layout has gaps between views.
ODD = dataclasses.replace(named_shape("tiny"), hidden_size=40, intermediate_size=72, head_dim=10)
R_MAX = 6


def write_mixed_adapter(path: Path, cfg=ODD, seed: int = 0, metadata: dict | None = None) -> Path:
    """q_proj at rank 3 in layer 0 and 6 in layer 1, down_proj at rank 3, v_proj at rank 6
    (rank_pattern); k, o, gate, up not targeted. `seed` changes the values, `metadata` (the
    safetensors header's) the data's offsets in the file."""
    _, low = random_adapter(cfg, 3, targets=("q_proj", "down_proj"), seed=1 + 2 * seed)
    _, full = random_adapter(cfg, R_MAX, targets=("q_proj", "v_proj"), seed=2 + 2 * seed)
    layer1_q = ".layers.1.self_attn.q_proj."
    tensors = {k: v for k, v in low.items() if layer1_q not in k}
    tensors |= {k: v for k, v in full.items() if "v_proj" in k or layer1_q in k}
    path.mkdir(parents=True, exist_ok=True)
    write_adapter_config(path, r=3, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"],
                         rank_pattern={"v_proj": R_MAX, "layers.1.self_attn.q_proj": R_MAX})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / WEIGHTS_FILE), metadata=metadata)
    return path


def base_spec(cfg=ODD) -> BaseSpec:
    return BaseSpec(num_layers=cfg.num_layers, module_shapes=cfg.module_shapes(), max_rank=R_MAX)


def poison_allocations(monkeypatch) -> None:
    """torch.empty hands back garbage from here on, as a recycled pinned block does."""
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", empty)


def read_region(buffers: LoRABuffers, spec) -> torch.Tensor:
    return buffers.layout.read_mask(projection_ranks(spec))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: the f32 file is converted
@pytest.mark.parametrize("source", ["file", "memory"])
def test_a_poisoned_allocation_is_filled_where_the_kernels_read(tmp_path, monkeypatch, dtype, source):
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    tensors = load_file(str(path / WEIGHTS_FILE))
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), dtype)
    assert {(m.layer, m.proj, m.rank) for m in spec.modules if m.proj == "q_proj"} == {
        (0, "q_proj", 3), (1, "q_proj", R_MAX)}
    poison_allocations(monkeypatch)
    if source == "file":
        host = read_into_host(path, spec, buffers, pin=False)
    else:
        host = host_copy_from_tensors(spec, tensors, buffers, pin=False)
    monkeypatch.undo()

    read = read_region(buffers, spec)
    assert torch.isfinite(host.flat[read]).all(), "an element the kernels read was left as garbage"
    assert torch.isnan(host.flat[~read]).any(), "the test's poison did not reach the unread elements"
    for layer, groups in enumerate(host.layers):
        for name, projs in GROUPS.items():
            g, off = groups[name], 0
            for i, (proj, width) in enumerate(zip(projs, g.slices)):
                m = spec.module(layer, proj)
                r = m.rank if m is not None else 0
                r_read = int(host.rank[PROJECTIONS.index(proj)])
                assert not g.a[i * R_MAX + r: i * R_MAX + r_read].any(), (layer, proj)  # zeros, read
                assert not g.b[off: off + width, r:r_read].any(), (layer, proj)
                if m is None:
                    assert g.scaling[i] == 0, (layer, proj)
                else:
                    assert torch.equal(g.a[i * R_MAX: i * R_MAX + r], tensors[m.key_a].to(dtype)), m.key_a
                    assert torch.equal(g.b[off: off + width, :r], tensors[m.key_b].to(dtype)), m.key_b
                    assert g.scaling[i] == pytest.approx(m.scaling), (layer, proj)
                off += width
    assert host.rank.tolist() == [R_MAX, 0, R_MAX, 0, 0, 0, 3]  # per projection: q (6 in layer 1), v, down

    # Loaded into a slot, the garbage past each projection's rank changes nothing: the term
    # equals a clean write's, on both paths of add_lora.
    clean = LoRABuffers(ODD, 2, R_MAX, torch.device("cpu"), dtype)
    clean.write(1, spec, tensors)
    loaded = LoRABuffers(ODD, 2, R_MAX, torch.device("cpu"), dtype)
    loaded.flat.fill_(float("nan"))
    host.copy_to(loaded, 1)
    # The Triton path on these CPU tensors runs in the interpreter (whose bf16 dot is wrong:
    # the torch path checks bf16); a run with the interpreter off (a GPU machine's) checks torch.
    if dtype == torch.bfloat16 or os.environ.get("TRITON_INTERPRET") != "1":
        backends = ("torch",)
    else:
        backends = ("torch", "triton")
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([1, -1, 1, 1], dtype=torch.int32)
    batch = LoRABatch.build(slots, 2)
    for layer in range(ODD.num_layers):
        for name in GROUPS:
            want_g, got_g = clean.layers[layer][name], loaded.layers[layer][name]
            x = torch.randn(4, want_g.a.shape[2], generator=gen).to(dtype)
            y0 = torch.randn(4, want_g.b.shape[1], generator=gen).to(dtype)
            for backend in backends:
                want, got = y0.clone(), y0.clone()
                add_lora(want, x, want_g.a, want_g.b, want_g.scaling, batch, ranks=clean.group_ranks[name],
                         backend=backend, output_slices=want_g.slices)
                add_lora(got, x, got_g.a, got_g.b, got_g.scaling, batch, ranks=loaded.group_ranks[name],
                         backend=backend, output_slices=got_g.slices)
                assert torch.isfinite(got).all(), (layer, name, backend)
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{layer} {name} {backend}")


@pytest.mark.parametrize("reads, chunk, iov_max, want", [
    # buffers as (file offset, bytes); chunk bytes; IOV_MAX; calls as (file offset, [bytes of each buffer])
    ([(8, 6), (14, 6), (20, 4)], 10, 1024, [(8, [2]), (10, [4, 6]), (20, [4])]),  # the docstring's example
    ([(0, 4), (4, 4), (8, 4)], 1 << 20, 1024, [(0, [4, 4, 4])]),  # one chunk: one call
    ([(0, 4), (4, 4), (8, 4)], 1 << 20, 2, [(0, [4, 4]), (8, [4])]),  # IOV_MAX buffers per call
    ([(0, 4), (6, 4)], 1 << 20, 1024, [(0, [4]), (6, [4])]),  # bytes not read between: two calls
    ([(3, 25)], 10, 1024, [(3, [7]), (10, [10]), (20, [8])]),  # one buffer over three chunks
    ([(0, 0), (0, 5)], 10, 1024, [(0, [5])]),  # an empty tensor reads nothing
])
def test_plan_reads(monkeypatch, reads, chunk, iov_max, want):
    monkeypatch.setattr(disk_read, "_IOV_MAX", iov_max)
    buffers = [(off, bytearray(n)) for off, n in reads]
    calls = plan_reads([(off, (i, 0, len(b))) for i, (off, b) in enumerate(buffers)], chunk)
    assert [(off, [n for _, _, n in spans]) for off, spans in calls] == want
    file = bytes(range(256))
    for off, spans in calls:  # what preadv does with them
        for buf, at, n in spans:
            buffers[buf][1][at: at + n] = file[off: off + n]
            off += n
    assert all(b == file[off: off + len(b)] for off, b in buffers)


class PreadvSpy:
    """os.preadv, counting the calls running now, the most at once and the threads that made them."""

    def __init__(self, monkeypatch, delay: float = 0.0, before=None, jitter: bool = False):
        self.real = os.preadv
        self.delay, self.before = delay, before
        self.jitter = random.Random(0) if jitter else None  # delays of 0-3x: reads finish out of order
        self.lock = threading.Lock()
        self.running = self.peak = self.calls = 0
        self.threads: set[str] = set()
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd, views, offset):
        with self.lock:
            self.running += 1
            self.calls += 1
            self.peak = max(self.peak, self.running)
            self.threads.add(threading.current_thread().name)
            first = self.calls == 1
        try:
            if self.before is not None and first:
                self.before()
            time.sleep(self.delay * (3 * self.jitter.random() if self.jitter else 1))
            return self.real(fd, views, offset)
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="test-read") as p:
        yield p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # float16: every tensor through a temporary
def test_a_read_in_many_chunks_on_threads_is_byte_identical(tmp_path, monkeypatch, pool, dtype):
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), dtype)
    whole = read_into_host(path, spec, buffers, pin=False)  # one thread, chunks larger than the file
    spy = PreadvSpy(monkeypatch, delay=0.002)
    poison_allocations(monkeypatch)
    chunk = 512
    host = read_into_host(path, spec, buffers, pin=False, pool=pool, chunk_bytes=chunk)
    data_bytes = (path / WEIGHTS_FILE).stat().st_size
    assert spy.calls >= data_bytes // chunk - 1 and spy.peak > 1 and len(spy.threads) > 1
    assert all(name.startswith("test-read") for name in spy.threads)
    read = read_region(buffers, spec)  # elsewhere each copy keeps its allocation's garbage
    assert torch.equal(host.flat[read].view(torch.uint8), whole.flat[read].view(torch.uint8))
    assert torch.equal(host.scales, whole.scales) and torch.equal(host.rank, whole.rank)
    tensors = load_file(str(path / WEIGHTS_FILE))
    for layer, groups in enumerate(host.layers):
        g, m = groups["qkv"], spec.module(layer, "v_proj")  # v_proj: at the max rank, read in place
        assert torch.equal(g.a[2 * R_MAX: 3 * R_MAX], tensors[m.key_a].to(dtype))


def times_open(path: Path) -> int:
    """File descriptors of this process open on `path` (other tests' threads may open and
    close other files meanwhile, so a count of all descriptors would be flaky)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:  # closed since the listing
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_file_cut_short_raises_once_no_read_is_left(tmp_path, monkeypatch, pool, when):
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())  # the header still checked out
    weights = path / WEIGHTS_FILE
    cut = lambda: os.truncate(weights, weights.stat().st_size // 2)  # noqa: E731
    if when == "before":
        cut()
    list(pool.map(len, "abcd"))  # the pool's threads started: they hold no file open
    spy = PreadvSpy(monkeypatch, delay=0.005, before=cut if when == "during" else None)
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.float32)
    with pytest.raises(AdapterError, match="cut short"):
        read_into_host(path, spec, buffers, pin=False, pool=pool, chunk_bytes=512)
    assert spy.running == 0 and times_open(weights) == 0
    assert (when == "before") == (spy.calls == 0)  # before: the header's offsets are checked first


def test_a_load_of_a_file_cut_during_the_read_leaves_nothing_behind(tmp_path, monkeypatch):
    write_mixed_adapter(tmp_path / "a")
    write_mixed_adapter(tmp_path / "b")
    buffers = LoRABuffers(ODD, 2, R_MAX, torch.device("cpu"), torch.float32)
    cache = AdapterCache(buffers, base_spec(), cache_dir=tmp_path)
    monkeypatch.setattr(disk_read, "READ_CHUNK_BYTES", 512)
    weights = tmp_path / "a" / WEIGHTS_FILE
    spy = PreadvSpy(monkeypatch, delay=0.002, before=lambda: os.truncate(weights, weights.stat().st_size // 2))
    with pytest.raises(AdapterLoadError, match="cut short") as err:
        cache.prefetch("a").result(10)
    assert err.value.reason == "corrupt" and spy.calls > 1 and spy.running == 0
    assert cache.host.names() == [] and cache.num_free == 2 and "a" not in cache.ready_slots()
    spy.before = None
    assert cache.prefetch("b").result(10) in (0, 1)  # the next load reads as usual
    cache.close()


def test_converted_tensors_go_through_one_staging_buffer_kept_per_thread(tmp_path, monkeypatch, pool):
    """Tensors read through a conversion (here f32 -> f16, and B below the max rank) land in
    the calling thread's staging buffer, kept for its next load up to STAGING_KEEP_BYTES, and
    come out right either way."""
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    tensors = load_file(str(path / WEIGHTS_FILE))
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.float16)
    monkeypatch.setattr(disk_read, "_staging", threading.local())
    first = read_into_host(path, spec, buffers, pin=False, pool=pool)
    kept = disk_read._staging.buf
    assert kept.numel() >= sum(t.numel() * t.element_size() for t in tensors.values())
    second = read_into_host(path, spec, buffers, pool=pool, pin=False)
    assert disk_read._staging.buf is kept
    read = read_region(buffers, spec)
    assert torch.equal(first.flat[read], second.flat[read])
    m = spec.module(1, "q_proj")
    assert torch.equal(second.layers[1]["qkv"].a[: m.rank], tensors[m.key_a].to(torch.float16))

    monkeypatch.setattr(disk_read, "_staging", threading.local())
    monkeypatch.setattr(disk_read, "STAGING_KEEP_BYTES", 1024)  # smaller than this adapter's
    third = read_into_host(path, spec, buffers, pin=False, pool=pool)
    assert getattr(disk_read._staging, "buf", None) is None
    assert torch.equal(third.flat[read], first.flat[read])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_staged_copy_in_the_slots_dtype_is_read_in_place_of_the_f32_file(tmp_path, dtype):
    """The node agent's copy of an F32 adapter in the slots' dtype (node_agent.convert): a
    load reads it, not the original, and the host copy holds the same bits either way."""
    from loraplex.node_agent.convert import write_serving_copy

    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), dtype)
    converted_on_read = read_into_host(path, spec, buffers, pin=False)
    name = str(dtype).removeprefix("torch.")
    assert write_serving_copy(path, name) is not None
    # The original's data zeroed, its header kept (read_adapter reads it): a load that read
    # the original now would load zeros.
    weights = path / WEIGHTS_FILE
    raw = bytearray(weights.read_bytes())
    head = 8 + int.from_bytes(raw[:8], "little")
    raw[head:] = bytes(len(raw) - head)
    weights.write_bytes(bytes(raw))
    from_copy = read_into_host(path, read_adapter(path, base_spec()), buffers, pin=False)
    read = read_region(buffers, spec)  # the rest of a host copy is never written
    assert from_copy.flat[read].abs().sum() > 0
    assert torch.equal(from_copy.flat[read], converted_on_read.flat[read])
    # A server of another dtype still reads the original.
    f32 = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.float32)
    assert read_into_host(path, spec, f32, pin=False).flat[read].abs().sum() == 0


def test_a_staged_copy_whose_shapes_are_not_the_originals_is_refused_not_broadcast(tmp_path):
    """read_adapter checks the original's shapes; the tensors are read from the node agent's
    copy in the slots' dtype. One whose header gives other shapes (a rank-1 copy left beside a
    retrained rank-3 original, or a lying header: its sizes add up) was read through the
    converting path, whose copy_ broadcasts: lora_A [1, in] filled every rank row of [3, in]
    with its one row, and the slot served weights that are in neither file."""
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    one = {}
    for key, t in load_file(str(path / WEIGHTS_FILE)).items():  # every tensor at rank 1
        one[key] = (t[:1] if ".lora_A." in key else t[:, :1]).to(torch.bfloat16).contiguous()
    save_file(one, str(path / "adapter_model.bfloat16.safetensors"))
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.bfloat16)
    with pytest.raises(AdapterError, match="shape"):
        read_into_host(path, spec, buffers, pin=False)


@pytest.mark.parametrize("threads", [0, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # float16: every tensor converted
def test_ranges_handed_on_tile_the_copy_and_are_final_when_handed_on(tmp_path, monkeypatch, threads, dtype):
    """A disk load copies each range of the host copy to its slot as soon as on_region hands
    it on, while later chunks of the file are read: the ranges must tile the host copy (every
    byte once), and every byte the kernels read in one must already be what it ends up as
    (converted tensors included). Chunks of 128 bytes, on threads whose reads finish out of
    order."""
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), dtype)
    whole = read_into_host(path, spec, buffers, pin=False)
    if threads:
        PreadvSpy(monkeypatch, delay=0.001, jitter=True)
    poison_allocations(monkeypatch)
    seen = []  # (start, end, the range's bytes when handed on)

    def on_region(copy, start, end):
        seen.append((start, end, copy.flat.view(torch.uint8)[start:end].clone()))

    with concurrent.futures.ThreadPoolExecutor(threads or 1) as pool:
        host = read_into_host(path, spec, buffers, pin=False, pool=pool if threads else None, chunk_bytes=128,
                              on_region=on_region)
    monkeypatch.undo()
    assert len(seen) > 4
    covered = torch.zeros(host.nbytes, dtype=torch.int32)
    for start, end, _ in seen:
        covered[start:end] += 1
    assert bool((covered == 1).all()), "the ranges must tile the host copy"
    read = read_region(buffers, spec).view(1, -1).expand(host.flat.element_size(), -1).t().reshape(-1)
    final = host.flat.view(torch.uint8)
    assert torch.equal(final[read], whole.flat.view(torch.uint8)[read])
    for start, end, snapshot in seen:
        mask = read[start:end]
        assert torch.equal(snapshot[mask], final[start:end][mask]), f"range [{start}, {end}) handed on unfinished"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # float16: every tensor converted
def test_a_plan_run_again_into_a_new_copy_reads_the_same_bytes(tmp_path, monkeypatch, pool, dtype):
    """A reload runs the plan of the first read (the loader keeps it): into a fresh (poisoned)
    copy, with no header read, no views and no planning, it writes what the first read did,
    zeros and scales included."""
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), dtype)
    first = read_into_host(path, spec, buffers, pin=False, pool=pool, chunk_bytes=256)
    assert first.read_plan is not None and len(first.read_plan.chunks) > 2
    monkeypatch.setattr(host_tier, "plan_read", None)  # a reload must not plan
    poison_allocations(monkeypatch)
    again = read_into_host(path, spec, buffers, pin=False, pool=pool, plan=first.read_plan)
    monkeypatch.undo()
    read = read_region(buffers, spec)
    assert torch.equal(again.flat[read], first.flat[read]) and bool(torch.isfinite(again.flat[read]).all())
    assert torch.equal(again.scales, first.scales) and torch.equal(again.rank, first.rank)
    assert again.read_plan is first.read_plan


def test_a_plan_for_a_file_since_replaced_reads_nothing(tmp_path):
    """The node agent renames a new version over an adapter's file: a kept plan must not read
    the new file with the old offsets. It refuses before reading (StalePlan), and a read
    without a plan takes the new file whole."""
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.float32)
    first = read_into_host(path, spec, buffers, pin=False)
    other = write_mixed_adapter(tmp_path / "b", seed=1, metadata={"pad": "x" * 100})  # other values and offsets
    (tmp_path / "a.tmp").write_bytes((other / WEIGHTS_FILE).read_bytes())
    os.replace(tmp_path / "a.tmp", path / WEIGHTS_FILE)
    with pytest.raises(disk_read.StalePlan):
        read_into_host(path, spec, buffers, pin=False, plan=first.read_plan)
    fresh = read_into_host(path, spec, buffers, pin=False)
    assert fresh.read_plan.file_id != first.read_plan.file_id
    read = read_region(buffers, spec)
    want = read_into_host(other, spec, buffers, pin=False)
    assert torch.equal(fresh.flat[read], want.flat[read]) and not torch.equal(fresh.flat[read], first.flat[read])


def test_a_file_replaced_between_planning_and_reading_is_planned_again(tmp_path, monkeypatch):
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.float32)
    want = read_into_host(write_mixed_adapter(tmp_path / "b", seed=1, metadata={"pad": "x" * 100}), spec, buffers,
                          pin=False)
    real, plans = host_tier.plan_read, []

    def plan_then_replace(weights, targets, chunk_bytes=None, header=None):
        plans.append(real(weights, targets, chunk_bytes, header))
        if len(plans) == 1:  # the race: a new version lands after the header was read
            (tmp_path / "a.tmp").write_bytes((tmp_path / "b" / WEIGHTS_FILE).read_bytes())
            os.replace(tmp_path / "a.tmp", weights)
        return plans[-1]

    monkeypatch.setattr(host_tier, "plan_read", plan_then_replace)
    got = read_into_host(path, spec, buffers, pin=False)
    assert len(plans) == 2 and got.read_plan is plans[1]
    read = read_region(buffers, spec)
    assert torch.equal(got.flat[read], want.flat[read])  # the first plan's offsets would have read shifted bytes


def test_a_fleets_next_adapter_is_read_with_the_plan_of_the_first(tmp_path, monkeypatch, pool):
    """Adapters of one fleet share their header byte for byte: the first read of the second
    runs the first's plan (PlanCache), made for its own file, and lands its own values; an
    adapter of another header is planned anew."""
    a = write_mixed_adapter(tmp_path / "a")
    b = write_mixed_adapter(tmp_path / "b", seed=1)  # the same header, other values
    c = write_mixed_adapter(tmp_path / "c", seed=2, metadata={"pad": "x" * 64})  # another header
    spec = read_adapter(a, base_spec())
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.float16)  # f16: conversions planned too
    plans = disk_read.PlanCache()
    real, planned = host_tier.plan_read, []
    monkeypatch.setattr(host_tier, "plan_read", lambda *args: planned.append(args[0]) or real(*args))
    copies = {p.name: read_into_host(p, spec, buffers, pin=False, pool=pool, plans=plans) for p in (a, b, c)}
    assert [w.parent.name for w in planned] == ["a", "c"]
    assert copies["b"].read_plan.weights == b / WEIGHTS_FILE and copies["b"].read_plan.chunks == copies["a"].read_plan.chunks
    read = read_region(buffers, spec)
    monkeypatch.undo()
    for p in (a, b, c):  # each its own values, as a read with no cache gives
        assert torch.equal(copies[p.name].flat[read], read_into_host(p, spec, buffers, pin=False).flat[read])
    assert not torch.equal(copies["a"].flat[read], copies["b"].flat[read])


@pytest.mark.parametrize("head", [b"\xff" * 8, (1 << 40).to_bytes(8, "little"), b"\x03\x00"])
def test_a_weights_file_with_an_absurd_header_length_is_refused_before_any_allocation(tmp_path, head):
    """The served weights file (the node agent's copy, which read_adapter does not parse) with
    a header length past its size, or too short to hold one: an AdapterError, not a read of
    2**40 bytes."""
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    (path / WEIGHTS_FILE).write_bytes(head + b"{}" * 8)
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), torch.float32)
    with pytest.raises(AdapterError, match="no safetensors header of a sane size"):
        read_into_host(path, spec, buffers, pin=False)


def test_a_version_switched_in_and_back_stamps_anew(tmp_path):
    """The node agent switches an adapter's name to a new version by renaming a new symlink
    over it. A load that read the config of A, then (after A -> B -> A) the weights of A again,
    could have read B's weights in between: the stamp after such a read must differ from the
    one before, though the name points at the same files again."""
    from loraplex.server.disk_read import files_stamp

    for v in ("v0", "v1"):
        write_mixed_adapter(tmp_path / v, seed=int(v[1]))

    def switch(to: str) -> None:
        (tmp_path / ".link").symlink_to(to)
        os.replace(tmp_path / ".link", tmp_path / "a")

    switch("v0")
    name = tmp_path / "a"
    before = files_stamp(name, name / WEIGHTS_FILE)
    assert files_stamp(name, name / WEIGHTS_FILE) == before  # nothing changed: the same stamp
    switch("v1")
    assert files_stamp(name, name / WEIGHTS_FILE) != before
    switch("v0")
    assert files_stamp(name, name / WEIGHTS_FILE) != before  # A -> B -> A is seen
