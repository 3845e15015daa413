"""Decode attention: one query token per row against that row's KV cache, grouped-query.

    q        [B, heads, d]                 RoPE'd and pre-scaled by 1/sqrt(d)
    k_cache  [rows, kv_heads, max_len, d]  row b of the batch is KV row b (kv_cache.py)
    out      [B, heads, d]                 row b attends to keys 0..min(positions[b], kv_len-1)

Flash-decoding: each row's own keys (0..its position, at most kv_len) are cut into ``splits``
chunks of whole key blocks and one program takes one (row, kv head, chunk). It holds all
``heads / kv_heads`` query heads of its kv head as the rows of one tile, so each K and V
block is read from memory once and used by every head of the group (tl.dot needs 16 rows:
a group of 4 is padded with zero queries). The softmax is online in float32. A program
stops at its row's last key, so short rows read only what they use.

With one split the program normalises and writes ``out`` itself. With more, each writes its
running max, sum and unnormalised output (float32) to a workspace and a second kernel
combines the chunks of each (row, head). Splits are chosen from (B, kv_heads, kv_len) alone,
and a chunk's size from its row's length on the device, so a decode graph has static shapes
and no host synchronisation, and one graph captured at the cache's full length serves
every shorter one at the same speed: a row's keys are spread over the splits whatever the
bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.configs import multiprocessors

from .common import check_dense_rows, check_dtype, check_index, check_launchable

# Programs wanted per multiprocessor. At the default tile (64 keys x 128 dims, 4 warps, 2
# stages: ~100 registers a thread, 38 KB shared) an H100/H200 SM holds 4 programs at once,
# each with the next K and V tiles (32 KB) in flight, several times what covers DRAM latency;
# 3 per SM is enough, and more splits only add a second wave and the combine.
PROGRAMS_PER_SM = 3
# A split covers no fewer keys than this: shorter chunks cost more in the combine than they
# gain in parallelism.
MIN_CHUNK = 128


@dataclass(frozen=True)
class AttentionConfig:
    splits: int  # chunks of the key range, one program each per (row, kv head)
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def make_attention_config(batch: int, kv_heads: int, kv_len: int, head_dim: int, sms: int,
                          programs_per_sm: int = PROGRAMS_PER_SM) -> AttentionConfig:
    """Split the keys until the launch has about `programs_per_sm` programs per multiprocessor.

    Llama-3-8B on an H200 (132 SMs, 396 programs wanted), kv_len 576: at batch 64 the 64*8 =
    512 (row, kv head) pairs are enough, one pass; at batch 16 (128 pairs) 4 splits are
    wanted, which whole 64-key steps make 3 splits of 192 keys.
    """
    block_n = 64 if head_dim <= 128 else 32
    block_n = min(block_n, max(16, triton.next_power_of_2(kv_len)))
    wanted = programs_per_sm * sms
    splits = max(1, min(triton.cdiv(wanted, batch * kv_heads), triton.cdiv(kv_len, MIN_CHUNK)))
    return AttentionConfig(splits=split_keys(kv_len, splits, block_n)[1], block_n=block_n, num_warps=4, num_stages=2)


def split_keys(kv_len: int, splits: int, block_n: int) -> tuple[int, int]:
    """(keys per split, splits): the key range cut into at most `splits` chunks of whole
    `block_n` steps, e.g. (576, 4, 64) -> (192, 3)."""
    chunk = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
    return chunk, triton.cdiv(kv_len, chunk)


@functools.lru_cache(maxsize=1024)
def attention_config(batch: int, kv_heads: int, kv_len: int, head_dim: int, device: torch.device) -> AttentionConfig:
    """The launch configuration for one call shape (cached)."""
    return make_attention_config(batch, kv_heads, kv_len, head_dim, multiprocessors(device))


@triton.jit
def _attention_split_kernel(
    # pointers
    out_ptr,  # [B, heads, d] when DIRECT, else float32 [B, heads, splits, d]: unnormalised sums
    max_ptr,  # float32 [B, heads, splits]: running max of each chunk (not read when DIRECT)
    sum_ptr,  # float32 [B, heads, splits]: softmax denominator of each chunk (idem)
    q_ptr,  # [B, heads, d]
    k_ptr,  # [rows, kv_heads, max_len, d]
    v_ptr,  # [rows, kv_heads, max_len, d]
    positions_ptr,  # int [B]
    # sizes
    kv_len,
    SPLITS,  # chunks of each row's keys (grid axis 2)
    GROUPS,  # heads / kv_heads
    HEAD_DIM,
    # strides (last dimensions contiguous)
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_os,
    stride_mb,
    stride_mh,
    # meta-parameters
    DIRECT: tl.constexpr,  # one split: normalise and write the output here
    BLOCK_G: tl.constexpr,  # >= GROUPS, a power of two >= 16
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM, a power of two
    DOT_PRECISION: tl.constexpr,
):
    """Semantics, as the plain loop it computes::

        for row b, kv head j, split s:               # grid (B, kv_heads, splits)
            n = min(positions[b] + 1, kv_len)
            chunk = cdiv(n, SPLITS) rounded up to whole BLOCK_N
            keys = s*chunk : min((s+1)*chunk, n)
            for h in heads j*GROUPS : (j+1)*GROUPS:
                scores = q[b, h] @ k[b, j, keys].T
                max[b, h, s] = max(scores); e = exp(scores - max[b, h, s])
                sum[b, h, s] = sum(e); out[b, h, s] = e @ v[b, j, keys]
            (DIRECT: out[b, h] = out[b, h, 0] / sum[b, h, 0])
    """
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_keys = tl.minimum(tl.load(positions_ptr + b).to(tl.int32) + 1, kv_len)
    chunk = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_keys)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUPS
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUPS + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    k_row = k_ptr + b * stride_kb + kvh * stride_kh
    v_row = v_ptr + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Every block starts below hi, so it holds a real key and its max is finite.
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_row + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_row + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # An empty chunk (past its row's last key) stores max -inf, sum 0, out 0.
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        tl.store(out, acc, mask=out_mask)
        stats = b * stride_mb + heads * stride_mh + split
        tl.store(max_ptr + stats, m_i, mask=g_mask)
        tl.store(sum_ptr + stats, l_i, mask=g_mask)


@triton.jit
def _attention_combine_kernel(
    # pointers
    out_ptr,  # [B, heads, d]
    partial_ptr,  # float32 [B, heads, splits, d]
    max_ptr,  # float32 [B, heads, splits]
    sum_ptr,  # float32 [B, heads, splits]
    # sizes
    SPLITS,
    HEAD_DIM,
    # strides (last dimensions contiguous)
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    # meta-parameters
    BLOCK_S: tl.constexpr,  # >= SPLITS, a power of two
    BLOCK_D: tl.constexpr,
):
    """Semantics::

        for row b, head h:                           # grid (B, heads)
            w[s] = exp(max[b, h, s] - max_s max[b, h, s])   (0 for an empty chunk)
            out[b, h] = sum_s w[s] * partial[b, h, s] / sum_s w[s] * sum[b, h, s]
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < SPLITS
    d_mask = offs_d < HEAD_DIM
    stats = b * stride_mb + h * stride_mh + offs_s
    m = tl.load(max_ptr + stats, mask=s_mask, other=float("-inf"))
    l = tl.load(sum_ptr + stats, mask=s_mask, other=0.0)
    part = tl.load(partial_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    # Split 0 always holds key 0, so the max is finite.
    w = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check(q, k_cache, v_cache, positions, kv_len) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, heads, d] and the caches [rows, kv_heads, max_len, d], "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    batch, heads, head_dim = q.shape
    rows, kv_heads, max_len, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: head_dim must agree "
                         "and heads be a multiple of kv_heads")
    if head_dim < 16:
        raise ValueError(f"head_dim {head_dim} < 16 is not supported (tl.dot's smallest tile)")
    if batch > rows:
        raise ValueError(f"{batch} query rows but only {rows} KV rows")
    if not 1 <= kv_len <= max_len:
        raise ValueError(f"kv_len {kv_len} must be in 1..{max_len}")
    check_index("positions", positions, batch)
    check_dtype("q", q)
    check_dtype("k_cache", k_cache, q.dtype)
    check_dtype("v_cache", v_cache, q.dtype)
    check_dense_rows(q=q, k_cache=k_cache, v_cache=v_cache)
    check_launchable(q, k_cache, v_cache, positions)


