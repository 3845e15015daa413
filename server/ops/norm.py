"""RMSNorm, alone or fused with the residual add that precedes it in every decoder layer.

    x, residual_delta [T, N] -> x_new = x + delta   (rounded to x's dtype, as torch's add)
                                normed = x_new / rms(x_new) * weight   [T, N]

One program per row reads x (and delta) once, writes x_new and normed. The mean of squares
is taken in float32 and the weight applied in float32 before the one rounding, which is what
F.rms_norm's fused kernel computes (HF's LlamaRMSNorm rounds before the weight instead: at
most one bf16 ulp apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_dense_rows, check_dtype, check_launchable


@triton.jit
def _rms_norm_kernel(
    # pointers
    normed_ptr,  # [T, N]: out
    x_out_ptr,  # [T, N]: out, x + delta (not touched without HAS_DELTA)
    x_ptr,  # [T, N]
    delta_ptr,  # [T, N] (not read without HAS_DELTA)
    weight_ptr,  # [N]
    # sizes
    N,
    eps,
    # strides (last dimensions contiguous)
    stride_normed,
    stride_xo,
    stride_x,
    stride_delta,
    # meta-parameters
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,  # >= N, a power of two
):
    """Semantics::

        for row t:                                   # grid (T,)
            if HAS_DELTA: x[t] = x_out[t] = x[t] + delta[t]
            normed[t] = x[t] * rsqrt(mean(x[t]**2) + eps) * weight
    """
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + t * stride_delta + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_out_ptr.dtype.element_ty)
        tl.store(x_out_ptr + t * stride_xo + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + t * stride_normed + offs, (xf * rstd * w).to(normed_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual_delta: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, N], got {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    check_dtype("x", x)
    check_dtype("weight", weight)
    tensors = dict(x=x, weight=weight)
    if residual_delta is not None:
        if residual_delta.shape != x.shape:
            raise ValueError(f"residual_delta {tuple(residual_delta.shape)} must have x's shape {tuple(x.shape)}")
        check_dtype("residual_delta", residual_delta, x.dtype)
        tensors["residual_delta"] = residual_delta
    check_dense_rows(**tensors)
    check_launchable(*tensors.values())


def _launch(x, residual_delta, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, n = x.shape
    normed = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    x_new = torch.empty_like(normed) if residual_delta is not None else x
    if num_rows == 0:
        return x_new, normed
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(num_rows,)](
        normed,
        x_new,
        x,
        residual_delta if residual_delta is not None else x,
        weight,
        n,
        eps,
        normed.stride(0),
        x_new.stride(0),
        x.stride(0),
        residual_delta.stride(0) if residual_delta is not None else 0,
        HAS_DELTA=residual_delta is not None,
        BLOCK=block,
        # 8 elements (16 bytes of bf16) per thread: 16 warps for a 4096-wide row.
        num_warps=max(1, min(16, block // 256)),
    )
    return x_new, normed


def rms_norm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
) -> torch.Tensor:
    """Returns a new [T, N] tensor: x / sqrt(mean(x**2) + eps) * weight, float32 inside."""
    _check(x, weight, None)
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor,  # [T, N]: the residual stream
    residual_delta: torch.Tensor,  # [T, N]: what the attention or MLP block adds to it
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns new tensors (x_new, normed), both [T, N] in x's dtype: x_new = x + delta rounded
    as torch rounds it, normed = rms_norm(x_new, weight, eps). One launch."""
    _check(x, weight, residual_delta)
    return _launch(x, residual_delta, weight, eps)
