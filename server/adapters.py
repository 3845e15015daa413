"""Adapter slots: the device buffers that hold resident adapters, and how a slot is written.

Buffers, per layer and per fused group (S slots, R = max LoRA rank)::

    qkv     a [S, 3R, hidden]  b [S, q+2kv, R]   scaling [S, 3]   (slices q, k, v)
    o       a [S, R, q]        b [S, hidden, R]  scaling [S, 1]
    gate_up a [S, 2R, hidden]  b [S, 2*inter, R] scaling [S, 2]   (slices gate, up)
    down    a [S, R, inter]    b [S, hidden, R]  scaling [S, 1]
    ranks   int32 [S, 7]: per projection (PROJECTIONS: q, k, v, o, gate, up, down), the
            adapter's largest rank for it in any layer (the kernels skip rank rows past it), 0
            where it does not target it; each group hands add_lora its columns ([S, n], one rank
            per slice). PEFT's default for Llama targets q_proj and v_proj only: for such an
            adapter k is skipped inside the fused q/k/v call, and the o, gate/up and down
            groups are not launched for its rows at all

The kernels read a projection's rank rows of A and columns of B and nothing past them
(SlotLayout.read_mask), and an untargeted projection has rank 0 and scaling 0: what lies
past a rank is never read. `LoRABuffers.write` zero-pads all the same; a HostCopy
(host_tier.py) writes only what is read.

Memory is slot-major: all of one slot's A and B (every layer and group, in the order
above, each view 128-byte aligned) are one contiguous run of `flat` [S, slot_elems], and its
scalings one row of `scales` [S, n_scales]; the per-group tensors are strided views of
them (stride(0) = slot_elems). A HostCopy (host_tier.py) has the same layout, so loading
an adapter into a slot is a few DMAs (flat, scales, ranks), with no scatter.

Which adapter sits in which slot, and when it is loaded or evicted, is the adapter cache's
business (adapter_cache.py); this module only owns the buffers' layout and how one
adapter's tensors are written into a slot.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .adapter_format import AdapterError, AdapterSpec
from .config import ModelConfig


# group -> the projections it fuses, in slice order
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
# Every projection, group by group: the columns of LoRABuffers.ranks.
PROJECTIONS = tuple(proj for projs in GROUPS.values() for proj in projs)
# group -> its projections' columns [lo, hi) in PROJECTIONS
GROUP_COLUMNS = {name: (PROJECTIONS.index(projs[0]), PROJECTIONS.index(projs[-1]) + 1)
                 for name, projs in GROUPS.items()}


def slot_groups(modules) -> tuple[str, ...]:
    """The groups (GROUPS order) a slot holds for adapters of `modules`: every group with one
    of them. A group is held whole (q/v adapters hold all of q/k/v: one fused call), the
    others not at all."""
    modules = set(modules)
    return tuple(name for name, projs in GROUPS.items() if modules & set(projs))


def check_held(spec: AdapterSpec, groups: tuple[str, ...]) -> None:
    """Raise AdapterError if `spec` targets a projection outside `groups` (what slots hold):
    its weights would have nowhere to go."""
    held = {proj for name in groups for proj in GROUPS[name]}
    missing = sorted({m.proj for m in spec.modules} - held)
    if missing:
        raise AdapterError(f"targets {missing}, which these slots do not hold (--lora-target-modules)")


def group_mask(ranks: list[int]) -> int:
    """From an adapter's projection ranks (PROJECTIONS order): bit i set where group i
    (GROUPS order) has a projection of non-zero rank, i.e. the groups the adapter targets."""
    return sum(1 << i for i, (lo, hi) in enumerate(GROUP_COLUMNS.values()) if max(ranks[lo:hi]) > 0)


def projection_ranks(spec: AdapterSpec) -> list[int]:
    """Per projection (PROJECTIONS order), the largest rank `spec` gives it in any layer; 0
    for a projection it does not target, whose weights the kernels then never read."""
    ranks = dict.fromkeys(PROJECTIONS, 0)
    for m in spec.modules:
        ranks[m.proj] = max(ranks[m.proj], m.rank)
    return list(ranks.values())


# View offsets inside a slot are multiples of this many elements (128 bytes in bf16), so
# every view is aligned for the kernels' vectorised loads.
ALIGN_ELEMS = 64


@dataclass(frozen=True)
class GroupLayout:
    """Where one (layer, group)'s tensors sit inside a slot (in elements / scale entries)."""

    a_off: int
    a_shape: tuple[int, int]  # [n*R, in]
    b_off: int
    b_shape: tuple[int, int]  # [sum(slices), R]
    s_off: int
    slices: tuple[int, ...]


