"""RoPE on q and k straight from the fused qkv GEMM's output, and the step's K/V cache write.

    qkv      [B, (heads + 2*kv_heads)*d]   columns q | k | v, head after head (`_qkv`'s layout)
    cos, sin float32 [max_len, d]          the model's tables (HF: cat(freqs, freqs)), indexed
                                           by each row's position inside the kernel
    q        [B, heads, d]                 returned, rotated and scaled by q_scale (1/sqrt(d),
                                           the attention scale folded in)
    k_cache, v_cache [rows, kv_heads, max_len, d]: rotated k and plain v of row b are written
                                           at [rows[b], :, positions[b]]

One program per (row, head) of q or of k; a k program also copies its v head. The rotation
is HF's rotate_half: out = x * cos + [-x2, x1] * sin over the halves x1, x2 of a head,
computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_dense_rows, check_dtype, check_index, check_launchable


@triton.jit
def _rope_cache_kernel(
    # pointers
    q_ptr,  # [B, heads, d]: out
    k_cache_ptr,  # [rows, kv_heads, max_len, d]: written at each row's position
    v_cache_ptr,  # [rows, kv_heads, max_len, d]: idem
    qkv_ptr,  # [B, (heads + 2*kv_heads)*d]
    cos_ptr,  # float32 [max_len, d]
    sin_ptr,  # float32 [max_len, d]
    rows_ptr,  # int [B]
    positions_ptr,  # int [B]
    # sizes
    NUM_HEADS,
    NUM_KV_HEADS,
    HALF,  # d / 2
    q_scale,
    # strides (last dimensions contiguous)
    stride_qkv,
    stride_qb,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_kn,
    stride_vr,
    stride_vh,
    stride_vn,
    stride_cos,
    stride_sin,
    # meta-parameters
    BLOCK_HALF: tl.constexpr,  # >= HALF, a power of two
):
    """Semantics, as the plain loop it computes::

        for row b, head h:                           # grid (B, heads + kv_heads)
            p = positions[b]; c, s = cos[p], sin[p]
            rot(x) = x * c + rotate_half(x) * s
            if h < heads:  q[b, h] = rot(qkv[b, head h]) * q_scale
            else:          j = h - heads
                           k_cache[rows[b], j, p] = rot(qkv[b, head heads + j])
                           v_cache[rows[b], j, p] = qkv[b, head heads + kv_heads + j]
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(positions_ptr + b)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    head_dim = 2 * HALF
    src = qkv_ptr + b * stride_qkv + h * head_dim + offs
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + pos * stride_sin + offs, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs, mask=mask, other=0.0)
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    if h < NUM_HEADS:
        dst = q_ptr + b * stride_qb + h * stride_qh + offs
        tl.store(dst, (out1 * q_scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (out2 * q_scale).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        j = h - NUM_HEADS
        row = tl.load(rows_ptr + b)
        k_dst = k_cache_ptr + row * stride_kr + j * stride_kh + pos * stride_kn + offs
        tl.store(k_dst, out1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF, out2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v_src = src + NUM_KV_HEADS * head_dim  # head heads + kv_heads + j
        v_dst = v_cache_ptr + row * stride_vr + j * stride_vh + pos * stride_vn + offs
        tl.store(v_dst, tl.load(v_src, mask=mask), mask=mask)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask), mask=mask)


def _check(qkv, cos, sin, k_cache, v_cache, rows, positions) -> int:
    """Validates a call; returns the number of query heads."""
    if qkv.dim() != 2 or k_cache.dim() != 4:
        raise ValueError(f"qkv must be [B, (heads + 2*kv_heads)*d] and the caches [rows, kv_heads, max_len, d], "
                         f"got {tuple(qkv.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    batch, width = qkv.shape
    _, kv_heads, _, head_dim = k_cache.shape
    if head_dim % 2 or width % head_dim or width // head_dim <= 2 * kv_heads:
        raise ValueError(f"qkv's {width} columns are not q | k | v heads of d={head_dim} with {kv_heads} kv heads "
                         "(d must be even)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != head_dim:
            raise ValueError(f"{name} must be float32 [max_len, {head_dim}], got {t.dtype} {tuple(t.shape)}")
    check_index("rows", rows, batch)
    check_index("positions", positions, batch)
    check_dtype("qkv", qkv)
    check_dtype("k_cache", k_cache, qkv.dtype)
    check_dtype("v_cache", v_cache, qkv.dtype)
    check_dense_rows(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    check_launchable(qkv, cos, sin, k_cache, v_cache, rows, positions)
    return width // head_dim - 2 * kv_heads


def rope_and_cache_write(
    qkv: torch.Tensor,  # [B, (heads + 2*kv_heads)*d]
    cos: torch.Tensor,  # float32 [max_len, d]
    sin: torch.Tensor,  # float32 [max_len, d]
    k_cache: torch.Tensor,  # [rows, kv_heads, max_len, d]: written
    v_cache: torch.Tensor,  # [rows, kv_heads, max_len, d]: written
    rows: torch.Tensor,  # int [B]: KV row of each batch row
    positions: torch.Tensor,  # int [B]: position of each row's token (< max_len, < cos rows)
    q_scale: float = 1.0,
) -> torch.Tensor:
    """Returns a new q [B, heads, d] in qkv's dtype: q rotated and scaled by q_scale; k rotated
    and v as is are written into the caches at [rows[b], :, positions[b]]. One launch."""
    heads = _check(qkv, cos, sin, k_cache, v_cache, rows, positions)
    batch = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    q = torch.empty((batch, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if batch == 0:
        return q
    half = head_dim // 2
    _rope_cache_kernel[(batch, heads + kv_heads)](
        q,
        k_cache,
        v_cache,
        qkv,
        cos,
        sin,
        rows,
        positions,
        heads,
        kv_heads,
        half,
        q_scale,
        qkv.stride(0),
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],  # row, kv head, position
        *v_cache.stride()[:3],
        cos.stride(0),
        sin.stride(0),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=1,
    )
    return q
