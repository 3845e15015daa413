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
tensors are read (disk_read.py: `preadv`, a few MB-sized chunks of the file at once on the
loader's read threads) into their views of the pinned buffer, no intermediate copy of the
adapter.
`HostTier` keeps copies in a byte budget, least recently used first out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from pathlib import Path

import torch

from .adapter_format import AdapterSpec, serving_weights
from .adapters import GROUPS, PROJECTIONS, LoRABuffers, LoRAGroup, check_held, group_mask, projection_ranks
from .disk_read import PlanCache, ReadPlan, StalePlan, plan_read, read_header, run_read

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
        self.read_plan: ReadPlan | None = None  # how it was read from disk (read_into_host), if it was
        # What identifies its bytes beyond this copy (AdapterLoader.host_copy sets it: the
        # stamp of the files it was read from), for the prefix cache; None: nothing does.
        self.content: Hashable | None = None

    @functools.cached_property
    def layers(self) -> list[dict[str, LoRAGroup]]:
        """Per layer and group, views of the copy (as LoRABuffers.layers, one slot). Made on
        first use: 1-2 ms of views for Llama-3-8B that a load does not need
        (bench/results/disk_read_cpu.json)."""
        return self.layout.views(self.flat, self.scales)

    def fill(self, spec: AdapterSpec, put: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """Write the adapter into the layout: `put(key, view)` writes the tensor saved under
        `key` into `view` (None: the tensors are written otherwise, by a ReadPlan); zeros go
        where the kernels read past a module's own rank: a projection's rank in the slot is
        its largest in any layer (projection_ranks), so a layer where it is lower, or
        untargeted, has rows of A and columns of B up to that rank zeroed. Rows and columns past a projection's rank are never read (the kernels
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
                        if put is not None:
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
        step = SLOT_COPY_CHUNK_BYTES // size or max(1, src.numel())
        for lo in range(0, src.numel(), step):
            dst[lo: lo + step].copy_(src[lo: lo + step], non_blocking=True)

    def copy_meta(self, buffers: LoRABuffers, slot: int) -> None:
        """Enqueue the scales and the projection ranks into the slot's."""
        buffers.scales[slot].copy_(self.scales, non_blocking=True)
        buffers.ranks[slot].copy_(self.rank, non_blocking=True)
        buffers.group_masks[slot] = group_mask(self.rank.tolist())  # the host's copy of the ranks
        buffers.writes[slot] += 1
        buffers.contents[slot] = self.content


def read_into_host(path: str | Path, spec: AdapterSpec, buffers: LoRABuffers, pin: bool,
                   lock: threading.Lock | None = None, pool: Executor | None = None,
                   chunk_bytes: int | None = None,
                   on_region: Callable[["HostCopy", int, int], None] | None = None,
                   plan: ReadPlan | None = None, plans: PlanCache | None = None) -> HostCopy:
    """Read the adapter's weights under `path` straight into a new HostCopy: allocate it
    (holding `lock`, see AdapterCache.cuda_lock: pinned allocations are CUDA calls), fill it
    (HostCopy.fill), read the tensors into their views (disk_read: `plan_read`, then `run_read`
    on `pool`). The file is the node agent's copy in the slots' dtype where it wrote one (an F32
    adapter for bf16 slots, converted once at staging), else `adapter_model.safetensors`. With
    `on_region`, `on_region(copy, start, end)` hears each range of the copy's flat bytes once
    it is written, chunk after chunk of the file.

    `plan`: the plan of an earlier read of the same file into this layout (the copy's
    `read_plan`, kept by the loader): run again with no header, views or planning; StalePlan
    if the file was replaced since. `plans`: plans of other files of the same header and
    adapter structure (PlanCache, for this layout), used and added to."""
    copy = HostCopy(buffers, pin, lock)
    hand_on = None if on_region is None else lambda lo, hi: on_region(copy, lo, hi)
    if plan is not None:
        copy.fill(spec)
        run_read(plan, copy.flat, pool, hand_on)
        copy.read_plan = plan
        return copy
    weights = serving_weights(path, str(buffers.dtype).removeprefix("torch."))
    targets: list[tuple[str, torch.Tensor]] | None = None
    for attempt in range(3):  # a file replaced between planning and reading is planned again
        header = read_header(weights)
        key = PlanCache.key(header[0], spec, chunk_bytes) if plans is not None else None
        known = plans.get(key) if plans is not None else None
        if known is not None:
            copy.fill(spec)
            plan = known.for_file(weights, header[1])
        else:
            if targets is None:
                targets = []
                copy.fill(spec, lambda name, dst: targets.append((name, dst)))
            plan = plan_read(weights, targets, chunk_bytes, header)
            if plans is not None:
                plans.put(key, plan)
        try:
            run_read(plan, copy.flat, pool, hand_on)
            break
        except StalePlan:
            if attempt == 2:
                raise
    copy.read_plan = plan
    return copy


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
