"""How many GPU adapter slots to allocate: --max-loras, or as many as fit in free device memory.

Where it sits: once, at startup, before anything is requested. LLMEngine sizes the
LoRABuffers with `resolve_max_loras`; the adapter cache (adapter_cache.py) then pages
adapters through that fixed number of slots for the server's lifetime.

Running example (H200, Llama-3-8B weights and KV cache loaded, rank-16 slots)::

    resolve_max_loras(0, slot_bytes=84e6, cuda:0)   -> ~120 GB free -> 256 slots (the cap)
    resolve_max_loras(0, ..., cpu)                  -> 8 (AUTO_SLOTS_CPU)
    resolve_max_loras(32, ...)                      -> 32 (the flag wins)
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


def resolve_max_loras(setting: int, slot_bytes: int, device: torch.device) -> int:
    """--max-loras, or (0) the packing math over the device's free memory (8 on the CPU)."""
    if setting > 0:
        return setting
    if device.type != "cuda":
        return AUTO_SLOTS_CPU
    free, _ = torch.cuda.mem_get_info(device)
    slots = max_loras_from_memory(free, slot_bytes)
    log.info("--max-loras from free device memory: %d slots of %.1f MB (%.1f GB free)", slots,
             slot_bytes / 1e6, free / 1e9)
    return slots
