"""The host tier of the adapter cache: adapters in (pinned) host memory, laid out as a slot.

A `HostCopy` holds one adapter's tensors already in a slot's layout (adapters.SlotLayout),
padded to the max rank, in one flat buffer, so loading it into a GPU slot is a few
`copy_(non_blocking=True)` on a side stream, straight into the slot's rows of the device
buffers (flat in chunks, scales, rank)::

    flat    [slot_elems]   layers[l]["qkv"]: a [3R, hidden], b [q+2kv, R]; ["o"]: ...
    scales  float32 [n_scales]
    rank    int32 [7]      per projection: its largest rank in any layer, 0 if untargeted

On CUDA the flat buffer is page-locked (pinned), so the copy is a DMA that overlaps the
decode kernels; on the CPU it is plain memory and the same copies run synchronously.

`read_into_host` fills a HostCopy straight from `adapter_model.safetensors` (or its copy in the
slots' dtype, when the node agent wrote one at staging: adapter_format.serving_weights): the
tensors are read (`preadv`, a few MB-sized chunks of the file at once on the loader's read
threads) into their views of the pinned buffer, no intermediate copy of the adapter.
`HostTier` keeps copies in a byte budget, least recently used first out.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, wait
from pathlib import Path

import torch

from .adapter_format import WEIGHTS_FILE, AdapterError, AdapterSpec, serving_weights
from .adapters import GROUPS, PROJECTIONS, LoRABuffers, LoRAGroup, check_held, group_mask, projection_ranks

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


# A load's copy into its slot goes as transfers of this many bytes (read at each copy; 0: one
# transfer). A decode step's own host-to-device copies (its inputs) may queue behind a
# transfer of another stream on the copy engine: behind a chunk, not a whole adapter.
SLOT_COPY_CHUNK_BYTES = 4 << 20


class HostCopy:
    """One adapter in the slot layout, in host memory (pinned when `pin`).

    Allocated uninitialised (a recycled pinned block holds an earlier adapter's bytes):
    `fill` writes what the kernels read, the adapter's tensors through `put` and zeros where
    a layer's module has a lower rank than its projection's rank in the slot. The rest
    (rank rows and columns past a projection's rank, projections the adapter does not
    target, alignment gaps) is never read, and keeps whatever it held."""

    def __init__(self, buffers: LoRABuffers, pin: bool, lock: threading.Lock | None = None):
        self.max_rank = buffers.max_rank
        self.groups = buffers.groups
        self.layout = buffers.layout
        with lock or contextlib.nullcontext():  # pinned allocations are CUDA calls
            self.flat = torch.empty(self.layout.slot_elems, dtype=buffers.dtype, pin_memory=pin)
            self.scales = torch.empty(self.layout.n_scales, dtype=torch.float32, pin_memory=pin)
            self.rank = torch.empty(len(PROJECTIONS), dtype=torch.int32, pin_memory=pin)  # per projection
        self.nbytes = self.flat.numel() * self.flat.element_size()

    @functools.cached_property
    def layers(self) -> list[dict[str, LoRAGroup]]:
        """Per layer and group, views of the copy (as LoRABuffers.layers, one slot). Made on
        first use: ~1 ms of views for Llama-3-8B that a load does not need."""
        return self.layout.views(self.flat, self.scales)

    def fill(self, spec: AdapterSpec, put) -> None:
        """Write the adapter into the layout: `put(key, view)` writes the tensor saved under
        `key` into `view`; zeros go where the kernels read past a module's own rank: a
        projection's rank in the slot is its largest in any layer (projection_ranks), so a
        layer where it is lower, or untargeted, has rows of A and columns of B up to that
        rank zeroed. Rows and columns past a projection's rank are never read (the kernels
        mask them by rank), so they are not written at all: nothing for an adapter of one
        rank throughout, whatever the slots' max rank."""
        check_held(spec, self.groups)
        r_max, flat = self.max_rank, self.flat
        modules = {(m.layer, m.proj): m for m in spec.modules}
        read = dict(zip(PROJECTIONS, projection_ranks(spec)))  # rank rows the kernels read
        scales = [0.0] * self.layout.n_scales  # written in one copy: a setitem per module costs more
        # Views straight from the layout's offsets, one as_strided each: A_i rows [i*R, i*R + r)
        # of [n*R, in] (contiguous), B_i columns [0, r) of rows [off, off + width) of
        # [sum(slices), R] (contiguous only at r == R).
        view = functools.partial(torch.as_strided, flat)
        for layer, places in enumerate(self.layout.layers):
            for name, g in places.items():
                in_f = g.a_shape[1]
                off = 0
                for i, (proj, width) in enumerate(zip(GROUPS[name], g.slices)):
                    m = modules.get((layer, proj))
                    r, r_read = (m.rank if m is not None else 0), read[proj]
                    a_row = g.a_off + i * r_max * in_f  # this slice's first rank row of A
                    b_row = g.b_off + off * r_max  # this slice's first output row of B
                    if r < r_read:
                        view((r_read - r, in_f), (in_f, 1), a_row + r * in_f).zero_()
                        view((width, r_read - r), (r_max, 1), b_row + r).zero_()
                    if m is not None:
                        put(m.key_a, view((r, in_f), (in_f, 1), a_row))
                        put(m.key_b, view((width, r), (r_max, 1), b_row))
                        scales[g.s_off + i] = m.scaling
                    off += width
        self.scales.copy_(torch.tensor(scales, dtype=torch.float32))
        self.rank.copy_(torch.tensor(list(read.values()), dtype=torch.int32))

    def copy_to(self, buffers: LoRABuffers, slot: int) -> None:
        """Enqueue the copy into `slot` on the current stream: transfers (non-blocking from
        pinned memory) straight into the slot's rows of the device buffers, which have this
        copy's layout: the weights (copy_weights), then the scales and the rank (copy_meta).
        (Copying view by view paid a fixed cost per view: 448 of them for Llama-3-8B, 2.4x the
        bytes/bandwidth floor on an H200.)"""
        self.copy_weights(buffers, slot, 0, self.nbytes)
        self.copy_meta(buffers, slot)

    def copy_weights(self, buffers: LoRABuffers, slot: int, start: int, end: int) -> None:
        """Enqueue bytes [start, end) of the flat buffer into the slot's, in transfers of
        SLOT_COPY_CHUNK_BYTES (0: one transfer). Bounds are multiples of the element size."""
        size = self.flat.element_size()
        if start % size or end % size:
            raise ValueError(f"copy_weights: [{start}, {end}) is not a whole number of {size}-byte elements")
        src, dst = self.flat[start // size: end // size], buffers.flat[slot][start // size: end // size]
        step = SLOT_COPY_CHUNK_BYTES // size or src.numel()
        for lo in range(0, src.numel(), step):
            dst[lo: lo + step].copy_(src[lo: lo + step], non_blocking=True)

    def copy_meta(self, buffers: LoRABuffers, slot: int) -> None:
        """Enqueue the scales and the projection ranks into the slot's."""
        buffers.scales[slot].copy_(self.scales, non_blocking=True)
        buffers.ranks[slot].copy_(self.rank, non_blocking=True)
        buffers.group_masks[slot] = group_mask(self.rank.tolist())  # the host's copy of the ranks


# Bytes one `preadv` call reads at most: an 84 MB adapter is 21 calls, a few per read thread.
READ_CHUNK_BYTES = 4 << 20


def read_into_host(path: str | Path, spec: AdapterSpec, buffers: LoRABuffers, pin: bool,
                   lock: threading.Lock | None = None, pool: Executor | None = None,
                   chunk_bytes: int | None = None,
                   on_region: Callable[["HostCopy", int, int], None] | None = None) -> HostCopy:
    """Read the adapter's weights under `path` straight into a new HostCopy: allocate it
    (holding `lock`, see AdapterCache.cuda_lock: pinned allocations are CUDA calls), fill it
    (HostCopy.fill), read the tensors into their views (`read_tensors`, on `pool`). The file is
    the node agent's copy in the slots' dtype where it wrote one (an F32 adapter for bf16
    slots, converted once at staging), else `adapter_model.safetensors`. With `on_region`,
    `on_region(copy, start, end)` hears each range of the copy's flat bytes once it is
    written, chunk after chunk of the file (read_tensors)."""
    copy = HostCopy(buffers, pin, lock)
    targets: list[tuple[str, torch.Tensor]] = []
    copy.fill(spec, lambda key, dst: targets.append((key, dst)))
    read_tensors(serving_weights(path, str(buffers.dtype).removeprefix("torch.")), targets, pool, chunk_bytes,
                 None if on_region is None else lambda lo, hi: on_region(copy, lo, hi))
    return copy


# A thread keeps its staging buffer (below) between loads up to this size; a larger one is
# allocated for its load alone.
STAGING_KEEP_BYTES = 256 << 20
_staging = threading.local()


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


def read_tensors(weights: Path, targets: list[tuple[str, torch.Tensor]], pool: Executor | None = None,
                 chunk_bytes: int | None = None, on_region: Callable[[int, int], None] | None = None) -> None:
    """Read each (key, view) of `targets` from the safetensors file `weights` into its view.

    A tensor whose dtype and shape are the view's, in a contiguous view, is read straight
    into it; the others (an F32 adapter for bf16 slots, B below the max rank: strided) land in
    the calling thread's staging buffer and are converted into their views after. The data
    section is read as chunk_bytes-aligned chunks of the file (default READ_CHUNK_BYTES), one
    `preadv` each into the buffers its bytes belong to (a buffer that straddles two chunks is
    split), the chunks on `pool`'s threads at once when given (preadv releases the GIL), else
    one after another here. One copy from the page cache; raises AdapterError on a file cut
    short, once no read it started is running.

    With `on_region(start, end)` (the views all of one storage, a HostCopy's flat buffer): as
    each chunk's tensors are written (converted ones included), in file order, `on_region`
    hears the byte ranges [start, end) of the storage they occupy, gaps to the next view
    included, joined with those of earlier chunks where they meet, each once it spans half a
    chunk (all that is left after the last chunk): the ranges tile the storage from 0 to its
    end. The caller
    copies them to the device while later chunks are read (AdapterLoader: a disk load's copy
    into its slot)."""
    chunk_bytes = chunk_bytes or READ_CHUNK_BYTES
    with weights.open("rb", buffering=0) as f:
        fd = f.fileno()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        size = os.fstat(fd).st_size
        reads = []  # (file offset, the target's view, buffer read into: the view or a staged one)
        staged = []  # (file offset, bytes, the target's view, offset in the staging buffer, dtype, shape)
        staged_bytes = 0
        for key, dst in targets:
            info = header[key]
            start, end = (8 + n + o for o in info["data_offsets"])
            if end > size:
                raise AdapterError(f"{weights.name}: tensor {key!r} ends past the file's {size} bytes (cut short?)")
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            if dtype == dst.dtype and dst.is_contiguous() and list(dst.shape) == info["shape"]:
                reads.append((start, dst, dst))
            else:
                staged.append((start, end - start, dst, staged_bytes, dtype, info["shape"]))
                staged_bytes += -(-(end - start) // 64) * 64
        if staged:
            stage = _staging_bytes(staged_bytes)
            for start, nbytes, dst, off, dtype, shape in staged:
                reads.append((start, dst, stage[off: off + nbytes].view(dtype).view(shape)))
        reads.sort(key=lambda r: r[0])
        byte_views = _byte_views([buf for _, _, buf in reads])
        # The file's chunks, each with the tensors that start in it.
        chunks: list[list[int]] = []
        for i, (start, _, _) in enumerate(reads):
            if not chunks or start // chunk_bytes != reads[chunks[-1][0]][0] // chunk_bytes:
                chunks.append([])
            chunks[-1].append(i)
        calls = [plan_reads([(reads[i][0], byte_views[i]) for i in chunk], chunk_bytes) for chunk in chunks]
        tiles = _tiles([dst for _, dst, _ in reads]) if on_region is not None else None
        written: list[tuple[int, int]] = []  # tiles written and not handed on yet

        def chunk_read(c: int) -> None:
            for i in chunks[c]:
                _, dst, buf = reads[i]
                if buf is not dst:
                    dst.copy_(buf)
            if tiles is None:
                return
            # A chunk ends inside a layer: its last tensors' ranges wait for the rest of their
            # layer (the next chunk), so the device gets a few large copies, not many small ones.
            written[:] = _merged([*written, *(tiles[i] for i in chunks[c])])
            last = c == len(chunks) - 1
            for lo, hi in [r for r in written if last or r[1] - r[0] >= chunk_bytes // 2]:
                written.remove((lo, hi))
                on_region(lo, hi)

        if pool is None or sum(map(len, calls)) < 2:
            for c, chunk_calls in enumerate(calls):
                for offset, views in chunk_calls:
                    _preadv_all(fd, views, offset)
                chunk_read(c)
            return
        # Every call submitted at once (in file order), so the read threads never idle while
        # a chunk's tensors are converted and handed on.
        futures = [[pool.submit(_preadv_all, fd, views, offset) for offset, views in cc] for cc in calls]
        try:
            for c, chunk_futures in enumerate(futures):
                for future in chunk_futures:
                    future.result()
                chunk_read(c)
        finally:
            everything = [future for chunk_futures in futures for future in chunk_futures]
            for future in everything:
                future.cancel()
            wait(everything)  # no read may outlive the file descriptor


def _tiles(views: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Byte ranges of one storage, one per view, that tile it: each from the view's first byte
    (0 for the lowest) to the next view's first byte (the storage's end for the highest). Views
    that do not interleave (a HostCopy's) lie each inside its own range."""
    if not views:
        return []
    storage = views[0].untyped_storage()
    base, total = storage.data_ptr(), storage.nbytes()
    starts = [v.data_ptr() - base for v in views]
    if not all(0 <= lo < total for lo in starts):
        raise ValueError("read_tensors: on_region needs every target in one storage")
    order = sorted(range(len(views)), key=starts.__getitem__)
    tiles = [(0, 0)] * len(views)
    for k, i in enumerate(order):
        tiles[i] = (starts[i] if k else 0, starts[order[k + 1]] if k + 1 < len(order) else total)
    return tiles


def _merged(ranges) -> list[tuple[int, int]]:
    """Byte ranges, sorted and joined where one ends where the next starts."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def plan_reads(reads: list[tuple[int, memoryview]], chunk_bytes: int) -> list[tuple[int, list[memoryview]]]:
    """(file offset, buffer) reads, sorted by offset -> `preadv` calls (file offset, buffers).

    A call reads bytes that lie back to back in the file, within one chunk_bytes-aligned
    chunk of it, into at most IOV_MAX buffers; a buffer across a chunk boundary is split
    there. E.g. chunk 10, buffers of 6, 6 and 4 bytes at offsets 8, 14 and 20::

        [(8, [2 bytes]), (10, [4 bytes, 6 bytes]), (20, [4 bytes])]
    """
    calls: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, view in reads:
        while len(view):
            n = min(len(view), chunk_bytes - offset % chunk_bytes)
            if offset != end or offset % chunk_bytes == 0 or len(calls[-1][1]) == _IOV_MAX:
                calls.append((offset, []))
            calls[-1][1].append(view[:n])
            offset, end, view = offset + n, offset + n, view[n:]
    return calls


def _byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    """Each contiguous tensor's bytes as a writable memoryview. Tensors of one storage (a
    HostCopy's views) are slices of one view of it: a tensor -> numpy round trip per tensor
    costs microseconds, 448 times for Llama-3-8B."""
    bases: dict[int, memoryview] = {}
    views = []
    for t in tensors:
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base not in bases:
            bases[base] = memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
        start = t.data_ptr() - base
        views.append(bases[base][start: start + t.numel() * t.element_size()])
    return views


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


def host_copy_from_tensors(spec: AdapterSpec, tensors: dict[str, torch.Tensor], buffers: LoRABuffers,
                           pin: bool) -> HostCopy:
    """A HostCopy of an adapter already in memory (tensors under PEFT's keys)."""
    copy = HostCopy(buffers, pin)
    copy.fill(spec, lambda key, dst: dst.copy_(tensors[key]))
    return copy


class HostTier:
    """name -> HostCopy within `capacity_bytes`, least recently used out first; thread-safe.
    A copy dropped while a load still copies from it lives on until that load lets go of it."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[str], None] | None = None):
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict or (lambda name: None)  # e.g. counts host-tier evictions
        self._copies: OrderedDict[str, HostCopy] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._copies.values())

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._copies

    def names(self) -> list[str]:
        """Least recently used first."""
        with self._lock:
            return list(self._copies)

    def get(self, name: str) -> HostCopy | None:
        """The copy (now the most recently used), or None."""
        with self._lock:
            copy = self._copies.get(name)
            if copy is not None:
                self._copies.move_to_end(name)
            return copy

    def add(self, name: str, copy: HostCopy) -> bool:
        """Keep `copy`, dropping least recently used copies to make room. Returns False (and
        keeps nothing) when it alone exceeds the budget."""
        with self._lock:
            self._copies.pop(name, None)
            if copy.nbytes > self.capacity_bytes:
                return False
            used = sum(c.nbytes for c in self._copies.values())
            while self._copies and used + copy.nbytes > self.capacity_bytes:
                old, dropped = self._copies.popitem(last=False)
                used -= dropped.nbytes
                self.on_evict(old)
                log.debug("host tier: dropped %s", old)
            self._copies[name] = copy
            return True

    def discard(self, name: str) -> None:
        with self._lock:
            self._copies.pop(name, None)
