"""An adapter's F32 weights converted to the serving dtype at staging (node_agent.convert):
the bits torch's own conversion gives, every other tensor and the metadata as they were, a
file a server reads back, and the server's host copy the same whichever file it reads."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.node_agent.convert import float32_to_bfloat16_bits, serving_copy_size, write_serving_copy
from loraplex.server.adapter_format import WEIGHTS_FILE, read_safetensors_header, serving_weights, serving_weights_name


def test_bfloat16_bits_are_torchs():
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38,
                          1e-45, -1e-45, 1.17549435e-38, 65504.0, 1.00390625, 1.01171875, 3.0039062])
    # Ties: mantissas whose dropped 16 bits are exactly 0x8000, with even and odd kept bits.
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000], dtype=torch.int64).to(torch.int32)
    values = torch.cat([torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-30, 30, (100_000,), generator=gen),
                        edges, ties.view(torch.float32)])
    want = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(float32_to_bfloat16_bits(values.numpy()), want)
    nan = float32_to_bfloat16_bits(np.array([np.nan, -np.nan, np.float32(np.nan) * 0], dtype=np.float32))
    assert torch.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16).float()).all()


def _adapter(directory, gen) -> dict[str, torch.Tensor]:
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32, generator=gen),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4, generator=gen),
        "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight": torch.randn(4, 32, generator=gen).half(),
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": torch.randn(32, 4, generator=gen),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_serving_copy_converts_f32_and_keeps_the_rest(tmp_path, dtype):
    tensors = _adapter(tmp_path, torch.Generator().manual_seed(1))
    original = (tmp_path / WEIGHTS_FILE).read_bytes()
    size = serving_copy_size(tmp_path, dtype)
    path = write_serving_copy(tmp_path, dtype)
    assert path == tmp_path / serving_weights_name(dtype) == serving_weights(tmp_path, dtype)
    assert path.stat().st_size == size  # known before a byte is written
    assert (tmp_path / WEIGHTS_FILE).read_bytes() == original  # the digest'd file is untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    read_safetensors_header(path)  # whole: every range checked against the file
    got = load_file(str(path))
    assert got.keys() == tensors.keys()
    for key, t in tensors.items():
        want = t.to(getattr(torch, dtype)) if t.dtype == torch.float32 else t
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0 and json.loads(path.read_bytes()[8:8 + n])["__metadata__"] == {"format": "pt"}


def test_no_serving_copy_when_nothing_to_convert(tmp_path):
    _adapter(tmp_path / "a", torch.Generator().manual_seed(2))
    assert write_serving_copy(tmp_path / "a", "float32") is None
    assert serving_copy_size(tmp_path / "a", "float32") is None
    assert serving_weights(tmp_path / "a", "float32") == tmp_path / "a" / WEIGHTS_FILE
    save_file({"x.lora_A.weight": torch.randn(2, 2).bfloat16()}, str(tmp_path / WEIGHTS_FILE))
    assert write_serving_copy(tmp_path, "bfloat16") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", WEIGHTS_FILE]
    with pytest.raises(ValueError, match="dtype"):
        write_serving_copy(tmp_path / "a", "int8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_serving_copy_is_written_a_piece_at_a_time(tmp_path, dtype):
    """The copy held the whole file in memory, and its converted tensors beside it (2.5x the
    adapter's size, per download in flight: a rank-64 adapter of a 70B base is over a GB); it
    holds a few MiB whatever the size (about 3 here), the same bits."""
    import tracemalloc

    gen = torch.Generator().manual_seed(3)
    tensors = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight":
               torch.randn(*((64, 8192) if ab == "A" else (8192, 64)), generator=gen)
               for i in range(4) for ab in "AB"}  # 8 tensors of 2 MiB: 16 MiB
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    tracemalloc.start()
    try:
        path = write_serving_copy(tmp_path, dtype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, peak  # (over 16 MiB before: the file, and its copy)
    got = load_file(str(path))
    for key, t in tensors.items():
        assert torch.equal(got[key], t.to(getattr(torch, dtype))), key
