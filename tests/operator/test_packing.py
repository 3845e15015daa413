"""Packing math: adapter room and slots, table-driven, with the common sizing mistakes."""

import dataclasses
import datetime

import pytest

from loraplex.operator.packing import adapter_bytes, base_weight_bytes, module_shape, pack
from loraplex.operator.plan import build_plan
from loraplex.operator.specs import ALL_TARGET_MODULES, AdapterSpec, Architecture, BaseModelSpec, Memory, parse_quantity

LLAMA_3_8B = Architecture(hidden_size=4096, intermediate_size=14336, num_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=128256)
G, M = 10**9, 10**6


def base(memory: Memory, rank: int = 64, arch: Architecture | None = None,
         modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"), dtype: str = "float16") -> BaseModelSpec:
    return BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m/llama-3-8b", max_lora_rank=rank,
                         target_modules=modules, dtype=dtype, architecture=arch, memory=memory)


@pytest.mark.parametrize(("quantity", "expected"), [
    ("80Gi", 80 * 2**30), ("16G", 16 * G), ("40M", 40 * M), ("1.5Gi", 3 * 2**29), (1234, 1234), ("512", 512),
    ("2k", 2000), (None, None),
])
def test_quantities(quantity, expected):
    assert parse_quantity(quantity) == expected


@pytest.mark.parametrize("bad", ["80 GB", "-1", "1e9", "Gi", True])
def test_bad_quantities_are_refused(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)


# (memory, slots, reason, room)
CASES = {
    # The example: an 8B FP16 base of 16 GB, 40 GB left after it and the overhead,
    # 30 GB for the KV cache: 10 GB of adapter room, 250 adapters of 40 MB.
    "8b-fp16-example": (Memory(gpu_memory=80 * G, base_weights=16 * G, overhead=24 * G,
                               kv_cache_reserve=30 * G, adapter_bytes=40 * M), 250, "Packed", 10 * G),
    "room-not-a-multiple": (Memory(gpu_memory=80 * G, base_weights=16 * G, overhead=24 * G,
                                   kv_cache_reserve=30 * G, adapter_bytes=39 * M), 256, "Packed", 10 * G),
    "kv-reserve-eats-everything": (Memory(gpu_memory=80 * G, base_weights=16 * G, overhead=24 * G,
                                          kv_cache_reserve=40 * G, adapter_bytes=40 * M), 0, "NoRoom", 0),
    "room-smaller-than-one-adapter": (Memory(gpu_memory=80 * G, base_weights=16 * G, overhead=24 * G,
                                             kv_cache_reserve=40 * G - 10 * M, adapter_bytes=40 * M), 0, "NoRoom", 10 * M),
    "explicit-slots-win": (Memory(gpu_memory=1, base_weights=16 * G, slots=32), 32, "ExplicitSlots", None),
    "no-gpu-memory": (Memory(base_weights=16 * G, adapter_bytes=40 * M), 0, "SizeUnknown", None),
    "no-adapter-size": (Memory(gpu_memory=80 * G, base_weights=16 * G), 0, "SizeUnknown", None),
}


@pytest.mark.parametrize("case", CASES)
def test_packing_table(case):
    memory, slots, reason, room = CASES[case]
    packed = pack(base(memory))
    assert (packed.slots, packed.reason, packed.room_bytes) == (slots, reason, room)
    assert packed.message


def test_module_shapes_follow_gqa():
    assert module_shape(LLAMA_3_8B, "q_proj") == (4096, 4096)
    assert module_shape(LLAMA_3_8B, "k_proj") == (4096, 1024)
    assert module_shape(LLAMA_3_8B, "down_proj") == (14336, 4096)
    with pytest.raises(ValueError):
        module_shape(LLAMA_3_8B, "lm_head")


