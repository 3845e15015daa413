"""Decode: the one-launch kernel (shrink_expand.py) over its launch parameters, against the
default configuration, on Llama-3-8B layer shapes (bf16), in one run.

    python3 bench/one_launch_sweep.py --out one_launch_sweep.json [--ranks 8,16,64]

For each decode case (layer x tokens x distinct adapters x rank): `ours` (add_lora as it
is configured now), then the one-launch kernel at every point of a grid of span x block_k
x num_warps x num_stages, each checked against the float32 reference before it is timed
(CUDA-graph replay, L2 flushed before each, median), and the base GEMM of the layer. The
JSON keeps every point; the printout the default, the best point and the best of each span.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import (GraphTimer, copy_bandwidth, launch_floor, loop_per_adapter, make_case,  # noqa: E402
                           rel_error, timing_meta)
from loraplex.kernels import LoRABatch, add_lora  # noqa: E402
from loraplex.kernels.add_lora import sgmv_lora  # noqa: E402
from loraplex.kernels.configs import SGMVConfig, sgmv_config, supports_pdl  # noqa: E402

GRID = dict(span=(256, 512, 1024, 2048), block_k=(128, 256, 512), num_warps=(4, 8), num_stages=(2, 3, 4))
TOKENS_ADAPTERS = [(1, 1), (8, 1), (8, 8), (8, "per-token"), (64, 1), (64, 8), (64, 16), (64, 32), (64, "per-token"),
                   (256, 1), (256, 8), (256, 32), (256, "per-token")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--ranks", default="16")
    args = p.parse_args(argv)
    bw = copy_bandwidth()
    timer = GraphTimer(args.reps)
    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bw, grid=GRID, launch_floor=launch_floor(timer))
    gen = torch.Generator().manual_seed(0)
    results, started = [], time.time()
    for layer in args.layers.split(","):
        for rank in map(int, args.ranks.split(",")):
            for tokens, adapters in TOKENS_ADAPTERS:
                c = make_case(layer, tokens, adapters, rank, gen=gen)
                x, y0, lora_a, lora_b, scaling = c["x"], c["y"], c["lora_a"], c["lora_b"], c["scaling"]
                slices, slots, S, weight = c["slices"], c["token_slots"], c["num_slots"], c["weight"]
                groups = [(s, torch.nonzero(slots == s).flatten()) for s in range(S)]
                groups = [(s, rows) for s, rows in groups if rows.numel()]
                batch = LoRABatch.build(slots, S, max_adapters=len(groups))
                expected = y0.float()
                loop_per_adapter(expected, x.float(), lora_a.float(), lora_b.float(), scaling, groups, slices, rank)
                default = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, rank, x.dtype, x.device)

                def timed(fn):
                    y = y0.clone()
                    fn(y)
                    torch.cuda.synchronize()
                    err = rel_error(y, y0, expected)
                    return err, (timer(lambda: fn(y)) if err < 2e-2 else None)

                err, ours = timed(lambda y: add_lora(y, x, lora_a, lora_b, scaling, batch, output_slices=slices))
                out = torch.empty_like(y0)
                base = timer(lambda: torch.matmul(x, weight.T, out=out))
                row = dict(layer=layer, rank=rank, tokens=tokens, adapters=adapters, blocks=batch.num_blocks,
                           default=default.__dict__, ours_us=ours, ours_error=err, base_gemm_us=base, sweep=[])
                for span, block_k, warps, stages in itertools.product(*GRID.values()):
                    cfg = SGMVConfig(k_splits=1, block_k=block_k, span=span, block_n=default.block_n, num_warps=warps,
                                     num_stages=stages, pdl=supports_pdl(x.device), add_in_memory=True, one_launch=True)
                    try:
                        err, us = timed(lambda y: sgmv_lora(y, x, lora_a, lora_b, scaling, batch, None, slices,
                                                            config=cfg))
                    except Exception as exc:  # a configuration the compiler refuses: record it, go on
                        err, us = repr(exc)[:200], None
                    row["sweep"].append(dict(span=span, block_k=block_k, num_warps=warps, num_stages=stages,
                                             error=err, us=us))
                ok = [t for t in row["sweep"] if t["us"]]
                best = min(ok, key=lambda t: t["us"]) if ok else None
                row["best"] = best
                results.append(row)
                by_span = {s: min((t["us"] for t in ok if t["span"] == s), default=None) for s in GRID["span"]}
                print(f"{layer:8s} r={rank:2d} T={tokens:4d} A={str(adapters):9s} ours {ours:6.1f} base {base:6.1f} "
                      f"best {best['us'] if best else float('nan'):6.1f} "
                      f"{ {k: v for k, v in best.items() if k not in ('error', 'us')} if best else ''} "
                      f"by span {by_span}", flush=True)
                args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    meta["seconds"] = time.time() - started
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
