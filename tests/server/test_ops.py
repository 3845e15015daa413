"""server/ops: each fused decode op against its torch reference, and `LlamaModel.decode` with
the fused ops against its torch path.

By default the kernels run on the CPU through Triton's interpreter (tests/conftest.py), in
float16 and float32 (the interpreter's bfloat16 is wrong: tl.dot, and casts that truncate).
On a GPU, `TRITON_INTERPRET=0 pytest tests/server/test_ops.py` runs the same tests on CUDA
tensors with bfloat16 added, plus the CUDA-only tests at the end: Llama-3-8B attention
shapes, bf16 decode parity and CUDA-graph capture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraplex.server.adapters import LoRABuffers, random_adapter
from loraplex.server.config import ModelConfig, named_shape
from loraplex.server.kv_cache import KVCache
from loraplex.server.model import LlamaModel
from loraplex.server.ops import add_rms_norm, decode_attention, rms_norm, rope_and_cache_write, silu_mul
from loraplex.server.ops.attention import AttentionConfig, make_attention_config, split_keys
from loraplex.server.ops.reference import (add_rms_norm_reference, decode_attention_reference,
                                           rms_norm_reference, rope_and_cache_write_reference,
                                           silu_mul_reference)
from loraplex.server.weights import dummy_weights

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float16, torch.float32] if INTERPRETED else [torch.float16, torch.bfloat16, torch.float32]
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET is off and there is no CUDA device")
# Tolerances against the float32-inside references (one rounding apart at most).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
NAN = float("nan")


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)


# -- decode attention ----------------------------------------------------------------------

def attention_case(batch, heads, kv_heads, head_dim, kv_len, dtype, seed=0, max_len=48):
    """Caches poisoned with NaN past each row's last key (the kernel must not read there); the
    last row sits past kv_len, as DecodeRunner's empty rows do, and sees keys 0..kv_len-1."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch + 1, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch + 1, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, kv_len, (batch,), generator=gen)
    positions[0] = 0
    positions[-1] = max_len - 1
    for b, p in enumerate(positions.tolist()):
        k[b, :, min(p + 1, kv_len):] = NAN
        v[b, :, min(p + 1, kv_len):] = NAN
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, kv_len", [
    (3, 4, 2, 16, 7),
    (4, 4, 2, 32, 40),
    (5, 8, 1, 16, 23),  # 8 query heads on one kv head
    (3, 2, 2, 32, 37),  # no grouping
])
@pytest.mark.parametrize("config", [None, AttentionConfig(splits=3, block_n=16, num_warps=4, num_stages=2)],
                         ids=["auto", "3-splits"])
def test_decode_attention_matches_reference(batch, heads, kv_heads, head_dim, kv_len, dtype, config):
    q, k, v, positions = attention_case(batch, heads, kv_heads, head_dim, kv_len, dtype)
    got = decode_attention(q, k, v, positions, kv_len, config=config)
    assert got.shape == q.shape and got.dtype == dtype and not got.isnan().any()
    close(got, decode_attention_reference(q, k, v, positions, kv_len), dtype)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_attention_spreads_each_rows_own_keys_over_the_splits(splits):
    """A chunk's size follows its row's length, not kv_len: one launch shape at the cache's
    full length gives every row, short or long, the answer of a launch bounded near it, with
    the splits past a short row's keys empty."""
    q, k, v, positions = attention_case(5, 4, 2, 16, 48, torch.float32, seed=2, max_len=48)
    positions[:3] = torch.tensor([0, 5, 17], device=DEVICE)  # rows far shorter than the bound
    k[:3, :, 18:] = NAN
    v[:3, :, 18:] = NAN
    config = AttentionConfig(splits=splits, block_n=16, num_warps=4, num_stages=2)
    full = decode_attention(q, k, v, positions, 48, config=config)
    close(full, decode_attention_reference(q, k, v, positions, 48), torch.float32)
    short = decode_attention(q[:3], k, v, positions[:3], 18, config=config)
    close(full[:3], short, torch.float32)


def test_decode_attention_reads_strided_views_and_int32_positions():
    q, k, v, positions = attention_case(4, 4, 2, 16, 30, torch.float32, seed=1)
    # Every other query row of a wider buffer; caches as slices of wider ones (max_len stride 48).
    q_wide = torch.full((8, 4, 16), NAN, device=DEVICE)
    q_wide[::2] = q
    got = decode_attention(q_wide[::2], k[:, :, :40], v[:, :, :40], positions.int(), 30)
    close(got, decode_attention_reference(q, k, v, positions, 30), torch.float32)