@dataclass(frozen=True)
class SlotLayout:
    """One slot's layout: layers[l][group] -> GroupLayout; slot_elems and n_scales in all."""

    layers: tuple[dict[str, GroupLayout], ...]
    slot_elems: int
    n_scales: int

    @classmethod
    def of(cls, cfg: ModelConfig, max_rank: int, groups: tuple[str, ...] = tuple(GROUPS)) -> "SlotLayout":
        """The layout of a slot that holds `groups` (slot_groups) of every layer."""
        shapes = cfg.module_shapes()
        align = lambda n: -(-n // ALIGN_ELEMS) * ALIGN_ELEMS  # noqa: E731
        layers, off, s_off = [], 0, 0
        held = [(name, projs) for name, projs in GROUPS.items() if name in groups]
        for _ in range(cfg.num_layers):
            layer = {}
            for name, projs in held:
                in_f = shapes[projs[0]][0]
                slices = tuple(shapes[p][1] for p in projs)
                a_shape, b_shape = (len(projs) * max_rank, in_f), (sum(slices), max_rank)
                a_off = off
                b_off = align(a_off + a_shape[0] * a_shape[1])
                off = align(b_off + b_shape[0] * b_shape[1])
                layer[name] = GroupLayout(a_off, a_shape, b_off, b_shape, s_off, slices)
                s_off += len(projs)
            layers.append(layer)
        return cls(tuple(layers), off, s_off)

    def read_mask(self, ranks: list[int]) -> torch.Tensor:
        """bool [slot_elems]: what the kernels read of a slot holding an adapter of these
        projection ranks (projection_ranks): each projection's rank rows of A and rank
        columns of B, in every layer. Nothing else in a slot is read, so nothing else needs
        to be written (HostCopy.fill)."""
        rank = dict(zip(PROJECTIONS, ranks))
        mask = torch.zeros(self.slot_elems, dtype=torch.bool)
        for groups in self.views(mask, torch.zeros(self.n_scales)):
            for name, g in groups.items():
                off = 0
                for i, (proj, width) in enumerate(zip(GROUPS[name], g.slices)):
                    r_max = g.a.shape[0] // len(g.slices)
                    g.a[i * r_max: i * r_max + rank[proj]] = True
                    g.b[off: off + width, : rank[proj]] = True
                    off += width
        return mask

    def views(self, flat: torch.Tensor, scales: torch.Tensor) -> list[dict[str, "LoRAGroup"]]:
        """Per-group views of `flat` [..., slot_elems] and `scales` [..., n_scales] (a leading
        slot dimension, or none for one slot)."""
        lead = flat.shape[:-1]
        return [{name: LoRAGroup(
                    a=flat[..., g.a_off: g.a_off + g.a_shape[0] * g.a_shape[1]].view(*lead, *g.a_shape),
                    b=flat[..., g.b_off: g.b_off + g.b_shape[0] * g.b_shape[1]].view(*lead, *g.b_shape),
                    scaling=scales[..., g.s_off: g.s_off + len(g.slices)], slices=g.slices)
                 for name, g in groups.items()} for groups in self.layers]


@dataclass
class LoRAGroup:
    a: torch.Tensor  # [S, n*R, in] (a strided view of LoRABuffers.flat)
    b: torch.Tensor  # [S, sum(slices), R]
    scaling: torch.Tensor  # float32 [S, n]
    slices: tuple[int, ...]  # output columns of each fused projection


class LoRABuffers:
    """Preallocated device buffers for `num_slots` adapters of rank <= `max_rank`, holding the
    layer groups `groups` (default all: see slot_groups; a server that serves q/v adapters
    only holds q/k/v alone, a quarter of the bytes of Llama-3-8B's full slot)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 groups: tuple[str, ...] = tuple(GROUPS)):
        self.cfg = cfg
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.groups = tuple(name for name in GROUPS if name in groups)
        self.layout = SlotLayout.of(cfg, max_rank, self.groups)
        self.flat = torch.zeros(num_slots, self.layout.slot_elems, device=device, dtype=dtype)
        self.scales = torch.zeros(num_slots, self.layout.n_scales, device=device, dtype=torch.float32)
        self.layers: list[dict[str, LoRAGroup]] = self.layout.views(self.flat, self.scales)
        self.ranks = torch.zeros(num_slots, len(PROJECTIONS), device=device, dtype=torch.int32)
        # group -> int32 [S, n] (its projections' columns of `ranks`): what the model hands
        # add_lora for that group, one rank per slice
        self.group_ranks = {name: self.ranks[:, lo:hi] for name, (lo, hi) in GROUP_COLUMNS.items()}
        # The same on the host, per slot as a bit mask (group_mask): the step reads which groups
        # its rows' adapters target without a device sync, and skips the others' launches.
        self.group_masks = [0] * num_slots
        # Per slot, how many times its weights were written (a load, or cleared), and what
        # identifies the bytes written where that is known (HostCopy.content: the files a copy
        # was read from), else None: what a prefix's K/V was computed under is the content,
        # which outlives the slot (an adapter paged out and back in finds its prefixes), else
        # (slot, the count) (LLMEngine.prefix_key).
        self.writes = [0] * num_slots
        self.contents: list[Hashable | None] = [None] * num_slots

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one of these slots: the groups held, at max rank (slot_bytes)."""
        return self.layout.slot_elems * self.flat.element_size()

    @staticmethod
    def slot_bytes(cfg: ModelConfig, max_rank: int, dtype: torch.dtype, groups: tuple[str, ...] = tuple(GROUPS)) -> int:
        """Device bytes of one slot (A and B of the groups' projections at max rank, aligned)."""
        return SlotLayout.of(cfg, max_rank, groups).slot_elems * torch.empty((), dtype=dtype).element_size()

    def write(self, slot: int, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Copy an adapter's tensors (keys as in its safetensors) into `slot`, zero-padded."""
        check_held(spec, self.groups)
        r_max = self.max_rank
        self.flat[slot].zero_()
        self.scales[slot].zero_()
        for layer, groups in enumerate(self.layers):
            for name, g in groups.items():
                projs = GROUPS[name]
                off = 0
                for i, (proj, width) in enumerate(zip(projs, g.slices)):
                    m = spec.module(layer, proj)
                    if m is not None:
                        a, b = tensors[m.key_a], tensors[m.key_b]  # [r, in], [out, r]
                        g.a[slot, i * r_max: i * r_max + m.rank].copy_(a, non_blocking=True)
                        g.b[slot, off: off + width, : m.rank].copy_(b, non_blocking=True)
                        g.scaling[slot, i] = m.scaling
                    off += width
        ranks = projection_ranks(spec)
        self.ranks[slot] = torch.tensor(ranks, dtype=torch.int32)
        self.group_masks[slot] = group_mask(ranks)
        self.writes[slot] += 1
        self.contents[slot] = None

    @property
    def held_mask(self) -> int:
        """The group mask (group_mask) of every group these slots hold: what a step of
        adapters on all of them runs."""
        return sum(1 << i for i, name in enumerate(GROUPS) if name in self.groups)

    def groups_of(self, slots) -> int:
        """The groups (a group_mask) that any of `slots` (-1: none) targets."""
        mask = 0
        for s in slots:
            if s >= 0:
                mask |= self.group_masks[s]
        return mask

    def clear(self, slot: int) -> None:
        self.scales[slot].zero_()
        self.ranks[slot] = 0
        self.group_masks[slot] = 0
        self.writes[slot] += 1
        self.contents[slot] = None


@dataclass(frozen=True)
class AdapterId:
    """An adapter's identity: its name in the API and a digest of its weights file."""

    name: str
    digest: str
    uri: str


def random_adapter(cfg: ModelConfig, rank: int, targets: tuple[str, ...] = GROUPS["qkv"] + GROUPS["o"]
                   + GROUPS["gate_up"] + GROUPS["down"], alpha: float | None = None, seed: int = 0,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   ) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """A random adapter (spec + tensors under PEFT's keys) made in memory, for benchmarks:
    A ~ U(-1/sqrt(in), 1/sqrt(in)), B ~ U(-1/sqrt(r), 1/sqrt(r)), like nn.Linear's init."""
    from .adapter_format import ModuleLoRA, peft_key

    gen = torch.Generator(device=device).manual_seed(seed)
    alpha = float(alpha if alpha is not None else rank)
    shapes = cfg.module_shapes()
    tensors, modules, nbytes = {}, [], 0
    for layer in range(cfg.num_layers):
        for proj in targets:
            in_f, out_f = shapes[proj]
            ka, kb = peft_key(layer, proj, "A"), peft_key(layer, proj, "B")
            a = torch.rand(rank, in_f, generator=gen, device=device, dtype=dtype).sub_(0.5).mul_(2 / in_f ** 0.5)
            b = torch.rand(out_f, rank, generator=gen, device=device, dtype=dtype).sub_(0.5).mul_(2 / rank ** 0.5)
            tensors[ka], tensors[kb] = a, b
            nbytes += (a.numel() + b.numel()) * a.element_size()
            modules.append(ModuleLoRA(layer, proj, rank, alpha, alpha / rank, ka, kb))
    spec = AdapterSpec(path="<memory>", rank=rank, lora_alpha=alpha, use_rslora=False,
                       target_modules=tuple(targets), modules=tuple(modules), max_rank=rank, nbytes=nbytes)
    return spec, tensors
