"""Prefill attention (server/ops/prefill_attention.py) against its torch reference: prompts
packed back to back, each after its cached prefix (pos > 0) or from the start, bottom-right
causal, grouped-query; the caches poisoned with NaN past each prompt's last key (the kernel
must not read there: a NaN read would reach the output)."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.ops.prefill_attention import PrefillPlan, prefill_attention
from loraplex.server.ops.reference import prefill_attention_reference

from .test_ops import DEVICE, DTYPES, NAN, close


def case(shapes, heads, kv_heads, head_dim, dtype, rows=6, max_len=96, seed=0):
    """shapes: (length, pos, row) per prompt."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(n for n, _, _ in shapes)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.full((rows, kv_heads, max_len, head_dim), NAN).to(dtype)
    v = torch.full((rows, kv_heads, max_len, head_dim), NAN).to(dtype)
    seqs, start = [], 0
    for n, pos, row in shapes:
        k[row, :, : pos + n] = torch.randn(kv_heads, pos + n, head_dim, generator=gen).to(dtype)
        v[row, :, : pos + n] = torch.randn(kv_heads, pos + n, head_dim, generator=gen).to(dtype)
        seqs.append((start, n, pos, row))
        start += n
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seqs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (8, 1, 32), (2, 2, 16), (6, 2, 16)])
@pytest.mark.parametrize("shapes", [
    [(5, 0, 0)],  # one prompt from the start
    [(1, 40, 3)],  # one token after a prefix
    [(20, 0, 1), (7, 33, 4), (1, 0, 2), (40, 17, 0)],  # a mixed step: whole prompts, later chunks, one token
], ids=["whole", "one-after-prefix", "mixed"])
def test_prefill_attention_matches_reference(dtype, heads, kv_heads, head_dim, shapes):
    q, k, v, seqs = case(shapes, heads, kv_heads, head_dim, dtype)
    plan = PrefillPlan.build(seqs, heads // kv_heads, q.device)
    got = prefill_attention(q, k, v, plan)
    assert got.shape == q.shape and got.dtype == dtype and not got.isnan().any()
    close(got, prefill_attention_reference(q, k, v, seqs), dtype)


def test_the_plan_holds_each_tokens_row_and_position():
    plan = PrefillPlan.build([(0, 3, 0, 2), (3, 2, 10, 0)], groups=4, device=torch.device(DEVICE))
    assert plan.rows_index.tolist() == [2, 2, 2, 0, 0] and plan.positions.tolist() == [0, 1, 2, 10, 11]
    assert plan.block_m == 16 and plan.programs.tolist() == [[0, 0], [1, 0]] and plan.tokens == 5
    long = PrefillPlan.build([(0, 40, 5, 1)], groups=4, device=torch.device(DEVICE))
    assert long.programs.tolist() == [[0, 0], [0, 16], [0, 32]]


@pytest.mark.parametrize("change, error", [
    (dict(q=torch.zeros(5, 3, 16)), "multiple of kv_heads"),
    (dict(q=torch.zeros(4, 4, 16)), "plan's prompts"),
    (dict(v_cache=torch.zeros(3, 2, 48, 16, dtype=torch.float16)), "v_cache"),
    (dict(q=torch.zeros(5, 4, 8), k_cache=torch.zeros(3, 2, 48, 8), v_cache=torch.zeros(3, 2, 48, 8)), "head_dim"),
])
def test_prefill_attention_rejects_bad_calls(change, error):
    plan = PrefillPlan.build([(0, 5, 0, 1)], groups=2, device=torch.device("cpu"))
    args = dict(q=torch.zeros(5, 4, 16), k_cache=torch.zeros(3, 2, 48, 16), v_cache=torch.zeros(3, 2, 48, 16),
                plan=plan) | change
    with pytest.raises((ValueError, TypeError), match=error):
        prefill_attention(**args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fused_prefill_gives_the_torch_paths_logits_and_cache(dtype):
    """LlamaModel.prefill with the fused ops (one K/V write and one attention launch a layer)
    against its torch path (SDPA per prompt), on a step that mixes a whole prompt, a prompt
    after a cached prefix and a one-token chunk, with adapters and the base."""
    from loraplex.server.model import PrefillSeq

    from .test_ops import rel_error, tiny_model

    seqs_shape = [(0, 9, 0), (2, 6, 20), (4, 1, 30)]  # (row, length, pos)
    models = [tiny_model(dtype, fused=fused, device=DEVICE) for fused in (True, False)]
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, models[0].cfg.vocab_size, (16,), generator=gen).to(DEVICE)
    slots = torch.tensor([0] * 9 + [1] * 6 + [-1], dtype=torch.int32, device=DEVICE)
    seqs, start = [], 0
    for row, n, pos in seqs_shape:
        seqs.append(PrefillSeq(row=row, start=start, length=n, pos=pos))
        start += n
    logits = [m.prefill(tokens, slots, seqs) for m in models]
    assert rel_error(logits[0], logits[1]) < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for kf, kt in zip(models[0].kv.k + models[0].kv.v, models[1].kv.k + models[1].kv.v):
        close(kf, kt, dtype)  # the same positions written, the same values