def test_llama_3_8b_sizes_from_architecture():
    # 8,030,261,248 parameters is Llama-3-8B's published count.
    assert base_weight_bytes(LLAMA_3_8B, 2) == 8_030_261_248 * 2
    # rank 16 on q,k,v,o: 27.3 MB; rank 8 on all seven modules: exactly 40 MiB.
    assert adapter_bytes(LLAMA_3_8B, ("q_proj", "k_proj", "v_proj", "o_proj"), 16, 2) == 27_262_976
    assert adapter_bytes(LLAMA_3_8B, ALL_TARGET_MODULES, 8, 2) == 40 * 2**20
    assert adapter_bytes(LLAMA_3_8B, ALL_TARGET_MODULES, 8, 4) == 80 * 2**20  # float32 doubles it


def test_base_weights_computed_when_not_given():
    memory = Memory(gpu_memory=80 * G, overhead=24 * G, kv_cache_reserve=30 * G)
    packed = pack(base(memory, rank=8, arch=LLAMA_3_8B, modules=ALL_TARGET_MODULES))
    assert packed.base_bytes == 8_030_261_248 * 2
    assert packed.room_bytes == 80 * G - 16_060_522_496 - 54 * G
    assert packed.slots == packed.room_bytes // (40 * 2**20) == 236


def test_slots_are_sized_for_max_rank_not_for_the_adapters():
    """Buffers hold maxLoraRank for every slot: rank 64 costs 8x the slots of rank 8."""
    memory = Memory(gpu_memory=80 * G, base_weights=16 * G, overhead=24 * G, kv_cache_reserve=30 * G)
    at_8 = pack(base(memory, rank=8, arch=LLAMA_3_8B, modules=ALL_TARGET_MODULES))
    at_64 = pack(base(memory, rank=64, arch=LLAMA_3_8B, modules=ALL_TARGET_MODULES))
    assert at_8.slot_bytes * 8 == at_64.slot_bytes
    assert (at_8.slots, at_64.slots) == (10 * G // (40 * 2**20), 10 * G // (320 * 2**20)) == (238, 29)


def test_unused_max_rank_is_called_out():
    """The common mistake: maxLoraRank 64 while every adapter is rank 8 costs 7/8 of the slots."""
    memory = Memory(gpu_memory=80 * G, base_weights=16 * G, overhead=24 * G, kv_cache_reserve=30 * G)
    spec = base(memory, rank=64, arch=LLAMA_3_8B, modules=ALL_TARGET_MODULES)
    adapters = [AdapterSpec(name=f"a{i}", namespace="ml", base_model="llama-3-8b", source="s3://a",
                            rank=8, target_modules=("q_proj", "v_proj")) for i in range(3)]
    plan = build_plan(spec, adapters, datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc))
    assert plan.slots == 29 and plan.max_rank_in_use == 8
    assert plan.hint is not None and "maxLoraRank 8 would give 238 slots instead of 29" in plan.hint
    right_sized = build_plan(dataclasses.replace(spec, max_lora_rank=8), adapters,
                             datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc))
    assert right_sized.slots == 238 and right_sized.hint is None


def test_slots_hold_whole_fused_groups_as_the_server_does():
    """The packing math sizes a slot as the server lays it out: the base's modules by fused
    group (server/adapters.py), so the slots the operator plans fit in the memory it counted."""
    import torch

    from loraplex.operator.packing import SLOT_GROUPS, slot_modules
    from loraplex.server.adapters import GROUPS, LoRABuffers, slot_groups
    from loraplex.server.config import named_shape

    assert SLOT_GROUPS == tuple(GROUPS.values())
    assert slot_modules(("q_proj", "v_proj")) == ("q_proj", "k_proj", "v_proj")
    assert slot_modules(("q_proj", "k_proj", "v_proj", "o_proj")) == ("q_proj", "k_proj", "v_proj", "o_proj")
    cfg = named_shape("llama-3-8b")  # the same shape as LLAMA_3_8B: no alignment padding
    for modules in (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ALL_TARGET_MODULES,
                    ("down_proj", "up_proj")):
        server = LoRABuffers.slot_bytes(cfg, 16, torch.bfloat16, slot_groups(modules))
        assert adapter_bytes(LLAMA_3_8B, slot_modules(modules), 16, 2) == server, modules
