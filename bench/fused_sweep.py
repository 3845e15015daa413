"""Prefill in one launch (kernels/fused.py) against the two-launch default, over its parameters.

    python3 bench/fused_sweep.py --out fused_sweep.json

Llama-3-8B layers, bf16, prefill rows in sequences of 512 tokens, adapter i % A for
sequence i. Every number is a median CUDA-graph replay with L2 flushed before each, every
configuration checked against the float32 reference first (the kernels bench's timer,
cases and byte count). Three stages, in this order (`--stages` picks):

1. rank 16, 4096 tokens, 1 and 8 adapters, every layer: the one-launch kernel over a grid
   of (block_m, block_k, block_n, num_warps, num_stages);
3. rank 16, one adapter, 512 to 8192 tokens: the best configuration of stage 1 per layer
   against the default, to find where one program per row block has too few programs;
2. ranks 8, 32 and 64, 4096 tokens: each layer's best three configurations of stage 1,
   adding into y with a load and a store or with reductions.

The default (`two_launch`) is what ``add_lora`` runs before this change: shrink and expand.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import (GraphTimer, copy_bandwidth, fewest_bytes, loop_per_adapter, make_case,  # noqa: E402
                           rel_error, timing_meta)
from loraplex.kernels import LoRABatch  # noqa: E402
from loraplex.kernels.add_lora import sgmv_lora  # noqa: E402
from loraplex.kernels.batch import PREFILL_BLOCK_M  # noqa: E402
from loraplex.kernels.configs import SGMVConfig, sgmv_config  # noqa: E402

GRID = dict(block_m=(16, 32), block_k=(64, 128), block_n=(128, 256), num_warps=(4, 8), num_stages=(2, 3, 4))
SEQ = 512
TOKENS = 4096
TOKEN_SWEEP = (512, 1024, 2048, 8192)


def prefill_case(layer, tokens, adapters, rank, gen):
    c = make_case(layer, tokens, adapters, rank, seqs=max(1, tokens // SEQ), gen=gen)
    groups = [(s, torch.nonzero(c["token_slots"] == s).flatten()) for s in range(c["num_slots"])]
    c["groups"] = [(s, rows) for s, rows in groups if rows.numel()]
    expected = c["y"].float()
    loop_per_adapter(expected, c["x"].float(), c["lora_a"].float(), c["lora_b"].float(), c["scaling"],
                     c["groups"], c["slices"], rank)
    c["expected"] = expected
    return c


def time_config(c, timer, block_m, config) -> dict:
    """Checks, then times one launch configuration on case c."""
    x, y0, slices = c["x"], c["y"], c["slices"]
    batch = LoRABatch.build(c["token_slots"], c["num_slots"], block_m=block_m, max_adapters=len(c["groups"]))

    def call(y):
        sgmv_lora(y, x, c["lora_a"], c["lora_b"], c["scaling"], batch, None, slices, config=config)

    try:
        y = y0.clone()
        call(y)
        torch.cuda.synchronize()
        err = rel_error(y, y0, c["expected"])
        us = timer(lambda: call(y)) if err < 2e-2 else None
    except Exception as exc:  # a configuration the compiler refuses: record it, go on
        err, us = repr(exc)[:200], None
    return {"error": err, "us": us}


def default_row(c, timer, bandwidth) -> dict:
    x = c["x"]
    batch = LoRABatch.build(c["token_slots"], c["num_slots"], max_adapters=len(c["groups"]))
    cfg = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], c["slices"], c["rank"], x.dtype, x.device)
    cfg = dataclasses.replace(cfg, fused=False)
    got = time_config(c, timer, batch.block_m, cfg)
    return {"config": dataclasses.asdict(cfg), "block_m": batch.block_m, **got,
            "bandwidth": fewest_bytes(c) / (got["us"] * 1e-6) / bandwidth if got["us"] else None}


def fused_config(block_m, block_k, block_n, num_warps, num_stages, add_in_memory=False) -> SGMVConfig:
    return SGMVConfig(k_splits=1, block_k=block_k, span=block_n, block_n=block_n, num_warps=num_warps,
                      num_stages=num_stages, add_in_memory=add_in_memory, fused=True)


def run_grid(c, timer, bandwidth, trials) -> list[dict]:
    rows = []
    for t in trials:
        t = dict(t)
        got = time_config(c, timer, t["block_m"], fused_config(**t))
        rows.append({**t, **got, "bandwidth": fewest_bytes(c) / (got["us"] * 1e-6) / bandwidth if got["us"] else None})
    return sorted(rows, key=lambda r: r["us"] or 1e9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--stages", default="1,2,3")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    timer = GraphTimer(args.reps)
    gen = torch.Generator().manual_seed(0)
    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bandwidth, grid=GRID, prefill_block_m=PREFILL_BLOCK_M)
    out = {"meta": meta, "grid": [], "ranks": [], "tokens": []}
    started = time.time()
    stages = args.stages.split(",")
    layers = args.layers.split(",")
    grid = [dict(zip(GRID, v)) for v in itertools.product(*GRID.values())]
    best: dict[str, list[dict]] = {}

    def save():
        out["meta"]["seconds"] = time.time() - started
        args.out.write_text(json.dumps(out, indent=1))

    def show(tag, row):
        f = row["fused"][0] if row.get("fused") else {}
        d = row["two_launch"]
        print(f"{tag}: two-launch {d['us'] or float('nan'):.1f} us ({d['bandwidth'] or 0:.2f}) | one launch "
              f"{f.get('us') or float('nan'):.1f} us ({f.get('bandwidth') or 0:.2f}) "
              f"{ {k: f.get(k) for k in (*GRID, 'add_in_memory')} }", flush=True)

    for layer in layers:  # stage 1
        best[layer] = [dict(block_m=16, block_k=128, block_n=256, num_warps=8, num_stages=3)]
        if "1" not in stages:
            continue
        scores: dict[tuple, float] = {}
        for adapters in (1, 8):
            c = prefill_case(layer, TOKENS, adapters, 16, gen)
            row = {"layer": layer, "tokens": TOKENS, "adapters": adapters, "rank": 16,
                   "two_launch": default_row(c, timer, bandwidth), "fused": run_grid(c, timer, bandwidth, grid)}
            for r in row["fused"]:
                key = tuple(r[k] for k in GRID)
                scores[key] = scores.get(key, 0.0) + (r["us"] or 1e9)
            out["grid"].append(row)
            show(f"{layer} r16 A={adapters}", row)
            save()
            del c
        best[layer] = [dict(zip(GRID, k)) for k in sorted(scores, key=scores.get)[:3]]
    for layer in layers if "3" in stages else ():
        for tokens in TOKEN_SWEEP:
            c = prefill_case(layer, tokens, 1, 16, gen)
            row = {"layer": layer, "tokens": tokens, "adapters": 1, "rank": 16,
                   "two_launch": default_row(c, timer, bandwidth),
                   "fused": run_grid(c, timer, bandwidth, best[layer][:1])}
            out["tokens"].append(row)
            show(f"{layer} r16 T={tokens}", row)
            save()
            del c
    for layer in layers if "2" in stages else ():
        for rank in (8, 32, 64):
            for adapters in (1, 8):
                c = prefill_case(layer, TOKENS, adapters, rank, gen)
                trials = [{**t, "add_in_memory": aim} for t in best[layer] for aim in (False, True)]
                row = {"layer": layer, "tokens": TOKENS, "adapters": adapters, "rank": rank,
                       "two_launch": default_row(c, timer, bandwidth), "fused": run_grid(c, timer, bandwidth, trials)}
                out["ranks"].append(row)
                show(f"{layer} r{rank} A={adapters}", row)
                save()
                del c
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
