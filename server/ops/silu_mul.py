"""SwiGLU's activation on the fused gate|up GEMM output, in one pass.

    gate_up [T, 2*I] (gate columns, then up) -> silu(gate) * up  [T, I]

One program per (row, block of columns), float32 inside, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_dense_rows, check_dtype, check_launchable

BLOCK = 1024  # columns per program: 14 per row for Llama-3-8B's I = 14336


@triton.jit
def _silu_mul_kernel(
    # pointers
    out_ptr,  # [T, I]
    gate_up_ptr,  # [T, 2*I]
    # sizes
    I,
    # strides (last dimensions contiguous)
    stride_out,
    stride_in,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    """Semantics::

        for row t, columns c of block j:             # grid (T, cdiv(I, BLOCK))
            g, u = gate_up[t, c], gate_up[t, I + c]
            out[t, c] = g * sigmoid(g) * u
    """
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(gate_up_ptr + t * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_in + I + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2*I]
    """Returns a new [T, I] tensor in gate_up's dtype: silu(gate_up[:, :I]) * gate_up[:, I:]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2*I], got {tuple(gate_up.shape)}")
    check_dtype("gate_up", gate_up)
    check_dense_rows(gate_up=gate_up)
    check_launchable(gate_up)
    num_rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0 or inter == 0:
        return out
    _silu_mul_kernel[(num_rows, triton.cdiv(inter, BLOCK))](
        out,
        gate_up,
        inter,
        out.stride(0),
        gate_up.stride(0),
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out
