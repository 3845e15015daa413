"""How many adapters fit on one GPU next to the base: the packing math.

    adapter room = GPU memory - base weights - KV cache - overhead
    slots        = adapter room // bytes of one slot at maxLoraRank (slot_modules)

The KV cache is what the server will allocate, `serving.engine.maxNumSeqs` rows of
`maxModelLen` tokens (kv_cache_bytes, when the architecture is known), or
`memory.kvCacheReserve` if that is larger (or the architecture unknown).

Every slot is sized for the largest rank the buffers hold (`lora_a: [slots, R, in]`,
`lora_b: [slots, out, R]` per target module and layer), so a rank-8 adapter in a rank-64
buffer costs as much as a rank-64 one. A slot holds the base's target modules by the
server's fused groups (`slot_modules`): q, k and v together, gate and up together, o and
down alone, so a base that allows q_proj and v_proj pays for k_proj too, and nothing for
o, gate, up or down (the server is told the same modules: `--lora-target-modules`). Running example, an 8B base in FP16:

    gpuMemory 80G, baseWeights 16G, overhead 24G  -> 40G left
    kvCacheReserve 30G                            -> 10G adapter room
    adapterBytes 40M                              -> 250 slots

Byte sizes come from the spec when given (`memory.baseWeights`, `memory.adapterBytes`),
otherwise from the base's `architecture`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from loraplex.operator.specs import Architecture, BaseModelSpec


def module_shape(arch: Architecture, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one target module in one layer.

    Llama-3-8B (hidden 4096, 32 heads, 8 kv heads, head_dim 128, intermediate 14336):
    q_proj (4096, 4096), k_proj (4096, 1024), o_proj (4096, 4096), down_proj (14336, 4096).
    """
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q_width = arch.num_attention_heads * arch.head_dim
    kv_width = arch.num_key_value_heads * arch.head_dim
    shapes = {
        "q_proj": (hidden, q_width),
        "k_proj": (hidden, kv_width),
        "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    try:
        return shapes[module]
    except KeyError:
        raise ValueError(f"unknown target module {module!r}") from None


def adapter_bytes(arch: Architecture, modules: Iterable[str], rank: int, dtype_bytes: int) -> int:
    """Bytes of one adapter: per layer and module, A is [rank, in] and B is [out, rank]."""
    per_layer = sum(rank * sum(module_shape(arch, module)) for module in set(modules))
    return per_layer * arch.num_layers * dtype_bytes


# The projections the server fuses into one LoRA call each, and holds in its slots as a
# whole (server/adapters.py: GROUPS; not imported: the operator does not depend on torch).
SLOT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                                             ("down_proj",))


def slot_modules(modules: Iterable[str]) -> tuple[str, ...]:
    """The modules a server slot holds for adapters of `modules`: every module of a fused group
    one of them is in. E.g. (q_proj, v_proj) -> (q_proj, k_proj, v_proj)."""
    modules = set(modules)
    return tuple(m for group in SLOT_GROUPS if modules & set(group) for m in group)


def kv_cache_bytes(arch: Architecture, rows: int, max_len: int, dtype_bytes: int) -> int:
    """K and V of `rows` sequences of `max_len` tokens, every layer: the server's preallocated
    cache. Llama-3-8B, bf16, 16 rows of 2048: 2 * 32 * 8 * 128 * 2 * 16 * 2048 = 4.29 GB."""
    return 2 * arch.num_layers * arch.num_key_value_heads * arch.head_dim * dtype_bytes * rows * max_len


def kv_bytes(base: BaseModelSpec) -> int:
    """The KV cache the packing math reserves for `base`'s servers (module docstring)."""
    reserve = base.memory.kv_cache_reserve
    if base.architecture is None:
        return reserve
    engine = base.serving.engine
    return max(reserve, kv_cache_bytes(base.architecture, engine.max_num_seqs, engine.max_model_len,
                                       base.dtype_bytes))


