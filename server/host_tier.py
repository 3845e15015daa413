"""The host tier of the adapter cache: adapters in (pinned) host memory, laid out as a slot.

A `HostCopy` holds one adapter's tensors already in the slot buffers' layout (see
adapters.LoRABuffers), zero-padded to the max rank, in one flat buffer, so loading it into
a GPU slot is one `copy_(non_blocking=True)` per buffer and per layer on a side stream::

    layers[l]["qkv"]     a [3R, hidden]   b [q+2kv, R]    scaling float32 [3]
    layers[l]["o"]       a [R, q]         b [hidden, R]   scaling float32 [1]
    ...                                                    rank int32 [1]

On CUDA the flat buffer is page-locked (pinned), so the copy is a DMA that overlaps the
decode kernels; on the CPU it is plain memory and the same copies run synchronously.

`read_into_host` fills a HostCopy straight from `adapter_model.safetensors`: the tensors are
read (`preadv`) into their views of the pinned buffer, no intermediate copy of the adapter.
`HostTier` keeps copies in a byte budget, least recently used first out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter_format import WEIGHTS_FILE, AdapterError, AdapterSpec
from .adapters import GROUPS, LoRABuffers

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass
class HostGroup:
    a: torch.Tensor  # [n*R, in]
    b: torch.Tensor  # [sum(slices), R]
    scaling: torch.Tensor  # float32 [n]
    slices: tuple[int, ...]  # output columns of each fused projection


class HostCopy:
    """One adapter in the slot layout, in host memory (pinned when `pin`)."""

    def __init__(self, buffers: LoRABuffers, pin: bool, lock: threading.Lock | None = None,
                 device: torch.device | str = "cpu"):
        """`device` other than the CPU makes a device-side staging copy of the same layout."""
        self.max_rank = buffers.max_rank
        sizes = [(g.a.shape[1:], g.b.shape[1:], g.scaling.shape[1]) for layer in buffers.layers for g in layer.values()]
        total = sum(a[0] * a[1] + b[0] * b[1] for a, b, _ in sizes)
        n_scale = sum(n for _, _, n in sizes)
        with lock or contextlib.nullcontext():  # pinned allocations are CUDA calls
            self.flat = torch.zeros(total, dtype=buffers.dtype, pin_memory=pin, device=device)
            self.scales = torch.zeros(n_scale + 1, dtype=torch.float32, pin_memory=pin, device=device)
            self.rank = torch.zeros(1, dtype=torch.int32, pin_memory=pin, device=device)
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.layers: list[dict[str, HostGroup]] = []
        off = s_off = 0
        for layer in buffers.layers:
            groups = {}
            for name, g in layer.items():
                (ar, ai), (bo, br), n = g.a.shape[1:], g.b.shape[1:], g.scaling.shape[1]
                a = self.flat[off: off + ar * ai].view(ar, ai)
                off += ar * ai
                b = self.flat[off: off + bo * br].view(bo, br)
                off += bo * br
                groups[name] = HostGroup(a, b, self.scales[s_off: s_off + n], g.slices)
                s_off += n
            self.layers.append(groups)

    def fill(self, spec: AdapterSpec, put) -> None:
        """Write the adapter's tensors into the layout: `put(key, view)` writes the tensor saved
        under `key` into `view` (zero padding stays where the rank is below the max)."""
        r_max = self.max_rank
        modules = {(m.layer, m.proj): m for m in spec.modules}
        for layer, groups in enumerate(self.layers):
            for name, projs in GROUPS.items():
                g = groups[name]
                off = 0
                for i, (proj, width) in enumerate(zip(projs, g.slices)):
                    m = modules.get((layer, proj))
                    if m is not None:
                        put(m.key_a, g.a[i * r_max: i * r_max + m.rank])  # [r, in]
                        put(m.key_b, g.b[off: off + width, : m.rank])  # [out, r]
                        g.scaling[i] = m.scaling
                    off += width
        self.rank[0] = spec.max_rank

    def sources(self) -> list[torch.Tensor]:
        """The copy's tensors in `slot_views` order."""
        return [t for layer in self.layers for h in layer.values() for t in (h.a, h.b, h.scaling)] + [self.rank]

    def copy_to(self, buffers: LoRABuffers, slot: int, views: list[torch.Tensor] | None = None,
                staging: HostCopy | None = None) -> None:
        """Enqueue the copy into `slot` on the current stream (non-blocking from pinned memory).

        With `staging` (a HostCopy on the slots' device), the three host buffers cross PCIe
        whole and are scattered into the slot's ~4 x 3 x layers views on the device: a
        transfer per view pays a fixed cost each (the H200 run measured 2.4x the
        bytes/bandwidth floor that way), a device-side scatter of the same bytes costs
        microseconds. One `_foreach_copy_` call per stage: the Python thread holds the GIL
        for one call instead of hundreds, so the engine thread's steps are not held up."""
        views = views if views is not None else slot_views(buffers, slot)
        sources = self.sources()
        if staging is not None:
            torch._foreach_copy_([staging.flat, staging.scales, staging.rank], [self.flat, self.scales, self.rank],
                                 non_blocking=True)
            sources = staging.sources()
        torch._foreach_copy_(views, sources, non_blocking=True)