@pytest.mark.parametrize("batch, kv_len, splits", [
    (64, 576, 1),  # 512 (row, kv head) pairs fill 132 SMs at 3 programs each
    (32, 576, 2),
    (16, 576, 3),  # 4 wanted; whole 64-key steps: 3 chunks of 192
    (8, 576, 5),  # 7 wanted, capped at kv_len / 128
    (8, 100, 1),
    (1, 2048, 16),
])
def test_attention_config_fills_the_gpu(batch, kv_len, splits):
    config = make_attention_config(batch, 8, kv_len, 128, sms=132)  # Llama-3-8B on an H200
    assert config.splits == splits
    assert split_keys(kv_len, config.splits, config.block_n)[1] == splits


@pytest.mark.parametrize("change, error", [
    (dict(q=torch.zeros(2, 3, 16)), "multiple of kv_heads"),
    (dict(kv_len=49), "kv_len"),
    (dict(positions=torch.zeros(2)), "positions"),
    (dict(v_cache=torch.zeros(3, 2, 48, 16, dtype=torch.float16)), "float16"),
    (dict(q=torch.zeros(4, 4, 16)), "KV rows"),
])
def test_decode_attention_rejects_bad_calls(change, error):
    args = dict(q=torch.zeros(2, 4, 16), k_cache=torch.zeros(3, 2, 48, 16), v_cache=torch.zeros(3, 2, 48, 16),
                positions=torch.zeros(2, dtype=torch.int64), kv_len=20) | change
    with pytest.raises((ValueError, TypeError), match=error):
        decode_attention(**args)


# -- RoPE + cache write --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (4, 1, 32), (2, 2, 24)])
def test_rope_and_cache_write_matches_reference(heads, kv_heads, head_dim, dtype):
    batch, rows, max_len = 4, 6, 20
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    cos = torch.randn(max_len, head_dim, generator=gen).to(DEVICE)
    sin = torch.randn(max_len, head_dim, generator=gen).to(DEVICE)
    kv_rows = torch.tensor([5, 0, 3, 1], device=DEVICE)
    positions = torch.tensor([0, 19, 7, 7], device=DEVICE)
    caches = [torch.full((rows, kv_heads, max_len, head_dim), NAN, dtype=dtype, device=DEVICE) for _ in range(4)]
    got_q = rope_and_cache_write(qkv, cos, sin, caches[0], caches[1], kv_rows, positions, q_scale=0.3)
    want_q = rope_and_cache_write_reference(qkv, cos, sin, caches[2], caches[3], kv_rows, positions, q_scale=0.3)
    close(got_q, want_q, dtype)
    # NaN everywhere but the written [row, :, position]; v is copied as is.
    close(caches[0], caches[2], dtype)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0, equal_nan=True)
    assert caches[0][kv_rows, :, positions].isfinite().all()


def test_rope_reference_is_the_models_rotation():
    """The reference's HF rotate_half with a q scale equals `_qkv`'s roll with sign-folded sin."""
    model = tiny_model(torch.float32, fused=False)
    cfg = model.cfg
    positions = torch.tensor([3, 0, 17])
    qkv = torch.randn(3, cfg.q_size + 2 * cfg.kv_size)
    d, nq, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qk = qkv[:, : (nq + nkv) * d].view(3, nq + nkv, d)
    cos, sin = model._rope_tables(positions, torch.float32)
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
    k_cache, v_cache = model.kv.k[0].clone(), model.kv.v[0].clone()
    q = rope_and_cache_write_reference(qkv, model.cos, model.sin, k_cache, v_cache, torch.arange(3), positions,
                                       model.scale)
    close(q, qk[:, :nq], torch.float32)
    close(k_cache[torch.arange(3), :, positions], qk[:, nq:], torch.float32)


def test_rope_and_cache_write_rejects_bad_calls():
    caches = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    table = torch.zeros(8, 16)
    idx = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="q | k | v"):
        rope_and_cache_write(torch.zeros(3, 64), table, table, *caches, idx, idx)
    with pytest.raises(ValueError, match="cos must be float32"):
        rope_and_cache_write(torch.zeros(3, 128), table.half(), table, *caches, idx, idx)
    with pytest.raises(ValueError, match="rows"):
        rope_and_cache_write(torch.zeros(3, 128), table, table, *caches, idx[:2], idx)


