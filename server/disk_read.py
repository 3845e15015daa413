"""The disk tier's read: a safetensors file's tensors straight into a host copy's buffer.

Where it sits in a load from disk (adapter_loader.py)::

    read_adapter (the spec)  ->  HostCopy.fill (zeros, scales; the views the tensors go to)
        ->  plan_read: which bytes of the file go where in the copy's flat buffer   (here)
        ->  run_read:  preadv calls on the read threads, chunk by chunk of the file  (here)
                       each chunk's ranges of the copy handed on as they complete,
                       so the loader copies them to the slot under the rest of the read

A plan depends only on the file's header and the slots' layout, so a loader keeps it with
the adapter (DiskRead) and a reload of the same file (its host copy dropped) runs it again
without the header, the views or the planning (4-8 ms of Python for Llama-3-8B on a 2-core
CPU, bench/results/disk_read_cpu_notes.md); and it keeps
plans by header (PlanCache), so the first read of a fleet's next adapter, whose header is the
first's byte for byte, runs the first's. A plan runs only on the file it was made for (its
inode, size and mtime): a version renamed over the file since is read anew (StalePlan).

One copy from the page cache: `preadv` into the flat buffer's bytes where the file's dtype
and shape are the view's (the common case), else into a per-thread staging buffer, converted
into the view after its chunk is read (an F32 adapter for bf16 slots; B below the slots'
max rank, a strided view).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter_format import (CACHED_HEADER_BYTES, CONFIG_FILE, MAX_HEADER_BYTES, WEIGHTS_FILE, AdapterError, AdapterSpec,
                             checked_header)

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}

# Bytes one `preadv` call reads at most: an 84 MB adapter is 21 calls, a few per read thread.
READ_CHUNK_BYTES = 4 << 20

# A thread keeps its staging buffer (below) between loads up to this size; a larger one is
# allocated for its load alone.
STAGING_KEEP_BYTES = 256 << 20
_staging = threading.local()

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024

FLAT, STAGED = 0, 1  # the buffers a planned read writes into


# A span: (buffer, offset, bytes), `bytes` bytes at `offset` of buffer FLAT or STAGED. A plain
# tuple: a plan has one per tensor and piece (~450 for Llama-3-8B), made on each first read.
Span = tuple[int, int, int]


@dataclass(frozen=True)
class Convert:
    """A staged tensor: `nbytes` at `src_offset` of the staging buffer, saved as `dtype`
    `shape`, converted into the flat buffer's view (as `dst_dtype`: `dst_offset` elements,
    `dst_shape`, `dst_stride`)."""

    src_offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dst_dtype: torch.dtype
    dst_offset: int
    dst_shape: tuple[int, ...]
    dst_stride: tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """One chunk_bytes-aligned chunk of the file: its preadv calls (file offset, spans), the
    staged tensors that start in it, and the flat buffer's byte ranges complete once it is
    read (handed on then: run_read's on_region)."""

    calls: tuple[tuple[int, tuple[Span, ...]], ...]
    converts: tuple[Convert, ...]
    ranges: tuple[tuple[int, int], ...]


class StalePlan(AdapterError):
    """The file at a plan's path is no longer the one it was made from (replaced since)."""


@dataclass(frozen=True)
class ReadPlan:
    """Which bytes of `weights` go where in a flat buffer of `nbytes` bytes (a HostCopy's);
    made from the file whose (inode, size, mtime) is `file_id`, and only valid for it."""

    weights: Path
    file_id: tuple[int, int, int]
    nbytes: int
    chunk_bytes: int
    staged_bytes: int
    chunks: tuple[Chunk, ...]

    def for_file(self, weights: Path, file_id: tuple[int, int, int]) -> "ReadPlan":
        """This plan for another file whose header is this one's byte for byte (so its tensors
        lie at the same offsets): an adapter of the same fleet."""
        return dataclasses.replace(self, weights=weights, file_id=file_id)


class PlanCache:
    """Read plans by header and adapter structure, for one layout (an AdapterLoader's): the
    adapters of one fleet share both, so the first read of each after the first is planned
    already. Thread-safe, least recently used out past `size`."""

    def __init__(self, size: int = 16):
        self.size = size
        self._plans: OrderedDict[tuple, ReadPlan] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(raw_header: bytes, spec: AdapterSpec, chunk_bytes: int | None) -> tuple:
        """What a plan depends on besides the layout: the header (offsets, dtypes, shapes), the
        tensors read and where they go (each module's layer, projection, rank and keys), the
        chunks (default READ_CHUNK_BYTES)."""
        modules = tuple((m.layer, m.proj, m.rank, m.key_a, m.key_b) for m in spec.modules)
        return raw_header, modules, chunk_bytes or READ_CHUNK_BYTES

    def get(self, key: tuple) -> ReadPlan | None:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key: tuple, plan: ReadPlan) -> None:
        if len(key[0]) > CACHED_HEADER_BYTES:  # a crafted header: not kept (adapter_format)
            return
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)