def slot_views(buffers: LoRABuffers, slot: int) -> list[torch.Tensor]:
    """Views of one slot of the device buffers, in HostCopy.sources order:
    per layer, per group: a [n*R, in], b [out, R], scaling [n]; then ranks [1]."""
    return [t for layer in buffers.layers for g in layer.values()
            for t in (g.a[slot], g.b[slot], g.scaling[slot])] + [buffers.ranks[slot: slot + 1]]


def read_into_host(path: str | Path, spec: AdapterSpec, buffers: LoRABuffers, pin: bool,
                   lock: threading.Lock | None = None) -> HostCopy:
    """Read `adapter_model.safetensors` under `path` straight into a new HostCopy.

    Each tensor whose dtype is the slots' dtype lands in its (pinned) view of the layout; the
    others (an F32 adapter for bf16 slots, a rank below the max) land in a small temporary and
    are converted after. The data section is one run of tensors sorted by offset, so the whole
    read is one `preadv` per run (up to IOV_MAX views each): one copy from the page cache, a
    handful of system calls, the GIL released throughout. Raises AdapterError on a file cut
    short. `lock` is held while pinned memory is allocated (see AdapterCache.cuda_lock)."""
    copy = HostCopy(buffers, pin, lock)
    targets: list[tuple[str, torch.Tensor]] = []
    copy.fill(spec, lambda key, dst: targets.append((key, dst)))
    weights = Path(path) / WEIGHTS_FILE
    with weights.open("rb", buffering=0) as f:
        fd = f.fileno()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        size = os.fstat(fd).st_size
        reads = []  # (start, end, key, dst, buffer read into)
        for key, dst in targets:
            info = header[key]
            start, end = (8 + n + o for o in info["data_offsets"])
            if end > size:
                raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} ends past the file's {size} bytes (cut short?)")
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            direct = dtype == dst.dtype and dst.is_contiguous() and list(dst.shape) == info["shape"]
            reads.append((start, end, key, dst, dst if direct else torch.empty(info["shape"], dtype=dtype)))
        reads.sort(key=lambda r: r[0])
        run: list = []
        for r in reads + [None]:
            if run and (r is None or r[0] != run[-1][1] or len(run) == _IOV_MAX):
                _read_run(fd, run)
                run = []
            if r is not None:
                run.append(r)
    for _, _, _, dst, buf in reads:
        if buf is not dst:
            dst.copy_(buf)
    return copy


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def _read_run(fd: int, run: list) -> None:
    """Read tensors that lie back to back in the file into their buffers (a read may return
    short: Linux caps one at ~2 GiB; go on from where it stopped)."""
    views = [memoryview(buf.view(-1).view(torch.uint8).numpy()) for *_, buf in run]
    offset = run[0][0]
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
