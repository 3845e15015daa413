"""How many GPU adapter slots to allocate: --max-loras, or as many as fit in free device memory
(or in what --gpu-memory-utilization leaves).

Where it sits: once, at startup, before anything is requested. LLMEngine sizes the
LoRABuffers with `resolve_max_loras`; the adapter cache (adapter_cache.py) then pages
adapters through that fixed number of slots for the server's lifetime.

Running example (H200, Llama-3-8B weights and KV cache loaded, rank-16 slots)::

    resolve_max_loras(0, slot_bytes=84e6, cuda:0)   -> ~120 GB free -> 256 slots (the cap)
    resolve_max_loras(0, ..., cpu)                  -> 8 (AUTO_SLOTS_CPU)
    resolve_max_loras(32, ...)                      -> 32 (the flag wins)
    resolve_max_loras(0, ..., cuda:0, 0.3)          -> 0.3 x 141 GB - 20 GB in use - 2 GiB
                                                       = 20.2 GB -> 239 slots (--gpu-memory-utilization)
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

AUTO_SLOTS_CPU = 8


def max_loras_from_memory(free_bytes: int, slot_bytes: int, *, fraction: float = 0.8,
                          headroom_bytes: int = 2 << 30, cap: int = 256) -> int:
    """Slots that fit in `fraction` of the device memory left after weights and KV cache, less
    `headroom_bytes` for activations and CUDA graphs; at least 1, at most `cap`.

    Example: 120 GB free, rank-16 Llama-3-8B slots of 84 MB -> min(256, 0.8 * 117.9e9 / 84e6) = 256."""
    room = max(0, free_bytes - headroom_bytes) * fraction
    return max(1, min(cap, int(room // slot_bytes)))


def memory_budget(free: int, total: int, utilization: float) -> int:
    """What --gpu-memory-utilization leaves to allocate: `utilization` of the device's `total`
    bytes, less those in use (total - free: this process's so far, and other processes'),
    at most what is free. Example: 0.5 of 141 GB with 20 GB in use -> 50.5 GB."""
    return max(0, min(free, int(utilization * total) - (total - free)))


def resolve_max_loras(setting: int, slot_bytes: int, device: torch.device, utilization: float | None = None) -> int:
    """--max-loras, or (0) the packing math over the device's free memory (8 on the CPU); with
    `utilization` (--gpu-memory-utilization), over what that fraction of the device's memory
    leaves (all of it, less the headroom)."""
    if setting > 0:
        return setting
    if device.type != "cuda":
        return AUTO_SLOTS_CPU
    free, total = torch.cuda.mem_get_info(device)
    if utilization is None:
        slots = max_loras_from_memory(free, slot_bytes)
        log.info("--max-loras from free device memory: %d slots of %.1f MB (%.1f GB free)", slots,
                 slot_bytes / 1e6, free / 1e9)
        return slots
    room = memory_budget(free, total, utilization)
    slots = max_loras_from_memory(room, slot_bytes, fraction=1.0)
    log.info("--max-loras from --gpu-memory-utilization %g: %d slots of %.1f MB (%.1f GB left of it)", utilization,
             slots, slot_bytes / 1e6, room / 1e9)
    return slots
