"""Edges of the kernels' public contract: calls the Triton path refuses are refused before
anything is launched or written."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import LoRABatch, add_lora
from loraplex.kernels.linear import lora_linear


def test_too_many_slices_for_the_triton_path_are_refused_before_any_launch():
    """The expand fuses at most 3 slices: a call with 4 is refused before the shrink (and
    lora_linear's GEMM) runs, so an out= buffer keeps what it held."""
    gen = torch.Generator().manual_seed(0)
    batch = LoRABatch.build(torch.tensor([0, -1, 1], dtype=torch.int32), 2)
    x = torch.randn(3, 16, generator=gen)
    a, b, sc = torch.randn(2, 4 * 4, 16, generator=gen), torch.randn(2, 32, 4, generator=gen), torch.ones(2)
    out = torch.full((3, 32), 7.0)
    with pytest.raises(ValueError, match="at most 3 output slices"):
        lora_linear(x, torch.randn(32, 16, generator=gen), a, b, sc, batch, output_slices=(8, 8, 8, 8), out=out)
    assert torch.equal(out, torch.full((3, 32), 7.0)), "out was written by a refused call"
    y = torch.full((3, 32), 7.0)
    with pytest.raises(ValueError, match="at most 3 output slices"):
        add_lora(y, x, a, b, sc, batch, backend="triton", output_slices=(8, 8, 8, 8))
    assert torch.equal(y, torch.full((3, 32), 7.0))
    # The torch path adds any number of slices.
    add_lora(y, x, a, b, sc, batch, backend="torch", output_slices=(8, 8, 8, 8))
