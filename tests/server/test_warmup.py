"""The start-up warm-up (DecodeRunner.warm_up): it runs every planned decode step and leaves
no trace in what the engine then generates. On the CPU it is a no-op unless forced, since it
exists to compile CUDA kernels; here it is forced through the eager torch path."""

from __future__ import annotations

from loraplex.server.batch import warmup_plan
from loraplex.server.engine import LLMEngine
from loraplex.server.settings import ServerSettings

from .test_parity import prompts_for, run_mixed_batch


def _engine(hf_llama, llama_adapters) -> LLMEngine:
    return LLMEngine.from_settings(ServerSettings(
        model=str(hf_llama), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128, max_loras=4,
        max_lora_rank=16, kv_block=32, lora_modules=[f"{n}={p}" for n, p in llama_adapters.items()]))


def test_warm_up_is_a_no_op_without_cuda_graphs(hf_llama, llama_adapters):
    assert _engine(hf_llama, llama_adapters).decoder.warm_up() == 0


def test_warm_up_runs_its_plan_and_leaves_no_trace(hf_llama, llama_adapters):
    names = ["base", *sorted(llama_adapters)]
    want = run_mixed_batch(_engine(hf_llama, llama_adapters), prompts_for(names))

    engine = _engine(hf_llama, llama_adapters)
    decoder = engine.decoder
    decoder.use_graphs = True  # what a CUDA engine does; warm_up itself runs eagerly
    steps = decoder.warm_up()
    decoder.use_graphs = False
    # Batch buckets 1, 2, 4, 8; 4 slots; one KV bound (max_len 128). Adapter steps once for
    # every held group, and once for each other mask of the adapters loaded at start.
    plan = warmup_plan(decoder.buckets, 4)
    masks = decoder.warmup_masks()
    loaded = {engine.lora.group_masks[engine.adapters.slot_of(n)] for n in llama_adapters}
    assert masks[0] == engine.lora.held_mask and set(masks) == loaded | {engine.lora.held_mask}
    assert len(masks) == len(set(masks)) > 1  # the fixture's adapters target different groups
    with_adapters = sum(1 for _, a in plan if a)
    assert steps == len(plan) - with_adapters + with_adapters * len(masks) > 0
    assert run_mixed_batch(engine, prompts_for(names)) == want


def test_prefill_warmup_plan_covers_every_step_with_its_smallest():
    """Every (rows, adapter bucket) a prefill of at most 300 rows can have maps to a planned
    step with the same launch key, and that step is the smallest with it."""
    from loraplex.kernels.batch import default_block_m, max_blocks
    from loraplex.server.batch import adapter_bucket, prefill_warmup_plan

    slots = 6

    def key(rows, adapters):  # a stand-in for the model's: some function of the grid
        block_m = default_block_m(rows)
        blocks = max_blocks(rows, min(adapters, slots), block_m)
        return block_m, min(16, -(-528 // blocks))

    plan = prefill_warmup_plan(300, slots, key)
    want: dict = {}
    for rows in range(1, 301):
        for adapters in sorted({adapter_bucket(n) for n in range(1, min(rows, slots) + 1)}):
            want.setdefault(key(rows, adapters), (rows, adapters))
    assert sorted(plan) == sorted(want.values())
    assert len({key(*step) for step in plan}) == len(plan)


def test_warm_up_prefill_runs_its_plan_and_leaves_no_trace(hf_llama, llama_adapters):
    from loraplex.kernels.batch import default_block_m, max_blocks
    from loraplex.server.batch import prefill_warmup_plan, warm_up_prefill

    names = ["base", *sorted(llama_adapters)]
    want = run_mixed_batch(_engine(hf_llama, llama_adapters), prompts_for(names))

    engine = _engine(hf_llama, llama_adapters)
    assert engine.model.lora_launch_key(64, 4) is None  # no Triton kernel on the CPU
    assert engine.warm_up() == (0, 0)
    def grid(rows, adapters):  # what a CUDA model's key is a function of
        block_m = default_block_m(rows)
        return block_m, max_blocks(rows, min(adapters, 4), block_m)

    engine.model.lora_launch_key = grid
    # 300 rows span 3 KV rows of 127 positions.
    runs = warm_up_prefill(engine.model, 300)
    assert runs == 1 + len(prefill_warmup_plan(300, 4, engine.model.lora_launch_key)) > 20  # + one base-only
    assert run_mixed_batch(engine, prompts_for(names)) == want


def test_base_warmup_rows_cover_each_gemm_configuration(hf_llama, llama_adapters):
    """With kernels.linear's GEMM (steps of up to 64 rows on a GPU), a base-only prefill runs
    for each of its configurations: tiles of 16, 32 and 64 rows. Without it, one of 16 rows."""
    from loraplex.server.batch import base_warmup_rows
    from loraplex.server.model import TRITON_GEMM_MAX_TOKENS

    model = _engine(hf_llama, llama_adapters).model
    assert base_warmup_rows(model, 300) == [16]
    model.triton_gemm = True  # what a CUDA model with the Triton backend does
    assert base_warmup_rows(model, 300) == [16, 17, 33]
    assert base_warmup_rows(model, 20) == [16, 17]
    assert base_warmup_rows(model, 8) == [8]
    keys = {model.gemm_key(rows) for rows in range(1, TRITON_GEMM_MAX_TOKENS + 1)}
    assert len(keys) == 3 and None not in keys and model.gemm_key(TRITON_GEMM_MAX_TOKENS + 1) is None


def test_triton_gemm_is_the_default_only_where_it_overlaps(monkeypatch):
    """kernels.linear runs the projections by default only on GPUs with programmatic
    dependent launch (compute capability 9.0 and later), which its overlap needs; on older
    ones cuBLAS then add_lora (kernels.linear's configurations were tuned on an H200)."""
    import torch

    from loraplex.server import model

    assert not model._overlaps(torch.device("cpu"))
    for capability, expected in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert model._overlaps(torch.device("cuda", 0)) is expected
