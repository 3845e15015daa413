"""The host tier of the adapter cache: adapters in (pinned) host memory, laid out as a slot.

A `HostCopy` holds one adapter's tensors already in the slot buffers' layout (see
adapters.LoRABuffers), zero-padded to the max rank, in one flat buffer, so loading it into
a GPU slot is one `copy_(non_blocking=True)` per buffer and per layer on a side stream::

    layers[l]["qkv"]     a [3R, hidden]   b [q+2kv, R]    scaling float32 [3]
    layers[l]["o"]       a [R, q]         b [hidden, R]   scaling float32 [1]
    ...                                                    rank int32 [1]

On CUDA the flat buffer is page-locked (pinned), so the copy is a DMA that overlaps the
decode kernels; on the CPU it is plain memory and the same copies run synchronously.

`read_into_host` fills a HostCopy straight from `adapter_model.safetensors` (memory-mapped
by safetensors, one tensor at a time into its view: no second copy of the whole adapter).
`HostTier` keeps copies in a byte budget, least recently used first out; a copy being
copied to the GPU is held (`get` ... `put_back`) and never dropped under the copy.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter_format import WEIGHTS_FILE, AdapterSpec
from .adapters import GROUPS, LoRABuffers

log = logging.getLogger(__name__)


@dataclass
class HostGroup:
    a: torch.Tensor  # [n*R, in]
    b: torch.Tensor  # [sum(slices), R]
    scaling: torch.Tensor  # float32 [n]
    slices: tuple[int, ...]  # output columns of each fused projection


class HostCopy:
    """One adapter in the slot layout, in host memory (pinned when `pin`)."""

    def __init__(self, buffers: LoRABuffers, pin: bool):
        self.max_rank = buffers.max_rank
        sizes = [(g.a.shape[1:], g.b.shape[1:], g.scaling.shape[1]) for layer in buffers.layers for g in layer.values()]
        total = sum(a[0] * a[1] + b[0] * b[1] for a, b, _ in sizes)
        n_scale = sum(n for _, _, n in sizes)
        self.flat = torch.zeros(total, dtype=buffers.dtype, pin_memory=pin)
        self.scales = torch.zeros(n_scale + 1, dtype=torch.float32, pin_memory=pin)
        self.rank = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
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

    def fill(self, spec: AdapterSpec, get) -> None:
        """Write the adapter's tensors (`get(key)` -> tensor as saved) into the layout."""
        r_max = self.max_rank
        modules = {(m.layer, m.proj): m for m in spec.modules}
        for layer, groups in enumerate(self.layers):
            for name, projs in GROUPS.items():
                g = groups[name]
                off = 0
                for i, (proj, width) in enumerate(zip(projs, g.slices)):
                    m = modules.get((layer, proj))
                    if m is not None:
                        g.a[i * r_max: i * r_max + m.rank].copy_(get(m.key_a))  # [r, in]
                        g.b[off: off + width, : m.rank].copy_(get(m.key_b))  # [out, r]
                        g.scaling[i] = m.scaling
                    off += width
        self.rank[0] = spec.max_rank

    def sources(self) -> list[torch.Tensor]:
        """The copy's tensors in `slot_views` order."""
        return [t for layer in self.layers for h in layer.values() for t in (h.a, h.b, h.scaling)] + [self.rank]

    def copy_to(self, buffers: LoRABuffers, slot: int, views: list[torch.Tensor] | None = None) -> None:
        """Enqueue the copy into `slot` on the current stream (non-blocking from pinned memory).

        One `_foreach_copy_` call for the ~4 x 3 x layers tensors: the Python thread holds the
        GIL for one call instead of hundreds, so the engine thread's steps are not held up."""
        torch._foreach_copy_(views if views is not None else slot_views(buffers, slot), self.sources(),
                             non_blocking=True)


def slot_views(buffers: LoRABuffers, slot: int) -> list[torch.Tensor]:
    """Views of one slot of the device buffers, in HostCopy.sources order:
    per layer, per group: a [n*R, in], b [out, R], scaling [n]; then ranks [1]."""
    return [t for layer in buffers.layers for g in layer.values()
            for t in (g.a[slot], g.b[slot], g.scaling[slot])] + [buffers.ranks[slot: slot + 1]]


def read_into_host(path: str | Path, spec: AdapterSpec, buffers: LoRABuffers, pin: bool) -> HostCopy:
    """Read `adapter_model.safetensors` under `path` into a new HostCopy. Raises on a corrupt
    or truncated file (safetensors' own error) and on tensors that do not match `spec`."""
    from safetensors import safe_open

    copy = HostCopy(buffers, pin)
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        copy.fill(spec, f.get_tensor)
    return copy


def host_copy_from_tensors(spec: AdapterSpec, tensors: dict[str, torch.Tensor], buffers: LoRABuffers,
                           pin: bool) -> HostCopy:
    """A HostCopy of an adapter already in memory (tensors under PEFT's keys)."""
    copy = HostCopy(buffers, pin)
    copy.fill(spec, lambda key: tensors[key])
    return copy


class HostTier:
    """name -> HostCopy within `capacity_bytes`, least recently used out first; thread-safe."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._copies: OrderedDict[str, HostCopy] = OrderedDict()
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._copies.values())

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._copies

    def names(self) -> list[str]:
        with self._lock:
            return list(self._copies)

    def get(self, name: str) -> HostCopy | None:
        """The copy (now most recently used) held against eviction until `put_back`, or None."""
        with self._lock:
            copy = self._copies.get(name)
            if copy is not None:
                self._copies.move_to_end(name)
                self._held[name] = self._held.get(name, 0) + 1
            return copy

    def put_back(self, name: str) -> None:
        with self._lock:
            n = self._held.get(name, 0) - 1
            if n <= 0:
                self._held.pop(name, None)
            else:
                self._held[name] = n

    def add(self, name: str, copy: HostCopy) -> bool:
        """Keep `copy`, dropping least recently used copies (not held) to make room. Returns
        False (and keeps nothing) when it cannot fit."""
        with self._lock:
            self._copies.pop(name, None)
            if copy.nbytes > self.capacity_bytes:
                return False
            used = sum(c.nbytes for c in self._copies.values())
            for old in list(self._copies):
                if used + copy.nbytes <= self.capacity_bytes:
                    break
                if old in self._held:
                    continue
                used -= self._copies.pop(old).nbytes
                self.evictions += 1
                log.debug("host tier: dropped %s", old)
            if used + copy.nbytes > self.capacity_bytes:
                return False
            self._copies[name] = copy
            return True

    def discard(self, name: str) -> None:
        with self._lock:
            self._copies.pop(name, None)
