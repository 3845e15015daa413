"""A step runs the LoRA kernels of the layer groups its adapters target, and no others: an
adapter that targets q and v only (PEFT's default for Llama) launches nothing for o, gate/up
and down. Outputs stay those of HF + peft (test_parity mixes these adapters in one batch).
A server that serves some projections only holds only their groups in its slots."""

from __future__ import annotations

import pytest

from loraplex.server import model as model_module
from loraplex.server.adapter_format import AdapterError
from loraplex.server.adapters import GROUPS, LoRABuffers, group_mask, projection_ranks, slot_groups
from loraplex.server.engine import LLMEngine
from loraplex.server.settings import ServerSettings

from .test_parity import prompts_for, run_mixed_batch


@pytest.fixture(scope="module")
def engine(hf_llama, llama_adapters) -> LLMEngine:
    return LLMEngine.from_settings(ServerSettings(
        model=str(hf_llama), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128, max_loras=4,
        max_lora_rank=16, lora_modules=[f"{n}={p}" for n, p in llama_adapters.items()]))


@pytest.mark.parametrize("names,want", [
    (["base"], set()),
    (["qv-r8"], {"qkv"}),
    (["mlp-rslora-r4", "base"], {"gate_up", "down"}),
    (["qv-r8", "patterns"], {"qkv", "o", "down"}),  # patterns: q, k, o, down
    (["qv-r8", "all-r16"], set(GROUPS)),
])
def test_a_step_launches_the_groups_its_adapters_target(engine, monkeypatch, names, want):
    group_of = {g.a.data_ptr(): name for layer in engine.lora.layers for name, g in layer.items()}
    launched = []
    real = model_module.add_lora

    def spy(y, x, lora_a, *args, **kw):
        launched.append(group_of[lora_a.data_ptr()])
        return real(y, x, lora_a, *args, **kw)

    monkeypatch.setattr(model_module, "add_lora", spy)
    run_mixed_batch(engine, prompts_for(names))
    assert set(launched) == want
    # Every step (a prefill, then decode steps) runs each wanted group in every layer.
    if want:
        assert len(launched) % (len(want) * engine.model.cfg.num_layers) == 0


def test_projection_ranks_and_group_mask_of_a_spec(engine):
    """The ranks a slot holds per projection, the model's per-group views of them, and the
    host's group mask agree with the spec."""
    for name in ("qv-r8", "patterns", "mlp-rslora-r4"):
        slot = engine.adapters.slot_of(name)
        spec = engine.adapters.table.entries[name].spec
        ranks = projection_ranks(spec)
        assert engine.lora.ranks[slot].tolist() == ranks
        assert engine.lora.group_masks[slot] == group_mask(ranks)
        assert engine.lora.group_ranks["qkv"][slot].tolist() == ranks[0:3]
        assert engine.lora.group_ranks["down"][slot].tolist() == ranks[6:7]
    #                                                            q  k  v  o  gate up down
    assert projection_ranks(engine.adapters.table.entries["qv-r8"].spec) == [8, 0, 8, 0, 0, 0, 0]
    assert projection_ranks(engine.adapters.table.entries["patterns"].spec) == [8, 8, 0, 4, 0, 0, 8]
    assert group_mask([8, 0, 8, 0, 0, 0, 0]) == 0b0001 and group_mask([8, 8, 0, 4, 0, 0, 8]) == 0b1011


def test_slot_groups_hold_whole_groups():
    assert slot_groups(["q_proj", "v_proj"]) == ("qkv",)
    assert slot_groups(["v_proj", "down_proj", "up_proj"]) == ("qkv", "gate_up", "down")
    assert slot_groups(list(GROUPS["o"]) + ["k_proj"]) == ("qkv", "o")


def test_a_server_of_q_and_v_adapters_holds_q_k_v_alone(hf_llama, llama_adapters, engine):
    """--lora-target-modules q_proj v_proj: slots hold the q/k/v group only (a fraction of a
    full slot's bytes, so more of them fit), outputs stay what a full slot gives, and an
    adapter with other projections is refused with the reason."""
    qv = LLMEngine.from_settings(ServerSettings(
        model=str(hf_llama), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128, max_loras=4,
        max_lora_rank=16, lora_target_modules=["q_proj", "v_proj"], lora_modules=[f"qv-r8={llama_adapters['qv-r8']}"]))
    assert qv.lora.groups == ("qkv",) and list(qv.lora.layers[0]) == ["qkv"]
    cfg = qv.model.cfg
    full = LoRABuffers.slot_bytes(cfg, 16, qv.dtype)
    assert qv.lora.nbytes() // qv.lora.num_slots == LoRABuffers.slot_bytes(cfg, 16, qv.dtype, ("qkv",)) < full / 2
    prompts = prompts_for(["base", "qv-r8"])
    assert run_mixed_batch(qv, prompts) == run_mixed_batch(engine, prompts)
    with pytest.raises(AdapterError, match="o_proj"):
        qv.adapters.load("all-r16", llama_adapters["all-r16"])


def test_an_adapter_the_slots_cannot_hold_is_refused_not_cut(hf_llama):
    """An adapter made in memory (no file check on the way) with projections outside the
    slots' groups is refused with the reason, not written without them."""
    from loraplex.server.adapters import AdapterId, random_adapter

    qv = LLMEngine.from_settings(ServerSettings(
        model=str(hf_llama), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, max_loras=2,
        max_lora_rank=16, lora_target_modules=["q_proj", "v_proj"]))
    spec, tensors = random_adapter(qv.model.cfg, 8, targets=("q_proj", "o_proj"), seed=1)
    for keep in (False, True):
        with pytest.raises(AdapterError, match="o_proj"):
            qv.adapters.install(AdapterId(f"x{keep}", "x", "memory"), spec, tensors, keep_host_copy=keep)
    assert qv.adapters.num_free == 2 and not qv.adapters.ready_slots() and not qv.adapters.table.entries
