"""A decode step's rows that no request holds (holes left by finished requests, and the
bucket's padding past the busy rows) attend to one key, not to the whole cache: they went
at the cache's last position, so with CUDA graphs (whose key bound is the cache's length)
each free row of a step read max_len keys of every layer. A row that a request holds but
the step does not decode (mid chunked prefill) stays at the last position, so the keys of
its prompt are not written over."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.batch import DecodeRunner, kv_bucket
from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams

from .test_ops import DEVICE, tiny_model

# The fused ops run interpreted on the CPU (the suite), or on CUDA (TRITON_INTERPRET=0 on a GPU).
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET is off and there is no CUDA device")

MAX_LEN = 48


def held(model, row: int, prompt: int, outputs: int, slot: int = -1) -> Request:
    """A request in KV row `row` with `prompt` prompt tokens and `outputs` sampled ones."""
    req = Request(f"r{row}", [1] * prompt, SamplingParams(), None, 0, slot=slot)
    req.row, req.output_ids = row, [5 + i for i in range(outputs)]
    return req


def busy_rows(model, rows: list[int]) -> None:
    taken = [model.kv.alloc() for _ in range(max(rows) + 1)]
    for row in taken:
        if row not in rows:
            model.kv.free(row)


def test_free_rows_read_one_key_and_held_rows_keep_their_keys():
    model = tiny_model(torch.float32, fused=True, device=DEVICE, max_len=MAX_LEN, rows=8)
    runner = DecodeRunner(model, max_rows=8, kv_block=16, cuda_graphs=False)
    # Rows 0 and 3 decode, row 2 is mid chunked prefill (12 prompt tokens in), rows 1 and
    # 4..7 are free: span 4 -> bucket 4; then row 4 busy too: span 5 -> bucket 8.
    busy_rows(model, [0, 2, 3, 4])
    decoding = {0: held(model, 0, 7, 2, slot=0), 3: held(model, 3, 20, 3, slot=1), 4: held(model, 4, 3, 1)}
    prompt_keys = [t[2, :, :12].clone() for t in model.kv.k + model.kv.v]
    nan = float("nan")
    for t in model.kv.k + model.kv.v:  # what a free row holds is dead: any of it read shows
        t[1] = nan
        t[5:] = nan
    logits = runner.run(decoding, model.kv.span())
    positions = runner.last_args[1].tolist()
    assert positions == [8, 0, MAX_LEN - 1, 22, 3, 0, 0, 0]
    # With graphs the bound is the cache's length: each row reads min(position + 1, bound) keys.
    bound = kv_bucket(max(positions), 16, MAX_LEN, graphs=True)
    assert [min(p + 1, bound) for i, p in enumerate(positions) if i in (1, 5, 6, 7)] == [1, 1, 1, 1]
    # The fused attention (the graphs' kernel) read no dead key of a free row.
    assert torch.isfinite(logits).all()
    for before, t in zip(prompt_keys, model.kv.k + model.kv.v):
        assert torch.equal(t[2, :, :12], before)
