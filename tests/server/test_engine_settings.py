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
