"""Adapter slots: the device buffers that hold resident adapters, and how a slot is written.

Buffers, per layer and per fused group (S slots, R = max LoRA rank)::

    qkv     a [S, 3R, hidden]  b [S, q+2kv, R]   scaling [S, 3]   (slices q, k, v)
    o       a [S, R, q]        b [S, hidden, R]  scaling [S, 1]
    gate_up a [S, 2R, hidden]  b [S, 2*inter, R] scaling [S, 2]   (slices gate, up)
    down    a [S, R, inter]    b [S, hidden, R]  scaling [S, 1]
    ranks   int32 [S]: the adapter's largest module rank (the kernel skips columns past it)

An adapter of rank r < R, or one that skips a projection, is written zero-padded: padded
rows/columns and untargeted projections (scaling 0, zero weights) add nothing.

Which adapter sits in which slot, and when it is loaded or evicted, is the adapter cache's
business (adapter_cache.py); this module only owns the buffers' layout and how one
adapter's tensors are written into a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapter_format import AdapterSpec
from .config import ModelConfig


# group -> the projections it fuses, in slice order
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass
class LoRAGroup:
    a: torch.Tensor  # [S, n*R, in]
    b: torch.Tensor  # [S, sum(slices), R]
    scaling: torch.Tensor  # float32 [S, n]
    slices: tuple[int, ...]  # output columns of each fused projection


class LoRABuffers:
    """Preallocated device buffers for `num_slots` adapters of rank <= `max_rank`."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        shapes = cfg.module_shapes()
        self.layers: list[dict[str, LoRAGroup]] = []
        for _ in range(cfg.num_layers):
            groups = {}
            for name, projs in GROUPS.items():
                in_f = shapes[projs[0]][0]
                slices = tuple(shapes[p][1] for p in projs)
                groups[name] = LoRAGroup(
                    a=torch.zeros(num_slots, len(projs) * max_rank, in_f, device=device, dtype=dtype),
                    b=torch.zeros(num_slots, sum(slices), max_rank, device=device, dtype=dtype),
                    scaling=torch.zeros(num_slots, len(projs), device=device, dtype=torch.float32),
                    slices=slices)
            self.layers.append(groups)
        self.ranks = torch.zeros(num_slots, device=device, dtype=torch.int32)

    def nbytes(self) -> int:
        return sum(g.a.numel() * g.a.element_size() + g.b.numel() * g.b.element_size()
                   for layer in self.layers for g in layer.values())

    @staticmethod
    def slot_bytes(cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> int:
        """Device bytes of one slot (A and B of all seven projections at max rank)."""
        per_layer = sum(i + o for i, o in cfg.module_shapes().values()) * max_rank
        return per_layer * cfg.num_layers * torch.empty((), dtype=dtype).element_size()

    def write(self, slot: int, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Copy an adapter's tensors (keys as in its safetensors) into `slot`, zero-padded."""
        r_max = self.max_rank
        for layer, groups in enumerate(self.layers):
            for name, projs in GROUPS.items():
                g = groups[name]
                g.a[slot].zero_()
                g.b[slot].zero_()
                g.scaling[slot].zero_()
                off = 0
                for i, (proj, width) in enumerate(zip(projs, g.slices)):
                    m = spec.module(layer, proj)
                    if m is not None:
                        a, b = tensors[m.key_a], tensors[m.key_b]  # [r, in], [out, r]
                        g.a[slot, i * r_max: i * r_max + m.rank].copy_(a, non_blocking=True)
                        g.b[slot, off: off + width, : m.rank].copy_(b, non_blocking=True)
                        g.scaling[slot, i] = m.scaling
                    off += width
        self.ranks[slot] = spec.max_rank

    def clear(self, slot: int) -> None:
        for groups in self.layers:
            for g in groups.values():
                g.scaling[slot].zero_()
        self.ranks[slot] = 0


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