# -- RMSNorm and silu*mul ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(3, 40), (5, 64)])
def test_add_rms_norm_matches_reference(rows, width, dtype):
    gen = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(rows, width, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = torch.rand(width, generator=gen).add(0.5).to(DEVICE, dtype)
    x_new, normed = add_rms_norm(x, delta, weight, 1e-5)
    want_x, want_normed = add_rms_norm_reference(x, delta, weight, 1e-5)
    assert torch.equal(x_new, want_x)  # rounded as torch's add rounds
    close(normed, want_normed, dtype)
    close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), dtype)
    # Strided rows: every other row of a wider buffer.
    wide = torch.full((2 * rows, width + 8), NAN, dtype=dtype, device=DEVICE)
    wide[::2, :width] = x
    close(rms_norm(wide[::2, :width], weight, 1e-5), rms_norm_reference(x, weight, 1e-5), dtype)


def test_rms_norm_reference_is_f_rms_norm():
    """The reference rounds as the current torch path (F.rms_norm) does, to the bit in bf16."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, 256, generator=gen).to(DEVICE, torch.bfloat16)
    weight = torch.rand(256, generator=gen).mul(2).to(DEVICE, torch.bfloat16)
    got, want = rms_norm_reference(x, weight, 1e-5), F.rms_norm(x, (256,), weight, 1e-5)
    # HF's rounding (before the weight) differs in ~25% of the elements. On CUDA,
    # F.rms_norm's kernel may order the float32 products otherwise: a rare one-ulp difference.
    assert (got != want).float().mean() <= (0 if DEVICE == "cpu" else 0.01)
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(3, 40), (2, 1100)])  # 1100: two column blocks, the last partial
def test_silu_mul_matches_reference(rows, inter, dtype):
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(5)).mul(3).to(DEVICE, dtype)
    got = silu_mul(gate_up)
    assert got.shape == (rows, inter)
    close(got, silu_mul_reference(gate_up), dtype)


def test_norm_and_silu_reject_bad_calls():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(TypeError, match="residual_delta"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float16), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.zeros(8, 2).T, torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match=r"\[T, 2\*I\]"):
        silu_mul(torch.zeros(2, 7))
    with pytest.raises(TypeError, match="int32"):
        silu_mul(torch.zeros(2, 8, dtype=torch.int32))


# -- the model's decode ----------------------------------------------------------------------

def tiny_model(dtype, fused: bool | None, cfg: ModelConfig | None = None, device: str = "cpu", max_len: int = 48,
               rows: int = 5) -> LlamaModel:
    """Random weights (norm weights too) and caches, two adapters of different ranks in slots 0, 1."""
    cfg = cfg or named_shape("tiny")
    weights = dummy_weights(cfg, torch.device(device), dtype, seed=0, std=0.08)
    gen = torch.Generator(device=device).manual_seed(1)
    for w in [weights.norm] + [n for lw in weights.layers for n in (lw.input_norm, lw.post_norm)]:
        w.uniform_(0.5, 1.5, generator=gen)
    kv = KVCache(cfg, rows, max_len, torch.device(device), dtype)
    for t in kv.k + kv.v:
        t.normal_(generator=gen)
    lora = LoRABuffers(cfg, num_slots=2, max_rank=8, device=torch.device(device), dtype=dtype)
    for slot, rank in enumerate((8, 4)):
        lora.write(slot, *random_adapter(cfg, rank, seed=slot, device=device, dtype=dtype))
    return LlamaModel(cfg, weights, kv, lora, fused_ops=fused)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def decode_both_ways(model: LlamaModel, tokens, positions, slots, kv_len, max_adapters):
    """(logits, written K/V entries) of the torch path and of the fused path, each from the
    same caches; checks that each path changed every row's K and V at its position and
    nothing else."""
    caches = model.kv.k + model.kv.v
    start = [t.clone() for t in caches]
    written = (torch.arange(tokens.shape[0], device=tokens.device), slice(None), positions)
    results = []
    for fused in (False, True):
        for t, s in zip(caches, start):
            t.copy_(s)
        model.fused_ops = fused
        logits = model.decode(tokens, positions, slots, kv_len, max_adapters)
        entries = []
        for t, s in zip(caches, start):
            entries.append(t[written].clone())
            assert not torch.equal(entries[-1], s[written])
            t[written] = s[written]
            assert torch.equal(t, s)
        results.append((logits, entries))
    return results


# Relative error (norm of the difference over the norm) of the fused path's logits and K/V
# writes against the torch path's: both round differently after every op, for two layers.
DECODE_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_adapters", [None, 2, 0])  # every slot, the exact bound, base only
def test_fused_decode_matches_torch_path(dtype, max_adapters):
    model = tiny_model(dtype, fused=False, device=DEVICE)
    # Rows 0-3 at mixed positions with mixed adapters; row 4 empty (position max_len - 1).
    tokens = torch.tensor([7, 300, 42, 5, 0], device=DEVICE)
    positions = torch.tensor([5, 17, 30, 0, 47], device=DEVICE)
    slots = torch.tensor([0, -1, 1, 0, -1], dtype=torch.int32, device=DEVICE)
    (want, want_kv), (got, got_kv) = decode_both_ways(model, tokens, positions, slots, 32, max_adapters)
    assert rel_error(got[:4], want[:4]) < DECODE_TOL[dtype]
    assert max(rel_error(g, w) for g, w in zip(got_kv, want_kv)) < DECODE_TOL[dtype]


def test_fused_ops_default_to_cuda_only():
    assert tiny_model(torch.float32, fused=None).fused_ops is False


@pytest.mark.skipif(not INTERPRETED, reason="the CPU smoke test runs where the suite runs interpreted")
def test_ops_bench_quick_on_cpu(tmp_path):
    out = tmp_path / "ops.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ops_bench.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {op["op"] for op in doc["ops"]} == {"decode_attention", "rope_and_cache_write", "add_rms_norm",
                                               "rms_norm", "silu_mul"}
    assert all(op["max_error"] <= op["tolerance"] and op["fused_us"] > 0 and op["torch_us"] > 0 for op in doc["ops"])


# -- CUDA only -------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                                reason="needs a CUDA device and TRITON_INTERPRET=0")

# Llama-3-8B's attention shape (head_dim 128, 4 query heads per kv head) at two layers.
CUDA_CFG = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=2,
                       num_heads=8, num_kv_heads=2, head_dim=128, rope_theta=500000.0, max_position_embeddings=4096,
                       bos_token_id=1, eos_token_ids=(2,))


@needs_cuda
@pytest.mark.parametrize("batch, kv_len", [(5, 300), (64, 576)])
def test_cuda_bf16_decode_attention(batch, kv_len):
    q, k, v, positions = attention_case(batch, 32, 8, 128, kv_len, torch.bfloat16, max_len=1024)
    close(decode_attention(q, k, v, positions, kv_len), decode_attention_reference(q, k, v, positions, kv_len),
          torch.bfloat16)


@needs_cuda
def test_cuda_bf16_fused_decode_matches_torch_path():
    model = tiny_model(torch.bfloat16, fused=True, cfg=CUDA_CFG, device="cuda", max_len=320, rows=8)
    assert model.fused_ops
    gen = torch.Generator().manual_seed(6)
    positions = torch.randint(0, 290, (8,), generator=gen)
    positions[-1] = 319  # an empty row
    tokens = torch.randint(0, 1024, (8,), generator=gen)
    slots = torch.tensor([0, -1, 1, 0, -1, 1, 1, -1], dtype=torch.int32)
    args = [t.cuda() for t in (tokens, positions, slots)]
    (want, want_kv), (got, got_kv) = decode_both_ways(model, *args, 304, 2)
    assert rel_error(got[:7], want[:7]) < DECODE_TOL[torch.bfloat16]
    assert max(rel_error(g, w) for g, w in zip(got_kv, want_kv)) < DECODE_TOL[torch.bfloat16]
    assert (got[:7].argmax(-1) == want[:7].argmax(-1)).float().mean() >= 5 / 7


@needs_cuda
def test_cuda_graph_captures_fused_decode():
    model = tiny_model(torch.bfloat16, fused=True, cfg=CUDA_CFG, device="cuda", max_len=320, rows=8)
    tokens = torch.randint(0, 1024, (8,), device="cuda")
    positions = torch.arange(8, device="cuda") * 30
    slots = torch.tensor([0, -1, 1, 0, -1, 1, 1, -1], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.decode(tokens, positions, slots, 256, 2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.decode(tokens, positions, slots, 256, 2)
    graph.replay()
    first = out.clone()
    # New inputs in the same buffers: the replay computes what an eager call computes.
    tokens.copy_(torch.randint(0, 1024, (8,), device="cuda"))
    positions.add_(5)
    graph.replay()
    replayed = out.clone()
    eager = model.decode(tokens, positions, slots, 256, 2)
    torch.testing.assert_close(replayed, eager, atol=1e-2, rtol=1e-2)
    assert not torch.equal(replayed, first)
