"""Cold-load benchmark of the adapter cache: how long a miss takes, and what loads cost decode.

    python3 bench/cold_load_bench.py --out $OUT/cold_load.json                        # one GPU, Llama-3-8B shape
    python3 bench/cold_load_bench.py --shape tiny --quick --device cpu --out /tmp/c.json   # CPU smoke test

On an engine with dummy weights of `--shape` (bf16 on CUDA) and one PEFT adapter of
`--rank` (16) on all seven projections (`--targets`: a subset, which the server's slots then
hold alone, as `--lora-target-modules` makes them; `--max-lora-rank`: slots of a higher rank
than the adapter's) written to a temporary folder (the disk tier; `--file-dtype`: saved in
another dtype than the slots', as PEFT often saves float32):

- host-to-device bandwidth: a pinned host buffer of one slot's bytes copied to the device
  (median of 10), and the floor of a cold load: slot bytes / that bandwidth;
- cold load from host memory (the adapter's pinned copy, evicted from its slot) and from
  local disk (no host copy; page cache warm, then dropped with posix_fadvise), each the
  median of `--repeats` loads timed from the prefetch call until the adapter is resident,
  against the floor (targets: host within 2x; disk with the page cache warm within 2x);
  disk loads also against their own floor, file bytes / measured read bandwidth (page
  cache dropped) + the host-to-device floor. A reload from disk runs what the loader kept
  from the first read (spec, read plan); `disk_page_cache_warm_first` times loads with
  that forgotten, as a first read of the file is (what the server keeps of headers it saw
  stays: the next adapter of a fleet), `disk_page_cache_warm_first_new_header` with that
  forgotten too; after the timed loads, the slot's bytes are checked against a fresh read
  (`disk_load_bytes_match`);
- where the time goes: a host load's bare H2D and copy into its slot; a disk load's (page
  cache warm) stages one by one: parsing and checking the files, allocating the pinned
  HostCopy, zeroing its padding (`fill`), reading the file into it on the loader's read
  threads, the copy into the slot; the loader's own path on the calling thread (the read
  streamed into the slot); a timed load cut into dispatch, the worker's run and completion;
- decode step time, p50 and p99, of a `--batch`-row batch over 8 resident adapters, in
  alternating chunks with no load running and with `--loads` loads in flight (a storm of
  cold adapters paging from host memory through the spare slots), on the same requests
  after an untimed pass that captures every CUDA graph (target: p99 within 1.1x); with
  `--slot-copy-chunk-mb`, also with loads whose slot copy goes in chunks of those sizes,
  each its own phase of the same alternation.

Writes one JSON document and prints a table on stderr. Under 3 minutes on one H200.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import platform
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from checkout import engine_parser, use_checkout  # bench/ is sys.path[0]

use_checkout()

from loraplex.server import adapter_format  # noqa: E402
from loraplex.server.adapter_format import WEIGHTS_FILE, read_adapter, write_adapter_config  # noqa: E402
from loraplex.server.adapters import AdapterId, LoRABuffers, random_adapter, slot_groups  # noqa: E402
from loraplex.server.config import named_shape  # noqa: E402
from loraplex.server.engine import LLMEngine  # noqa: E402
from loraplex.server import host_tier  # noqa: E402
from loraplex.server.host_tier import HostCopy  # noqa: E402

try:  # the read's own module since the read plans; a tree before them (--prev runs) has it in host_tier
    from loraplex.server.disk_read import READ_CHUNK_BYTES, read_tensors  # noqa: E402
except ImportError:
    from loraplex.server.host_tier import READ_CHUNK_BYTES, read_tensors  # noqa: E402
from loraplex.server.sampling import SamplingParams  # noqa: E402
from loraplex.server.settings import ServerSettings  # noqa: E402

log = logging.getLogger("cold_load_bench")

TARGETS = {"host_load_vs_floor": 2.0, "decode_p99_with_loads": 1.1, "disk_warm_load_vs_floor": 2.0}
TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BATCH_ADAPTERS = 8


def parse_args(argv=None) -> argparse.Namespace:
    p = engine_parser(__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9, help="cold loads timed per tier (default 9)")
    p.add_argument("--batch", type=int, default=64, help="decode batch rows (default 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--loads", type=int, default=4, help="loads in flight during the storm (default 4)")
    p.add_argument("--chunk", type=int, default=25, help="decode steps per chunk (default 25)")
    p.add_argument("--pairs", type=int, default=8,
                   help="rounds of (no loads, loads[, loads at each --slot-copy-chunk-mb]) chunks (default 8)")
    p.add_argument("--kv-block", type=int, default=64, help="KV length granularity of eager decode (default 64)")
    p.add_argument("--slot-copy-chunk-mb", default="",
                   help="also time decode under loads with these chunk sizes of the slot copy (MB, 0: one "
                        "transfer), in the same alternation: e.g. 0,4 (default: the server's alone)")
    p.add_argument("--read-sweep", action="store_true",
                   help="also time the disk read over read threads and chunk sizes, against a memcpy")
    p.add_argument("--max-lora-rank", type=int, default=0,
                   help="the slots' max rank, above the adapter's --rank for a mixed-rank fleet (default: --rank)")
    p.add_argument("--file-dtype", default="", choices=["", "float32", "float16", "bfloat16"],
                   help="dtype of the adapter file on disk (PEFT often saves float32; default: the slots')")
    p.add_argument("--targets", default=",".join(TARGETS_ALL),
                   help="projections the adapters target and the slots hold (default all seven)")
    p.add_argument("--profile-disk", action="store_true",
                   help="also print a profile (cProfile, the loading thread) of the loader's disk path")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up objects to the garbage collector (the server freezes them)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    a = p.parse_args(argv)
    a.targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
    a.max_lora_rank = a.max_lora_rank or a.rank
    a.slot_copy_chunks = [int(mb) << 20 for mb in a.slot_copy_chunk_mb.split(",") if mb.strip()]
    if a.quick:
        a.repeats, a.batch, a.prompt_len, a.chunk, a.pairs = 3, min(a.batch, 4), 16, 4, 2
        a.loads = min(a.loads, 2)
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of one pinned host -> device copy of `nbytes` (median of 10)."""
    pin = device.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def write_peft(path: Path, spec, tensors, rank: int, targets: tuple[str, ...] = TARGETS_ALL) -> Path:
    """adapter_config.json + adapter_model.safetensors as peft saves them (the safetensors
    layout written here: 8-byte header length, JSON header, raw little-endian data)."""
    write_adapter_config(path, r=rank, lora_alpha=rank, target_modules=list(targets))
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, blobs, off = {}, [], 0
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes()
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with (path / WEIGHTS_FILE).open("wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for raw in blobs:
            f.write(raw)
    return path


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to drop the file's cached pages (no root needed for clean pages)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def file_read_bandwidth(path: Path, repeats: int) -> float:
    """Bytes per second of reading `path` whole with its cached pages dropped (median)."""
    size = path.stat().st_size
    buf = bytearray(size)
    times = []
    for _ in range(repeats):
        drop_page_cache(path)
        t0 = time.perf_counter()
        with path.open("rb", buffering=0) as f:
            f.readinto(buf)
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times)