def decode_attention(
    q: torch.Tensor,  # [B, heads, d], pre-scaled
    k_cache: torch.Tensor,  # [rows, kv_heads, max_len, d]
    v_cache: torch.Tensor,  # [rows, kv_heads, max_len, d]
    positions: torch.Tensor,  # int [B]: row b attends to keys 0..positions[b]
    kv_len: int,  # keys read at most (positions at or past it see keys 0..kv_len-1)
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Returns a new [B, heads, d] tensor in q's dtype: softmax(q k^T) v per row and head, over
    keys 0..min(positions[b], kv_len - 1) of KV row b. No host synchronisation."""
    _check(q, k_cache, v_cache, positions, kv_len)
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if config is None:
        config = attention_config(batch, kv_heads, kv_len, head_dim, q.device)
    splits = split_keys(kv_len, config.splits, config.block_n)[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    if splits == 1:
        partial, stats_max, stats_sum = out, out, out  # stats are not touched when DIRECT
        stride_os, stride_mb, stride_mh = 0, 0, 0
    else:
        partial = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        stats_max = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        stats_sum = torch.empty_like(stats_max)
        stride_os, stride_mb, stride_mh = partial.stride(2), stats_max.stride(0), stats_max.stride(1)
    _attention_split_kernel[(batch, kv_heads, splits)](
        partial,
        stats_max,
        stats_sum,
        q,
        k_cache,
        v_cache,
        positions,
        kv_len,
        splits,
        heads // kv_heads,
        head_dim,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],  # row, kv head, position
        *v_cache.stride()[:3],
        partial.stride(0),
        partial.stride(1),
        stride_os,
        stride_mb,
        stride_mh,
        DIRECT=splits == 1,
        BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _attention_combine_kernel[(batch, heads)](
            out,
            partial,
            stats_max,
            stats_sum,
            splits,
            head_dim,
            out.stride(0),
            out.stride(1),
            partial.stride(0),
            partial.stride(1),
            partial.stride(2),
            stats_max.stride(0),
            stats_max.stride(1),
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
            num_warps=1,
        )
    return out
