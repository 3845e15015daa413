"""read_into_host on real safetensors files: what lands in a HostCopy, element by element.

Rules under test: a HostCopy starts as garbage (torch.empty; on CUDA a recycled pinned block)
and `fill` leaves no element of it untouched: every padding element is exactly zero and
every real element equals the file's tensor, at any rank below the max, for any subset of
target modules, with alignment gaps in the layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.server.adapter_format import WEIGHTS_FILE, BaseSpec, read_adapter, write_adapter_config
from loraplex.server.adapters import GROUPS, LoRABuffers, random_adapter
from loraplex.server.config import named_shape
from loraplex.server.host_tier import host_copy_from_tensors, read_into_host

# Sizes that are not multiples of ALIGN_ELEMS, so the layout has gaps between views.
ODD = dataclasses.replace(named_shape("tiny"), hidden_size=40, intermediate_size=72, head_dim=10)
R_MAX = 6


def write_mixed_adapter(path: Path, cfg=ODD) -> Path:
    """q_proj and down_proj at rank 3, v_proj at rank 6 (rank_pattern); k, o, gate, up not targeted."""
    _, low = random_adapter(cfg, 3, targets=("q_proj", "down_proj"), seed=1)
    _, full = random_adapter(cfg, R_MAX, targets=("v_proj",), seed=2)
    path.mkdir(parents=True, exist_ok=True)
    write_adapter_config(path, r=3, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"],
                         rank_pattern={"v_proj": R_MAX})
    save_file({k: v.contiguous() for k, v in (low | full).items()}, str(path / WEIGHTS_FILE))
    return path


def base_spec(cfg=ODD) -> BaseSpec:
    return BaseSpec(num_layers=cfg.num_layers, module_shapes=cfg.module_shapes(), max_rank=R_MAX)


def poison_allocations(monkeypatch) -> None:
    """torch.empty hands back garbage from here on, as a recycled pinned block does."""
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", empty)


def written(buffers: LoRABuffers, spec) -> torch.Tensor:
    """bool [slot_elems]: the elements the adapter's tensors land on; all others are padding."""
    mask = torch.zeros(buffers.layout.slot_elems, dtype=torch.bool)
    for layer, groups in enumerate(buffers.layout.views(mask, torch.zeros(buffers.layout.n_scales))):
        for name, projs in GROUPS.items():
            g, off = groups[name], 0
            for i, (proj, width) in enumerate(zip(projs, g.slices)):
                m = spec.module(layer, proj)
                if m is not None:
                    g.a[i * R_MAX: i * R_MAX + m.rank] = True
                    g.b[off: off + width, : m.rank] = True
                off += width
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: the f32 file is converted
@pytest.mark.parametrize("source", ["file", "memory"])
def test_a_poisoned_allocation_is_filled_whole(tmp_path, monkeypatch, dtype, source):
    path = write_mixed_adapter(tmp_path / "a")
    spec = read_adapter(path, base_spec())
    tensors = load_file(str(path / WEIGHTS_FILE))
    buffers = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), dtype)
    assert buffers.layout.gaps and {m.rank for m in spec.modules} == {3, R_MAX}
    poison_allocations(monkeypatch)
    if source == "file":
        host = read_into_host(path, spec, buffers, pin=False)
    else:
        host = host_copy_from_tensors(spec, tensors, buffers, pin=False)

    mask = written(buffers, spec)
    assert 0 < int(mask.sum()) < mask.numel()
    assert torch.equal(host.flat[~mask], torch.zeros_like(host.flat[~mask]))  # padding, gaps, untargeted
    for layer, groups in enumerate(host.layers):
        for name, projs in GROUPS.items():
            g, off = groups[name], 0
            for i, (proj, width) in enumerate(zip(projs, g.slices)):
                m = spec.module(layer, proj)
                if m is None:
                    assert g.scaling[i] == 0, (layer, proj)
                else:
                    assert torch.equal(g.a[i * R_MAX: i * R_MAX + m.rank], tensors[m.key_a].to(dtype)), m.key_a
                    assert torch.equal(g.b[off: off + width, : m.rank], tensors[m.key_b].to(dtype)), m.key_b
                    assert g.scaling[i] == pytest.approx(m.scaling), (layer, proj)
                off += width
    assert int(host.rank[0]) == R_MAX
    reference = LoRABuffers(ODD, 1, R_MAX, torch.device("cpu"), dtype)  # torch.zeros, then the views
    reference.write(0, spec, tensors)
    assert torch.equal(host.flat, reference.flat[0]) and torch.equal(host.scales, reference.scales[0])
