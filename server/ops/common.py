"""Checks every launcher in server/ops makes before it launches."""

from __future__ import annotations

import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_launchable(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and Triton able to run there: CUDA, or the CPU under the
    interpreter (TRITON_INTERPRET=1 set before this package was imported)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the fused ops run on CUDA tensors (got {device}), or on the CPU under "
                           "TRITON_INTERPRET=1 set before loraplex.server.ops is imported")


def check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """`t` is a supported float dtype, and `dtype` when one is given."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} is {t.dtype}; use one of {SUPPORTED_DTYPES}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} is {t.dtype}, expected {dtype} (the dtypes must agree)")


def check_index(name: str, t: torch.Tensor, length: int) -> None:
    """`t` is an int32/int64 vector of `length` entries."""
    if t.dtype not in INDEX_DTYPES or tuple(t.shape) != (length,):
        raise ValueError(f"{name} must be int32 or int64 [{length}], got {t.dtype} {tuple(t.shape)}")


def check_dense_rows(**tensors: torch.Tensor) -> None:
    """Each tensor's last dimension is contiguous (rows may be strided views)."""
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension (stride {t.stride(-1)}); "
                             "call .contiguous()")
