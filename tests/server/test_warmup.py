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
    # KV lengths 32, 64, 128 (max_len 128); batch buckets 1, 2, 4, 8; 4 slots.
    assert steps == len(warmup_plan(decoder.buckets, 4, [32, 64, 128])) > 0
    assert run_mixed_batch(engine, prompts_for(names)) == want