def base_weight_bytes(arch: Architecture, dtype_bytes: int) -> int:
    """Bytes of the base weights: embeddings, attention, MLP, norms (and an untied LM head)."""
    hidden = arch.hidden_size
    linear = sum(
        fan_in * fan_out
        for fan_in, fan_out in (module_shape(arch, m) for m in
                                ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    )
    per_layer = linear + 2 * hidden  # two RMSNorm weights
    embeddings = arch.vocab_size * hidden * (1 if arch.tie_word_embeddings else 2)
    params = arch.num_layers * per_layer + embeddings + hidden  # final norm
    return params * dtype_bytes


# The largest integer a status field holds: the API server's int64, which refuses a write
# past it (and the operator would try that write again for ever).
INT64_MAX = 2**63 - 1


def out_of_range(base: BaseModelSpec) -> str | None:
    """Why a figure of `base`'s packing math would pass INT64_MAX bytes, or None: one slot at
    maxLoraRank (status.slotBytes), and unless memory.slots skips the math, the base weights and
    the KV cache computed from the architecture and serving.engine, and what the base needs
    beside its adapters (base weights + KV cache + overhead; status.adapterRoomBytes is gpuMemory
    less that). The schema's integers have no maximum; no GPU has such memory anyway.

        hiddenSize 2**62 -> "one adapter slot at maxLoraRank 16 is 3.1e+22 bytes, past the 2^63-1 ..."
    """
    figures: list[tuple[str, int | None, str]] = [
        (f"one adapter slot at maxLoraRank {base.max_lora_rank}", slot_bytes_at(base, base.max_lora_rank),
         "architecture, maxLoraRank and targetModules")]
    arch, mem = base.architecture, base.memory
    if mem.slots is None:
        weights = mem.base_weights
        if weights is None and arch is not None and arch.vocab_size:
            weights = base_weight_bytes(arch, base.dtype_bytes)
            figures.append(("the base weights computed from the architecture", weights,
                            "architecture, or set memory.baseWeights"))
        kv = kv_bytes(base)
        figures += [("the KV cache of serving.engine (maxNumSeqs x maxModelLen)", kv,
                     "serving.engine and architecture"),
                    ("base weights + KV cache + overhead", (weights or 0) + kv + mem.overhead, "memory")]
    for what, value, check in figures:
        if value is not None and value > INT64_MAX:
            return (f"{what} is {value:.2g} bytes, past the 2^63-1 an integer of the status holds"
                    f" (no GPU has that memory): check {check}")
    return None


@dataclasses.dataclass(frozen=True)
class Packing:
    """The outcome of the packing math for one base. `slots == 0` comes with a reason."""

    slots: int
    slot_bytes: int | None  # bytes of one slot at maxLoraRank; None if unknown
    room_bytes: int | None  # adapter room; None with an explicit slot count
    base_bytes: int | None
    reason: str  # CamelCase, for a condition: "Packed", "ExplicitSlots", "NoRoom", ...
    message: str


def slot_bytes_at(base: BaseModelSpec, rank: int) -> int | None:
    """Bytes of one slot sized for `rank`; the spec's adapterBytes is taken as sized for maxLoraRank."""
    if base.memory.adapter_bytes is not None:
        return base.memory.adapter_bytes * rank // base.max_lora_rank
    if base.architecture is not None:
        return adapter_bytes(base.architecture, slot_modules(base.target_modules), rank, base.dtype_bytes)
    return None


def pack(base: BaseModelSpec, rank: int | None = None) -> Packing:
    """Slots for `base`, with buffers sized for `rank` (default: its maxLoraRank)."""
    rank = base.max_lora_rank if rank is None else rank
    mem = base.memory
    slot = slot_bytes_at(base, rank)
    if mem.slots is not None:
        return Packing(mem.slots, slot, None, mem.base_weights, "ExplicitSlots",
                       f"{mem.slots} slots set in spec.memory.slots")

    base_bytes = mem.base_weights
    if base_bytes is None and base.architecture is not None and base.architecture.vocab_size:
        base_bytes = base_weight_bytes(base.architecture, base.dtype_bytes)
    missing = [what for what, value in (
        ("memory.gpuMemory", mem.gpu_memory),
        ("memory.baseWeights (or architecture with vocabSize)", base_bytes),
        ("memory.adapterBytes (or architecture)", slot),
    ) if value is None]
    if missing:
        return Packing(0, slot, None, base_bytes, "SizeUnknown",
                       "cannot size slots without " + ", ".join(missing) + " (or set memory.slots)")
    assert mem.gpu_memory is not None and base_bytes is not None and slot is not None

    kv = kv_bytes(base)
    room = mem.gpu_memory - base_bytes - kv - mem.overhead
    if room <= 0:
        return Packing(0, slot, room, base_bytes, "NoRoom",
                       f"no adapter room: GPU {_gb(mem.gpu_memory)} - base {_gb(base_bytes)}"
                       f" - KV {_gb(kv)} - overhead {_gb(mem.overhead)}"
                       f" = {_gb(room)}")
    slots = room // slot if slot > 0 else 0
    if slots == 0:
        return Packing(0, slot, room, base_bytes, "NoRoom",
                       f"adapter room {_gb(room)} is smaller than one adapter at rank {rank}"
                       f" ({_gb(slot)})")
    return Packing(slots, slot, room, base_bytes, "Packed",
                   f"{slots} slots of {_gb(slot)} (rank {rank}) in {_gb(room)} adapter room")


def _gb(n: int) -> str:
    """Bytes for a message, decimal like the examples: 10000000000 -> '10.0 GB'."""
    if abs(n) >= 10**9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB"
