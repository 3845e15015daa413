"""Settings the engine cannot run with are refused by the CLI before anything loads, in one
line naming the flags (exit 2), rather than failing the start with a traceback."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.cli import main
from loraplex.server.config import named_shape
from loraplex.server.engine import check_memory, check_settings
from loraplex.server.kv_cache import KVCache
from loraplex.server.settings import ServerSettings


def test_a_kv_cache_larger_than_memory_is_one_line_before_anything_loads(capsys):
    """The KV cache is allocated whole at start: max-num-seqs rows of max-model-len tokens
    (512 B a token for the tiny shape: 10^8 rows of 2,048 tokens are 105 TB)."""
    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--max-num-seqs", str(10**8),
                 "--max-model-len", "2048"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loraplex-server: ")
    assert "--max-num-seqs" in err and "--max-model-len" in err and "KV cache" in err, err


@pytest.mark.parametrize("rows, fits", [(4, True), (5, False)])
def test_memory_check_counts_the_kv_cache_and_the_weights(rows, fits):
    """Room for the weights and 4 rows of the cache, not 5; max-model-len capped by the model's
    max_position_embeddings (2048) as the engine caps it."""
    cfg = named_shape("tiny")
    weights = cfg.num_params() * 4
    row = 2048 * KVCache.bytes_per_token(cfg, torch.float32)
    settings = ServerSettings(dummy_weights="tiny", device="cpu", max_num_seqs=rows, max_model_len=10**6)
    room = weights + 4 * row
    if fits:
        check_memory(settings, cfg, torch.float32, room)
    else:
        with pytest.raises(ValueError, match=r"--max-num-seqs 5 .* at most 4 rows"):
            check_memory(settings, cfg, torch.float32, room)


def test_weights_larger_than_memory_say_so():
    cfg = named_shape("tiny")
    settings = ServerSettings(dummy_weights="tiny", device="cpu", max_num_seqs=1)
    with pytest.raises(ValueError, match="weights need"):
        check_memory(settings, cfg, torch.float32, cfg.num_params() * 4 - 1)


@pytest.mark.parametrize("slots, fits", [(3, True), (4, False)])
def test_memory_check_counts_adapter_slots_asked_for(slots, fits):
    from loraplex.server.adapters import LoRABuffers, slot_groups

    cfg = named_shape("tiny")
    settings = ServerSettings(dummy_weights="tiny", device="cpu", max_num_seqs=2, max_model_len=64,
                              max_loras=slots, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    slot = LoRABuffers.slot_bytes(cfg, 8, torch.float32, slot_groups(["q_proj", "v_proj"]))
    room = cfg.num_params() * 4 + 2 * 64 * KVCache.bytes_per_token(cfg, torch.float32) + 3 * slot
    if fits:
        check_memory(settings, cfg, torch.float32, room)
    else:
        with pytest.raises(ValueError, match=r"--max-loras 4 x --max-lora-rank 8: .* at most 3 slots"):
            check_memory(settings, cfg, torch.float32, room)


def test_settings_that_fit_pass():
    check_settings(ServerSettings(dummy_weights="tiny", device="cpu"))


@pytest.mark.parametrize("backend, interpret, refused", [
    ("triton", None, True), ("triton", "0", True), ("triton", "1", False),
    ("auto", None, False), ("torch", None, False),
])
def test_the_triton_backend_on_the_cpu_needs_the_interpreter(monkeypatch, backend, interpret, refused):
    """--kernel-backend triton on the CPU runs only under the Triton interpreter. Without it the
    server started, served the base, and the first request for an adapter raised inside a
    step, which stopped the engine for every client."""
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    settings = ServerSettings(dummy_weights="tiny", device="cpu", kernel_backend=backend)
    if refused:
        with pytest.raises(ValueError, match="--kernel-backend triton .*TRITON_INTERPRET=1"):
            check_settings(settings)
    else:
        check_settings(settings)


GB = 10**9


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_device_less_what_is_in_use(monkeypatch):
    """--gpu-memory-utilization (vLLM's): the engine's budget is that fraction of the device's
    total memory, less what is in use at start (other processes' too); without it, what is free."""
    from loraplex.server import engine, slot_sizing

    assert slot_sizing.memory_budget(free=121 * GB, total=141 * GB, utilization=0.5) == int(50.5 * GB)
    assert slot_sizing.memory_budget(free=121 * GB, total=141 * GB, utilization=0.1) == 0  # in use already
    assert slot_sizing.memory_budget(free=40 * GB, total=141 * GB, utilization=1.0) == 40 * GB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (121 * GB, 141 * GB))
    cuda = torch.device("cuda", 0)
    assert engine.device_memory(cuda) == 121 * GB
    assert engine.device_memory(cuda, 0.5) == int(50.5 * GB)
    assert engine.device_memory(torch.device("cpu"), 0.5) == engine.device_memory(torch.device("cpu"))
    # --max-loras 0: slots of 84 MB over what is left, less 2 GiB for activations and graphs.
    assert slot_sizing.resolve_max_loras(0, 84 * 10**6, cuda) == 256  # 0.8 of 121 GB: the cap
    room = int(0.3 * 141 * GB) - 20 * GB - (2 << 30)
    assert slot_sizing.resolve_max_loras(0, 84 * 10**6, cuda, 0.3) == room // (84 * 10**6) < 256
    assert slot_sizing.resolve_max_loras(12, 84 * 10**6, cuda, 0.3) == 12  # the flag wins


def test_what_gpu_memory_utilization_leaves_is_named_when_it_does_not_fit():
    cfg = named_shape("tiny")
    settings = ServerSettings(dummy_weights="tiny", device="cuda", max_num_seqs=1, gpu_memory_utilization=0.2)
    with pytest.raises(ValueError, match=r"weights need .* and --gpu-memory-utilization 0.2 leaves 0.0 GB"):
        check_memory(settings, cfg, torch.float32, 1000, by_utilization=True)


def test_vllms_flags_for_what_is_here_run(capsys, monkeypatch):
    """vLLM's command lines run: --enable-lora (adapters are always on), --max-num-batched-tokens
    (our --max-prefill-tokens), --gpu-memory-utilization, --dtype half and float, --lora-modules
    as JSON, the model folder first without --model, --tensor-parallel-size 1; what cannot be is
    refused in a line."""
    s = ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--enable-lora", "--max-num-batched-tokens",
                                          "8192", "--gpu-memory-utilization", "0.85"])
    assert (s.enable_lora, s.max_prefill_tokens, s.gpu_memory_utilization) == (True, 8192, 0.85)
    assert ServerSettings.from_env_and_args(["--dummy-weights", "tiny"]).gpu_memory_utilization is None
    for given, dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):  # vLLM's --dtype
        assert ServerSettings(dummy_weights="tiny", dtype=given).dtype == dtype
    assert ServerSettings.from_env_and_args(["/models/llama-3-8b", "--enable-lora"]).model == "/models/llama-3-8b"
    assert ServerSettings.from_env_and_args(["/m/a", "--model", "/m/a"]).model == "/m/a"
    with pytest.raises(ValueError, match="given twice"):
        ServerSettings.from_env_and_args(["/m/a", "--model", "/m/b"])
    s = ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--lora-modules", "poet=/a/poet",
                                          '{"name": "sql", "path": "/a/sql", "base_model_name": "tiny"}'])
    assert s.lora_modules == ["poet=/a/poet", "sql=/a/sql"]
    for bad in ('{"name": "sql"}', '{"name": "sql", "path": 3}', "{nope", '["sql", "/a/sql"]'):
        with pytest.raises(ValueError, match="--lora-modules"):
            ServerSettings(dummy_weights="tiny", lora_modules=[bad])
    monkeypatch.setenv("LORAPLEX_GPU_MEMORY_UTILIZATION", "0.5")
    assert ServerSettings.from_env_and_args(["--dummy-weights", "tiny"]).gpu_memory_utilization == 0.5
    monkeypatch.delenv("LORAPLEX_GPU_MEMORY_UTILIZATION")
    assert ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--tensor-parallel-size", "1"]) \
        .tensor_parallel_size == 1
    for args, said in ((["--no-enable-lora"], "--no-enable-lora"), (["--gpu-memory-utilization", "0"], "above 0"),
                       (["--tensor-parallel-size", "2"], "more replicas"),
                       (["--gpu-memory-utilization", "1.5"], "at most 1")):
        assert main(["--dummy-weights", "tiny", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("loraplex-server: ") and said in err and err.count("\n") == 1, err