def time_loads(engine: LLMEngine, name: str, repeats: int, before, split: dict | None = None) -> list[float]:
    """Seconds from prefetch to resident, `repeats` times; `before()` makes it cold each time.
    `split`, when given, gets each load's time cut in three (seconds, lists): from the prefetch
    call to the load worker starting (`dispatch`), the worker's run (`run`), and from its end
    to the prefetch's future done (`complete`)."""
    cache = engine.adapters
    loader = cache.loader
    marks: list[float] = []
    real_run = loader._run

    def run(e, slot):
        marks.append(time.perf_counter())
        try:
            real_run(e, slot)
        finally:
            marks.append(time.perf_counter())

    times = []
    loader._run = run
    try:
        for _ in range(repeats):
            before()
            marks.clear()
            t0 = time.perf_counter()
            cache.prefetch(name).result(120)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            if split is not None and len(marks) == 2:
                for key, t in zip(("dispatch", "run", "complete"), (marks[0] - t0, marks[1] - marks[0], t1 - marks[1])):
                    split.setdefault(key, []).append(t)
    finally:
        del loader._run
    return times


def host_copy_breakdown(cache, name: str, repeats: int) -> dict:
    """Where a host load's time goes: the bare H2D copy of its pinned buffer, and the load's
    copy into its slot (H2D + device scatter + event wait), without the cache around it."""
    copy, slot = cache.host.get(name), cache.slot_of(name)
    staging = torch.empty_like(copy.flat, device=cache.buffers.device)
    h2d, to_slot = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        staging.copy_(copy.flat, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.loader.copy_to_slot(copy, slot)
        to_slot.append(time.perf_counter() - t0)
    del staging
    return {"flat_h2d": stats(h2d), "copy_to_slot": stats(to_slot), "flat_pinned": copy.flat.is_pinned()}


def disk_load_breakdown(cache, name: str, path: Path, repeats: int, profile: bool = False) -> dict:
    """Where a disk load's time goes, page cache warm: read_into_host's stages timed one by
    one (parse and check the files: `read_adapter`; allocate the HostCopy, pinned on CUDA;
    `fill`: zero what the adapter does not write; read the file into it on the loader's read
    threads), then the loader's copy into the slot `name` sits in (H2D on a side stream,
    waited for). Then the loader's own path on this thread, as a load worker runs it (the
    read streamed into the slot region by region, the spec reused), without the hand-off to
    a worker and back: `loader_path`."""
    loader, slot = cache.loader, cache.slot_of(name)
    times: dict[str, list[float]] = {"read_adapter": [], "alloc": [], "fill": [], "read": [], "copy_to_slot": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        spec = read_adapter(path, loader.base)
        t1 = time.perf_counter()
        copy = HostCopy(cache.buffers, loader.pin_memory, loader.cuda_lock)
        t2 = time.perf_counter()
        targets: list = []
        copy.fill(spec, lambda key, dst: targets.append((key, dst)))
        t3 = time.perf_counter()
        read_tensors(path / WEIGHTS_FILE, targets, loader.read_pool)
        t4 = time.perf_counter()
        loader.copy_to_slot(copy, slot)
        t5 = time.perf_counter()
        for stage, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times[stage].append(t)
        pinned = copy.flat.is_pinned()
        copy = targets = None  # freed before the next allocation, as a discarded host copy is
    out: dict = {stage: stats(ts) for stage, ts in times.items()}
    out["sum_of_medians_ms"] = sum(v["median_ms"] for v in out.values())
    if hasattr(HostCopy, "copy_weights"):  # the loader streams the read into the slot
        from loraplex.server.adapter_loader import SlotWriter
        e = cache._lookup(name)

        def loader_path(new_header: bool, prof=None) -> list[float]:
            times = []
            for _ in range(repeats):
                cache.host.discard(name)
                if new_header:
                    forget_reads(cache, name, headers=True)
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                writer = SlotWriter(loader, slot)
                copy, tier = loader.host_copy(e, writer)
                loader.copy_to_slot(copy, slot, writer)
                times.append(time.perf_counter() - t0)
                if prof is not None:
                    prof.disable()
                assert tier == "disk"
            return times

        out["loader_path"] = stats(loader_path(False))
        out["loader_path_new_header"] = stats(loader_path(True))
        if profile:
            import cProfile
            import io
            import pstats
            for label, new_header in (("reloads", False), ("first reads of a new header", True)):
                prof = cProfile.Profile()
                loader_path(new_header, prof)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                log.info("profile of %d disk loads (%s) on the loading thread:\n%s", repeats, label, text.getvalue())
    return out | {"read_threads": loader.read_threads, "chunk_bytes": READ_CHUNK_BYTES, "flat_pinned": pinned}


def forget_reads(cache, name: str, headers: bool) -> None:
    """As before the first load of `name`'s file from disk: nothing kept from its earlier read
    (spec, read plan). `headers`: nor anything of other files of its header (parsed headers,
    the loader's plans): the first adapter of a header the server never saw. Without it, what
    the server keeps of other files of the same header stays: a fleet's next adapter."""
    with cache._lock:
        e = cache._lookup(name)
        e.spec = None
        if hasattr(e, "disk_read"):
            e.disk_read = None
    if headers:
        if hasattr(cache.loader, "read_plans"):
            cache.loader.read_plans = type(cache.loader.read_plans)()
        for cached in ("checked_header", "_checked_header", "_header_modules"):
            if hasattr(adapter_format, cached):
                getattr(adapter_format, cached).cache_clear()


def slot_matches_a_fresh_read(cache, name: str, path: Path) -> bool:
    """Whether the slot `name` sits in holds, wherever the kernels read, what a fresh read of
    its file gives (read_into_host into unpinned memory, planned anew): the timed loads' bytes
    are checked, not only their speed."""
    slot = cache.slot_of(name)
    fresh = host_tier.read_into_host(path, read_adapter(path, cache.loader.base), cache.buffers, pin=False)
    read = cache.buffers.layout.read_mask(fresh.rank.tolist())
    got = cache.buffers.flat[slot].cpu()
    return bool(torch.equal(got[read], fresh.flat[read]) and torch.equal(cache.buffers.scales[slot].cpu(), fresh.scales))


def read_sweep(cache, path: Path, repeats: int) -> dict:
    """What reading the adapter file out of a warm page cache can cost: read_tensors into one
    pinned HostCopy with 1 to 16 read threads and 1, 4 and 16 MB chunks, against a plain copy
    of the same bytes from one host buffer into another (torch's threads), the memory floor
    of any read."""
    loader = cache.loader
    spec = read_adapter(path, loader.base)
    copy = HostCopy(cache.buffers, loader.pin_memory, loader.cuda_lock)
    targets: list = []
    copy.fill(spec, lambda key, dst: targets.append((key, dst)))
    read_tensors(path / WEIGHTS_FILE, targets)  # page cache warm
    rows = []
    for threads in (1, 2, 4, 8, 16):
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for chunk_mb in (1, 4, 16):
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    read_tensors(path / WEIGHTS_FILE, targets, pool, chunk_mb << 20)
                    times.append(time.perf_counter() - t0)
                rows.append({"threads": threads, "chunk_mb": chunk_mb, **stats(times),
                             "GBps": spec.nbytes / statistics.median(times) / 1e9})
    src = torch.empty_like(copy.flat).copy_(copy.flat)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy.flat.copy_(src)
        times.append(time.perf_counter() - t0)
    memcpy = {**stats(times), "GBps": copy.nbytes / statistics.median(times) / 1e9,
              "torch_threads": torch.get_num_threads()}
    return {"reads": rows, "memcpy": memcpy, "bytes": spec.nbytes}


def stats(times: list[float]) -> dict:
    ms = sorted(1e3 * t for t in times)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "n": len(ms)}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class Storm:
    """Keeps `loads` prefetches of cold storm adapters in flight while `on` is set."""

    def __init__(self, engine: LLMEngine, names: list[str], loads: int):
        self.cache = engine.adapters
        self.names = names
        self.loads = loads
        self.on = threading.Event()
        self.stop = threading.Event()
        self.started = 0
        self.thread = threading.Thread(target=self._run, name="storm", daemon=True)

    def _run(self) -> None:
        i = 0
        pending: set[concurrent.futures.Future] = set()
        while not self.stop.is_set():
            if not self.on.is_set():
                if pending:
                    concurrent.futures.wait(pending, timeout=1)
                    pending = {f for f in pending if not f.done()}
                self.on.wait(0.01)
                continue
            for _ in range(len(self.names)):
                if len(pending) >= self.loads:
                    break
                name = self.names[i % len(self.names)]
                i += 1
                if self.cache.tier_of(name) != "gpu":
                    pending.add(self.cache.prefetch(name))
                    self.started += 1
            if not pending:
                time.sleep(0.001)
                continue
            done, pending = concurrent.futures.wait(pending, timeout=0.05,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                f.result()

    def quiesce(self) -> None:
        self.on.clear()
        deadline = time.monotonic() + 60
        while self.cache.in_flight and time.monotonic() < deadline:
            time.sleep(0.001)


def decode_under_loads(args, engine: LLMEngine, storm: Storm, vocab: int) -> dict:
    """Step times of the full batch, alternating chunks without and with loads in flight."""
    gen = torch.Generator().manual_seed(1234)
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
    # Phases: no loads, then loads with each slot-copy chunk size (the server's alone by default).
    chunks = {"loads": host_tier.SLOT_COPY_CHUNK_BYTES} | {f"loads_chunk_{c >> 20}mb": c for c in args.slot_copy_chunks}
    phases = ["none", *chunks]
    steps = len(phases) * args.pairs * args.chunk
    result: dict = {}
    for timed in (False, True):  # the untimed pass captures every CUDA graph of this workload
        for i in range(BATCH_ADAPTERS):  # resident before the requests: they all join in one step
            engine.adapters.prefetch(f"b{i}").result(120)
        params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
        reqs = [engine.make_request(p, params, f"b{i % BATCH_ADAPTERS}") for i, p in enumerate(prompts)]
        for r in reqs:
            engine.add_request(r)
        deadline = time.monotonic() + 120
        while len(engine.scheduler.running) < len(reqs) and time.monotonic() < deadline:
            engine.step()  # loads the batch adapters if evicted, then prefills everyone
        engine.step()
        times: dict[str, list[float]] = {phase: [] for phase in phases}
        in_flight: list[int] = []
        for pair in range(args.pairs):
            for phase in phases:
                if phase != "none" and timed:
                    host_tier.SLOT_COPY_CHUNK_BYTES = chunks[phase]
                    storm.on.set()
                    while storm.cache.in_flight < min(args.loads, 1):
                        time.sleep(0.0005)
                for _ in range(args.chunk):
                    if phase != "none" and timed:
                        in_flight.append(storm.cache.in_flight)
                    t0 = time.perf_counter()
                    engine.step()
                    times[phase].append(time.perf_counter() - t0)
                storm.quiesce()
        host_tier.SLOT_COPY_CHUNK_BYTES = chunks["loads"]
        while engine.has_work():
            engine.step()
        if timed:
            for phase, ts in times.items():
                result[phase] = {"p50_ms": 1e3 * percentile(ts, 0.5), "p99_ms": 1e3 * percentile(ts, 0.99),
                                 "mean_ms": 1e3 * statistics.mean(ts), "steps": len(ts)}
            result["loads_in_flight_mean"] = statistics.mean(in_flight) if in_flight else 0.0
            result["slot_copy_chunk_bytes"] = chunks
            for phase in phases[1:]:
                result[phase]["p99_ratio"] = result[phase]["p99_ms"] / result["none"]["p99_ms"]
                result[phase]["p50_ratio"] = result[phase]["p50_ms"] / result["none"]["p50_ms"]
            result["loads_started"] = storm.started
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for name in ("loraplex.server.adapter_cache", "loraplex.server.slot_table"):  # no line per load
        logging.getLogger(name).setLevel(logging.WARNING)
    cfg = named_shape(args.shape)
    slots = BATCH_ADAPTERS + args.loads + 5 + 1  # batch adapters, storm slots, the measured adapter
    storm_names = [f"s{i}" for i in range(slots)]  # more than the slots: the next one is always cold
    steps = (2 + len(args.slot_copy_chunks)) * args.pairs * args.chunk
    tmp = Path(tempfile.mkdtemp(prefix="cold-load-"))
    settings = ServerSettings(
        dummy_weights=args.shape, device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
        max_model_len=args.prompt_len + steps + 16, max_prefill_tokens=args.batch * args.prompt_len,
        max_loras=slots, max_lora_rank=args.max_lora_rank, max_cpu_loras=4, max_concurrent_loads=args.loads,
        adapter_cache_dir=str(tmp), kv_block=args.kv_block, lora_target_modules=list(args.targets))
    engine = LLMEngine.from_settings(settings)
    from loraplex.server import engine as engine_module
    if not args.no_gc_freeze and hasattr(engine_module, "freeze_start_up_objects"):
        engine_module.freeze_start_up_objects()  # as the server does once started
    device, dtype, cache = engine.device, engine.dtype, engine.adapters
    slot_bytes = LoRABuffers.slot_bytes(cfg, args.max_lora_rank, dtype, slot_groups(args.targets))
    assert slot_bytes == cache.buffers.bytes_per_slot, "the bench's slot bytes are not the engine's"

    spec, tensors = random_adapter(cfg, args.rank, targets=args.targets, seed=7, device=device, dtype=dtype)
    file_dtype = getattr(torch, args.file_dtype) if args.file_dtype else dtype
    write_peft(tmp / "cold", spec, {k: v.to(file_dtype) for k, v in tensors.items()}, args.rank, args.targets)
    for name in storm_names + [f"b{i}" for i in range(BATCH_ADAPTERS)]:
        cache.install(AdapterId(name, f"random-{name}", "memory"), spec, tensors, keep_host_copy=True)
    del tensors

    bw = h2d_bandwidth(device, slot_bytes)
    floor_s = slot_bytes / bw
    log.info("device %s, %s; slot %.1f MB, adapter %.1f MB; pinned H2D %.1f GB/s -> floor %.2f ms",
             device, dtype, slot_bytes / 1e6, spec.nbytes / 1e6, bw / 1e9, 1e3 * floor_s)

    cache.prefetch("cold").result(120)  # first read: disk -> host tier -> slot
    assert cache.tier_of("cold") == "gpu"
    host = time_loads(engine, "cold", args.repeats, lambda: cache.evict("cold"))
    assert cache.metrics.load_seconds.labels("host")._sum.get() > 0
    breakdown = host_copy_breakdown(cache, "cold", args.repeats) if device.type == "cuda" else {}

    def off_host() -> None:
        cache.evict("cold")
        cache.host.discard("cold")

    def off_host_and_forgotten() -> None:
        off_host()
        forget_reads(cache, "cold", headers=False)

    def off_host_and_all_forgotten() -> None:
        off_host()
        forget_reads(cache, "cold", headers=True)

    disk_first = time_loads(engine, "cold", args.repeats, off_host_and_forgotten)
    disk_first_new = time_loads(engine, "cold", args.repeats, off_host_and_all_forgotten)
    disk_split: dict = {}
    disk_warm = time_loads(engine, "cold", args.repeats, off_host, disk_split)
    disk_bytes_match = slot_matches_a_fresh_read(cache, "cold", tmp / "cold")
    log.info("disk load: the slot's bytes %s a fresh read of the file", "match" if disk_bytes_match else "DO NOT MATCH")
    disk_breakdown = disk_load_breakdown(cache, "cold", tmp / "cold", args.repeats, args.profile_disk)
    disk_breakdown["split"] = {key: stats(ts) for key, ts in disk_split.items()}
    if args.read_sweep:
        disk_breakdown["read_sweep"] = sweep = read_sweep(cache, tmp / "cold", args.repeats)
        for r in sweep["reads"]:
            log.info("read sweep: %2d threads, %2d MB chunks: %.2f ms (%.1f GB/s)", r["threads"], r["chunk_mb"],
                     r["median_ms"], r["GBps"])
        log.info("memcpy of the same bytes: %.2f ms (%.1f GB/s)", sweep["memcpy"]["median_ms"], sweep["memcpy"]["GBps"])
    dropped = []

    def off_host_and_page_cache() -> None:
        off_host()
        dropped.append(drop_page_cache(tmp / "cold" / WEIGHTS_FILE))

    disk_cold = time_loads(engine, "cold", args.repeats, off_host_and_page_cache)
    loads = {"host": stats(host), "disk_page_cache_warm": stats(disk_warm),
             "disk_page_cache_warm_first": stats(disk_first), "disk_page_cache_warm_first_new_header": stats(disk_first_new),
             "disk_page_cache_dropped": stats(disk_cold)}
    for v in loads.values():
        v["vs_floor"] = v["median_ms"] / (1e3 * floor_s)
    loads["disk_page_cache_dropped"]["fadvise_used"] = all(dropped)
    # What a disk load cannot beat: reading the file (page cache dropped) plus the copy to the device.
    disk_bw = file_read_bandwidth(tmp / "cold" / WEIGHTS_FILE, args.repeats)
    disk_floor_s = (tmp / "cold" / WEIGHTS_FILE).stat().st_size / disk_bw + floor_s
    for key in ("disk_page_cache_warm", "disk_page_cache_warm_first", "disk_page_cache_warm_first_new_header",
                "disk_page_cache_dropped"):
        loads[key]["vs_disk_floor"] = loads[key]["median_ms"] / (1e3 * disk_floor_s)

    storm = Storm(engine, storm_names, args.loads)
    storm.thread.start()
    decode = decode_under_loads(args, engine, storm, cfg.vocab_size)
    storm.stop.set()
    storm.thread.join(10)
    decode["p99_ratio"] = decode["loads"]["p99_ms"] / decode["none"]["p99_ms"]
    decode["p50_ratio"] = decode["loads"]["p50_ms"] / decode["none"]["p50_ms"]

    checks = {
        "host_load_vs_floor": {"value": loads["host"]["vs_floor"], "target": "<= 2.0"},
        "decode_p99_with_loads": {"value": decode["p99_ratio"], "target": "<= 1.1"},
        "disk_warm_load_vs_floor": {"value": loads["disk_page_cache_warm"]["vs_floor"], "target": "<= 2.0"},
    }
    for name, c in checks.items():
        c["met"] = c["value"] <= TARGETS[name]
    doc = {
        "benchmark": "adapter cold load and decode under loads",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__},
        "config": {"shape": args.shape, "dtype": str(dtype).removeprefix("torch."), "rank": args.rank,
                   "max_lora_rank": args.max_lora_rank,
                   "file_dtype": args.file_dtype or str(dtype).removeprefix("torch."),
                   "targets": ",".join(args.targets), "repeats": args.repeats, "batch": args.batch,
                   "prompt_len": args.prompt_len, "loads": args.loads, "chunk": args.chunk, "pairs": args.pairs,
                   "slots": slots, "quick": args.quick, "gc_freeze": not args.no_gc_freeze},
        "adapter_bytes": spec.nbytes, "slot_bytes": slot_bytes,
        "h2d_bandwidth_GBps": bw / 1e9, "floor_ms": 1e3 * floor_s,
        "disk_read_GBps": disk_bw / 1e9, "disk_floor_ms": 1e3 * disk_floor_s,
        "cold_load": loads, "disk_load_bytes_match": disk_bytes_match,
        "host_copy_breakdown": breakdown, "disk_load_breakdown": disk_breakdown,
        "decode": decode, "checks": checks,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    rows = [("cold load from host", loads["host"]["median_ms"], loads["host"]["vs_floor"]),
            ("cold load from disk (page cache)", loads["disk_page_cache_warm"]["median_ms"],
             loads["disk_page_cache_warm"]["vs_floor"]),
            ("  first read of the file", loads["disk_page_cache_warm_first"]["median_ms"],
             loads["disk_page_cache_warm_first"]["vs_floor"]),
            ("  first read of a new header", loads["disk_page_cache_warm_first_new_header"]["median_ms"],
             loads["disk_page_cache_warm_first_new_header"]["vs_floor"]),
            ("cold load from disk (dropped)", loads["disk_page_cache_dropped"]["median_ms"],
             loads["disk_page_cache_dropped"]["vs_floor"])]
    parts = {  # printed under the row they break down
        "cold load from host": [(f"  of which: {label}", breakdown[key]) for label, key in (
            ("bare H2D of the buffer", "flat_h2d"), ("copy into the slot", "copy_to_slot")) if key in breakdown],
        "cold load from disk (page cache)": [(f"  stage: {label}", disk_breakdown[key]) for label, key in (
            ("parse and check (read_adapter)", "read_adapter"),
            ("allocate the host copy", "alloc"), ("zero its padding (fill)", "fill"),
            (f"read the file ({disk_breakdown['read_threads']} threads)", "read"),
            ("copy into the slot", "copy_to_slot"),
            ("the loader's path, no hand-off", "loader_path"),
            ("  the same, a new header", "loader_path_new_header")) if key in disk_breakdown] + [
            (f"  load: {label}", disk_breakdown["split"][key]) for label, key in (
                ("prefetch to worker start", "dispatch"), ("the worker's run", "run"),
                ("worker end to future done", "complete")) if key in disk_breakdown["split"]],
    }
    sys.stderr.write(f"\n{'':36s} {'median ms':>10s} {'x floor':>8s}   (floor {1e3 * floor_s:.2f} ms)\n")
    for label, ms, ratio in rows:
        sys.stderr.write(f"{label:36s} {ms:10.2f} {ratio:8.2f}\n")
        for part, st in parts.get(label, []):
            sys.stderr.write(f"{part:36s} {st['median_ms']:10.2f}\n")
    sys.stderr.write(f"disk read {disk_bw / 1e9:.2f} GB/s: disk floor {1e3 * disk_floor_s:.2f} ms; from disk "
                     f"(dropped) {loads['disk_page_cache_dropped']['vs_disk_floor']:.2f}x that\n")
    sys.stderr.write(f"{'decode step':36s} {'p50 ms':>10s} {'p99 ms':>8s}\n")
    for phase in ["none", *decode["slot_copy_chunk_bytes"]]:
        d = decode[phase]
        chunk = decode["slot_copy_chunk_bytes"].get(phase, 0)
        label = "none" if phase == "none" else f"{phase} ({f'{chunk >> 20} MB chunks' if chunk else 'one copy'})"
        sys.stderr.write(f"{'  ' + label:36s} {d['p50_ms']:10.2f} {d['p99_ms']:8.2f}\n")
    sys.stderr.write(f"loads in flight (mean while on): {decode['loads_in_flight_mean']:.2f}; "
                     f"p99 ratio {decode['p99_ratio']:.3f}\n")
    for name, c in checks.items():
        sys.stderr.write(f"check {name}: {c['value']:.3f} ({c['target']}) {'met' if c['met'] else 'NOT met'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
