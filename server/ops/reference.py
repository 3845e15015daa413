"""Torch references for the fused decode ops: the math each kernel computes, written plainly
(float32 inside, one rounding to the output dtype at the end). Tests and ops_bench check
the kernels against these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> x / rms(x) * weight [N], in float32, rounded once (as F.rms_norm's fused
    kernel rounds: the weight is applied in float32, before the cast)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual_delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual sum in x's dtype, normed from that."""
    x_new = x + residual_delta
    return x_new, rms_norm_reference(x_new, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2*I] (gate | up columns) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's convention: [x1, x2] -> [-x2, x1] over the halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_and_cache_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                                   positions: torch.Tensor, q_scale: float = 1.0) -> torch.Tensor:
    """qkv [B, (heads + 2*kv_heads)*d] (q | k | v columns), cos/sin float32 [max_len, d].

    Rotates q and k of row b by position p = positions[b], writes k and v into the caches at
    [rows[b], :, p] and returns q * q_scale [B, heads, d].
    """
    kv_heads, d = k_cache.shape[1], k_cache.shape[-1]
    x = qkv.float().view(qkv.shape[0], -1, d)  # [B, heads + 2*kv_heads, d]
    heads = x.shape[1] - 2 * kv_heads
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, d]
    qk = x[:, : heads + kv_heads]
    qk = qk * c + rotate_half(qk) * s
    k_cache[rows, :, positions] = qk[:, heads:].to(k_cache.dtype)
    v_cache[rows, :, positions] = x[:, heads + kv_heads:].to(v_cache.dtype)
    return (qk[:, :heads] * q_scale).to(qkv.dtype)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """q [B, heads, d] (already scaled), caches [rows, kv_heads, max_len, d] -> [B, heads, d].

    Query head h of row b attends to keys 0..min(positions[b], kv_len - 1) of KV row b,
    kv head h // (heads / kv_heads); no scale is applied here.
    """
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = min(int(positions[b]) + 1, kv_len)
        k = k_cache[b, :, :n].float().repeat_interleave(heads // kv_heads, dim=0)  # [heads, n, d]
        v = v_cache[b, :, :n].float().repeat_interleave(heads // kv_heads, dim=0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].float(), k), dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", p, v).to(q.dtype)
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                seqs: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """q [T, heads, d] (already scaled), caches [rows, kv_heads, max_len, d], seqs (start,
    length, pos, row) -> [T, heads, d]: token i of a prompt attends to keys 0..pos + i of its
    row, kv head h // (heads / kv_heads); no scale is applied here."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for start, n, pos, row in seqs:
        k = k_cache[row, :, : pos + n].float().repeat_interleave(heads // kv_heads, dim=0)  # [heads, keys, d]
        v = v_cache[row, :, : pos + n].float().repeat_interleave(heads // kv_heads, dim=0)
        scores = torch.einsum("thd,hnd->htn", q[start: start + n].float(), k)
        visible = torch.arange(pos + n)[None, :] <= torch.arange(pos, pos + n)[:, None]
        p = torch.softmax(scores.masked_fill(~visible.to(scores.device), float("-inf")), dim=-1)
        out[start: start + n] = torch.einsum("htn,hnd->thd", p, v).to(q.dtype)
    return out
