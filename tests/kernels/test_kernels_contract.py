"""Edges of the kernels' public contract: calls the Triton path refuses (too many slices, a
bad weight for lora_linear) are refused before anything is launched or written, the Triton
path runs wherever Triton interprets, and lora_linear gives gemm-then-add_lora's bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from loraplex.kernels import LoRABatch, add_lora
from loraplex.kernels.linear import lora_linear

# Tests on CPU tensors run the Triton path through the interpreter (tests/conftest.py sets it);
# a run with TRITON_INTERPRET=0 (the GPU machine's) runs them on CUDA where they can, or skips.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs Triton on CPU tensors: needs its interpreter")
DEVICES = [*(["cpu"] if INTERPRETING else []), *(["cuda"] if torch.cuda.is_available() else [])]


@needs_interpreter
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


def _run_with_interpret(value: str, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with TRITON_INTERPRET=value (Triton reads it when the
    kernels are defined, once per process)."""
    env = {**os.environ, "TRITON_INTERPRET": value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


_SMALL_CALL = (
    "import torch\n"
    "from loraplex.kernels import LoRABatch, add_lora, add_lora_reference\n"
    "from loraplex.kernels.linear import lora_linear\n"
    "g = torch.Generator().manual_seed(1)\n"
    "ts = torch.tensor([0, -1, 1], dtype=torch.int32)\n"
    "x, y = torch.randn(3, 16, generator=g), torch.randn(3, 32, generator=g)\n"
    "a, b, sc = torch.randn(2, 8, 16, generator=g), torch.randn(2, 32, 8, generator=g), torch.ones(2)\n"
    "batch = LoRABatch.build(ts, 2)\n"
)


@needs_interpreter  # (Triton 3.6's interpreter, on the GPU machine, cannot run these kernels)
@pytest.mark.parametrize("value", ["true", "ON"])
def test_triton_backend_runs_wherever_triton_interprets(value):
    """TRITON_INTERPRET takes the values Triton reads as true, not only "1": with Triton
    interpreting, backend='triton' on CPU tensors runs."""
    run = _run_with_interpret(value, _SMALL_CALL + (
        "expected = add_lora_reference(y, x, a, b, sc, ts)\n"
        "add_lora(y, x, a, b, sc, batch, backend='triton')\n"
        "torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)\n"
    ))
    assert run.returncode == 0, run.stderr[-2000:]


def test_triton_path_on_cpu_without_the_interpreter_is_refused_clearly():
    """Without the interpreter, add_lora, lora_linear and gemm on CPU tensors name the fix
    (the compiled kernels failed on them with "0 active drivers")."""
    run = _run_with_interpret("0", _SMALL_CALL + (
        "from loraplex.kernels.linear import gemm\n"
        "for call in (lambda: add_lora(y, x, a, b, sc, batch, backend='triton'),\n"
        "             lambda: lora_linear(x, torch.randn(32, 16), a, b, sc, batch),\n"
        "             lambda: gemm(x, torch.randn(32, 16))):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        assert 'TRITON_INTERPRET=1' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('not refused')\n"
    ))
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 32])
def test_lora_linear_gives_the_bits_of_gemm_then_add_lora(block_m, device):
    """With the shrink's K cut as add_lora cuts it (shrink_splits 0), lora_linear is gemm then
    add_lora to the bit, whatever the batch's rows per block (at 32, a prefill's, add_lora's
    expand reads y and rounds once; lora_linear's rounded the term, then the sum)."""
    from loraplex.kernels.linear import GemmConfig, gemm

    gen = torch.Generator().manual_seed(block_m)
    dtype, num_tokens = torch.float16, 40
    token_slots = torch.randint(-1, 3, (num_tokens,), generator=gen).to(torch.int32)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    weight = (torch.randn(96, 64, generator=gen) / 8).to(dtype)
    a = (torch.randn(3, 16, 64, generator=gen) / 8).to(dtype)
    b = (torch.randn(3, 96, 16, generator=gen) / 4).to(dtype)
    scaling = torch.rand(3, generator=gen) * 3
    token_slots, x, weight, a, b, scaling = (t.to(device) for t in (token_slots, x, weight, a, b, scaling))
    batch = LoRABatch.build(token_slots, 3, block_m=block_m)
    config = GemmConfig(block_m=16, block_n=32, block_k=32, splits=1, shrink_splits=0)
    fused = lora_linear(x, weight, a, b, scaling, batch, config=config)
    then = gemm(x, weight, config=config)
    add_lora(then, x, a, b, scaling, batch, backend="triton")
    assert torch.equal(fused, then)


def test_lora_linear_checks_its_weight_first():
    """A bad weight is refused as gemm refuses it, before the shrink runs: a 1-D weight was an
    IndexError from the GEMM's configuration, not the message that names the shapes."""
    x = torch.randn(4, 64)
    batch = LoRABatch.build(torch.zeros(4, dtype=torch.int32), 2)
    a, b, sc = torch.randn(2, 16, 64), torch.randn(2, 32, 16), torch.ones(2)
    with pytest.raises(ValueError, match="weight \\[out, in\\]"):
        lora_linear(x, torch.randn(32), a, b, sc, batch)
    with pytest.raises(ValueError, match="weight \\[out, in\\]"):
        lora_linear(x, torch.randn(32, 48), a, b, sc, batch)
    with pytest.raises(TypeError, match="weight is"):
        lora_linear(x, torch.randn(32, 64, dtype=torch.float16), a, b, sc, batch)
    with pytest.raises(ValueError, match="contiguous"):
        lora_linear(x, torch.randn(64, 32).T, a, b, sc, batch)