def read_header(weights: Path) -> tuple[bytes, tuple[int, int, int]]:
    """The safetensors header's JSON bytes and the file's (inode, size, mtime), from one open."""
    with weights.open("rb", buffering=0) as f:
        file_id = _file_id(os.fstat(f.fileno()))
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 <= n <= MAX_HEADER_BYTES or 8 + n > file_id[1]:
            raise AdapterError(f"{weights.name}: no safetensors header of a sane size in its {file_id[1]} bytes")
        return f.read(n), file_id


def plan_read(weights: Path, targets: list[tuple[str, torch.Tensor]], chunk_bytes: int | None = None,
              header: tuple[bytes, tuple[int, int, int]] | None = None) -> ReadPlan:
    """The plan that reads each (key, view) of `targets` from the safetensors file `weights`
    into its view; the views are all of one flat buffer (a HostCopy's). Raises AdapterError
    when a tensor ends past the end of the file (cut short).

    The data section is read as chunk_bytes-aligned chunks of the file (default
    READ_CHUNK_BYTES): one `preadv` per chunk into the buffers its bytes belong to (a buffer
    across two chunks is split). After each chunk, in file order, the flat buffer's ranges that
    its tensors occupy (gaps to the next view included, so that all ranges tile the buffer),
    joined with those of earlier chunks where they meet, are complete: each is handed on once
    it spans half a chunk (everything left, after the last chunk). A chunk ends inside a layer,
    so a layer's ranges wait for its end: the device gets a few large copies, not many small.

    `header`: the file's (read_header), read already."""
    chunk_bytes = chunk_bytes or READ_CHUNK_BYTES
    flat = _one_storage([dst for _, dst in targets])
    base, total = flat.data_ptr(), flat.nbytes()
    raw, file_id = header or read_header(weights)
    n, size = len(raw), file_id[1]
    # Parsed and checked as read_adapter does, and through its cache: the header read_adapter
    # just parsed (or a fleet's shared one) is not parsed again.
    header = checked_header(raw, size - 8 - n, weights.name)
    reads = []  # (file offset, nbytes, dst byte offset in flat, Convert or None)
    staged_bytes = 0
    for key, dst in targets:
        info = header.get(key)
        dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if info is not None else None
        if dtype is None:  # the spec was checked against another file: a new version renamed in since
            raise AdapterError(f"{weights.name}: no floating-point tensor {key!r} (the file changed since "
                               f"it was checked?)")
        if info["shape"] != list(dst.shape):  # a converting copy_ would broadcast [1, in] into [r, in]
            raise AdapterError(f"{weights.name}: tensor {key!r} has shape {info['shape']}, the adapter's is "
                               f"{list(dst.shape)} (the file changed since it was checked, or is another version's?)")
        start, end = (8 + n + o for o in info["data_offsets"])
        if end > size:
            raise AdapterError(f"{weights.name}: tensor {key!r} ends past the file's {size} bytes (cut short?)")
        at = dst.data_ptr() - base
        if dtype == dst.dtype and dst.is_contiguous():
            reads.append((start, end - start, at, None))
        else:
            reads.append((start, end - start, at, Convert(staged_bytes, end - start, dtype, tuple(info["shape"]), dst.dtype,
                                                          at // dst.element_size(), tuple(dst.shape), dst.stride())))
            staged_bytes += -(-(end - start) // 64) * 64
    # Each view's tile of the flat buffer: from its first byte (0 for the lowest) to the next's.
    starts = sorted({at for _, _, at, _ in reads})
    tile_end = dict(zip(starts, starts[1:] + [total]))
    tile_start = {at: (at if i else 0) for i, at in enumerate(starts)}

    reads.sort(key=lambda r: r[0])
    chunks: list[Chunk] = []
    written: list[tuple[int, int]] = []  # tiles read and not handed on yet
    i = 0
    while i < len(reads):
        j = i
        while j < len(reads) and reads[j][0] // chunk_bytes == reads[i][0] // chunk_bytes:
            j += 1
        group = reads[i:j]
        spans = [(start, (FLAT, at, nbytes) if c is None else (STAGED, c.src_offset, nbytes))
                 for start, nbytes, at, c in group]
        written[:] = _merged([*written, *((tile_start[at], tile_end[at]) for _, _, at, _ in group)])
        last = j == len(reads)
        ready = [r for r in written if last or r[1] - r[0] >= chunk_bytes // 2]
        written[:] = [r for r in written if r not in ready]
        chunks.append(Chunk(calls=tuple((off, tuple(v)) for off, v in plan_reads(spans, chunk_bytes)),
                            converts=tuple(c for _, _, _, c in group if c is not None), ranges=tuple(ready)))
        i = j
    if not reads:
        chunks.append(Chunk(calls=(), converts=(), ranges=((0, total),) if total else ()))
    return ReadPlan(weights=weights, file_id=file_id, nbytes=total, chunk_bytes=chunk_bytes,
                    staged_bytes=staged_bytes, chunks=tuple(chunks))


def run_read(plan: ReadPlan, flat: torch.Tensor, pool: Executor | None = None,
             on_region: Callable[[int, int], None] | None = None) -> None:
    """Read `plan.weights` into `flat` (a buffer of the plan's layout) as planned: the chunks'
    calls on `pool`'s threads at once when given (preadv releases the GIL), else one after
    another here. After each chunk, in file order, its staged tensors are converted into their
    views, then `on_region(start, end)` hears the flat buffer's ranges that are complete.
    Raises AdapterError on a file cut short, once no read it started is running, and
    StalePlan, before reading anything, when the file at the plan's path is not the one it was
    made from (the node agent renamed a new version over it)."""
    if flat.numel() * flat.element_size() != plan.nbytes or not flat.is_contiguous():
        raise ValueError(f"run_read: the plan is for a contiguous buffer of {plan.nbytes} bytes")
    buffers = [_bytes_of(flat), None]
    stage = None
    if plan.staged_bytes:
        stage = _staging_bytes(plan.staged_bytes)
        buffers[STAGED] = _bytes_of(stage)

    def views(spans: tuple[Span, ...]) -> list[memoryview]:
        return [buffers[buf][at: at + n] for buf, at, n in spans]

    def chunk_read(chunk: Chunk) -> None:
        for c in chunk.converts:
            src = stage[c.src_offset: c.src_offset + c.nbytes].view(c.dtype).view(c.shape)
            typed = flat.view(torch.uint8).view(c.dst_dtype)
            torch.as_strided(typed, c.dst_shape, c.dst_stride, c.dst_offset).copy_(src)
        if on_region is not None:
            for lo, hi in chunk.ranges:
                on_region(lo, hi)

    with plan.weights.open("rb", buffering=0) as f:
        fd = f.fileno()
        if _file_id(os.fstat(fd)) != plan.file_id:
            raise StalePlan(f"{plan.weights.name} changed since its read was planned")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if pool is None or sum(len(c.calls) for c in plan.chunks) < 2:
            for chunk in plan.chunks:
                for offset, spans in chunk.calls:
                    _preadv_all(fd, views(spans), offset)
                chunk_read(chunk)
            return
        # Every call submitted at once (in file order), so the read threads never idle while a
        # chunk's tensors are converted and handed on.
        futures = [[pool.submit(_preadv_all, fd, views(spans), offset) for offset, spans in chunk.calls]
                   for chunk in plan.chunks]
        try:
            for chunk, chunk_futures in zip(plan.chunks, futures):
                for future in chunk_futures:
                    future.result()
                chunk_read(chunk)
        finally:
            everything = [future for chunk_futures in futures for future in chunk_futures]
            for future in everything:
                future.cancel()
            wait(everything)  # no read may outlive the file descriptor


def read_tensors(weights: Path, targets: list[tuple[str, torch.Tensor]], pool: Executor | None = None,
                 chunk_bytes: int | None = None, on_region: Callable[[int, int], None] | None = None) -> None:
    """Read each (key, view) of `targets` (views of one flat buffer) from `weights` into its
    view: plan_read, then run_read."""
    plan = plan_read(weights, targets, chunk_bytes)
    run_read(plan, _flat_of([dst for _, dst in targets]), pool, on_region)


@dataclass(frozen=True)
class DiskRead:
    """What a load from disk worked out, kept with the adapter for its reloads: its spec
    (read_adapter) and its read plan, valid while its files' `stamp` (files_stamp) is the same.
    No plan: the files were checked (AdapterLoader.needs_stage) and not read yet; `seconds`,
    what the check took, which the load that reads them next counts as its own."""

    stamp: tuple
    spec: AdapterSpec
    plan: ReadPlan | None
    seconds: float = 0.0


def files_stamp(directory: Path, weights: Path) -> tuple:
    """What identifies an adapter directory's files as read: the directory's own entry (not
    followed: a symlink the node agent renames over the name to switch versions is a new one
    each time, and a directory's mtime moves when a file is renamed into it), and the inode,
    size and modification time of its config, its weights and the file the weights are read
    from (`weights`: the node agent's copy in the slots' dtype, where there is one). So a
    version switched in and back during a read (A, B, A) stamps differently from A read
    whole. A missing file stamps as None."""
    stamps: list = []
    for path, follow in ((directory, False), (directory / CONFIG_FILE, True), (directory / WEIGHTS_FILE, True),
                         (weights, True)):
        try:
            st = path.stat() if follow else path.lstat()
            stamps.append((str(path), st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


def plan_reads(reads: list[tuple[int, Span]], chunk_bytes: int) -> list[tuple[int, list[Span]]]:
    """(file offset, span) reads, sorted by offset -> `preadv` calls (file offset, spans).

    A call reads bytes that lie back to back in the file, within one chunk_bytes-aligned
    chunk of it, into at most IOV_MAX spans; a span across a chunk boundary is split there.
    E.g. chunk 10, spans of 6, 6 and 4 bytes at offsets 8, 14 and 20::

        [(8, [2 bytes]), (10, [4 bytes, 6 bytes]), (20, [4 bytes])]
    """
    calls: list[tuple[int, list[Span]]] = []
    end = -1
    for offset, (buf, at, left) in reads:
        while left:
            n = min(left, chunk_bytes - offset % chunk_bytes)
            if offset != end or offset % chunk_bytes == 0 or len(calls[-1][1]) == _IOV_MAX:
                calls.append((offset, []))
            calls[-1][1].append((buf, at, n))
            offset, end, at, left = offset + n, offset + n, at + n, left - n
    return calls


def _merged(ranges) -> list[tuple[int, int]]:
    """Byte ranges, sorted and joined where one ends where the next starts."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _file_id(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _one_storage(views: list[torch.Tensor]) -> torch.UntypedStorage:
    """The storage every view is of (a HostCopy's flat buffer)."""
    if not views:
        return torch.UntypedStorage(0)
    storage = views[0].untyped_storage()
    base, total = storage.data_ptr(), storage.nbytes()
    if not all(0 <= v.data_ptr() - base < total for v in views):
        raise ValueError("read_tensors: the targets must be views of one buffer")
    return storage


def _flat_of(views: list[torch.Tensor]) -> torch.Tensor:
    """The whole storage of `views`, as a uint8 tensor."""
    storage = _one_storage(views)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes as a writable memoryview (uint8 numpy over its storage)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _staging_bytes(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] for the tensors a load converts, this thread's own and reused: its
    pages are faulted in once, where a fresh temporary per tensor paid a fault per page
    inside the read. Measured on an H200 (bench/results/cold_load_h200_notes.md), disk loads
    with the page cache warm: a rank-16 adapter into rank-64 slots (whose B rows all take
    this path) 45.2 -> 34.8 ms, an F32 one into bf16 slots 46.6 -> 43.5 ms."""
    buf = getattr(_staging, "buf", None)
    if buf is not None and buf.numel() >= nbytes:
        return buf[:nbytes]
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes <= STAGING_KEEP_BYTES:
        _staging.buf = buf
    return buf


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Read the file from `offset` into `views`, back to back (a read may return short: Linux
    caps one at ~2 GiB, a signal may cut it; go on from where it stopped)."""
    while views:
        got = os.preadv(fd, views, offset) if hasattr(os, "preadv") else _pread_into(fd, views[0], offset)
        if got <= 0:
            raise AdapterError(f"{WEIGHTS_FILE}: no data at offset {offset} (cut short?)")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views.pop(0))
        if got:
            views[0] = views[0][got:]


def _pread_into(fd: int, view: memoryview, offset: int) -> int:  # pragma: no cover - no preadv
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)
