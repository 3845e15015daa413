"""Does the LoRA term overlap with the base GEMM on one GPU? Timed in one run, per layer.

    python3 bench/overlap_bench.py --out overlap.json

At decode the LoRA term is a chain of two small kernels after the base GEMM (x @ W^T into y):
the shrink (x @ A^T, which needs only x) and the expand (v @ B^T added into y). The shrink
could run on a second stream beside the GEMM, leaving only the expand after it. Whether
that saves anything depends on whether the GEMM leaves room on the SMs, which only a
measurement says. For each Llama-3-8B layer at decode (64 tokens, 1 and 32 rank-16
adapters in 64 slots), each variant is captured as a CUDA graph and its replays timed with
L2 flushed before each (median), after a check against the serial result:

- `gemm`: the base GEMM alone;
- `serial`: the GEMM, then add_lora (what the engine runs);
- `fork_shrink`: the shrink on a side stream beside the GEMM, the expand after both;
- `fork_all_bound`: shrink and expand into a separate zeroed buffer on the side stream beside
  the GEMM, nothing after (not a correct result: the floor for a consumer that adds the
  buffer in a kernel it runs anyway, such as RoPE or the residual add).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import LAYERS, GraphTimer, make_case, timing_meta  # noqa: E402
from loraplex.kernels import LoRABatch, add_lora  # noqa: E402
from loraplex.kernels.configs import sgmv_config  # noqa: E402
from loraplex.kernels.expand import sgmv_expand  # noqa: E402
from loraplex.kernels.shrink import sgmv_shrink  # noqa: E402


def variants(c: dict) -> dict:
    x, lora_a, lora_b, scaling, slots, weight = (c[k] for k in ("x", "lora_a", "lora_b", "scaling", "token_slots",
                                                                 "weight"))
    slices, rank = c["slices"], c["rank"]
    batch = LoRABatch.build(slots, c["num_slots"], max_adapters=c["num_adapters"] if isinstance(c["num_adapters"], int)
                            else None)
    cfg = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, rank, x.dtype, x.device)
    side = torch.cuda.Stream()
    delta = torch.zeros_like(c["y"])

    def gemm(y):
        torch.matmul(x, weight.T, out=y)

    def serial(y):
        gemm(y)
        add_lora(y, x, lora_a, lora_b, scaling, batch, output_slices=slices)

    def fork_shrink(y):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            partial = sgmv_shrink(x, lora_a, batch, None, rank, cfg.k_splits, cfg.block_k, cfg.num_warps,
                                  cfg.num_stages, False)
        gemm(y)
        main.wait_stream(side)
        sgmv_expand(y, partial, lora_b, scaling, batch, None, slices, cfg.span, cfg.block_n, cfg.num_warps,
                    cfg.num_stages, False, cfg.add_in_memory)

    def fork_all_bound(y):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            delta.zero_()
            partial = sgmv_shrink(x, lora_a, batch, None, rank, cfg.k_splits, cfg.block_k, cfg.num_warps,
                                  cfg.num_stages, False)
            sgmv_expand(delta, partial, lora_b, scaling, batch, None, slices, cfg.span, cfg.block_n, cfg.num_warps,
                        cfg.num_stages, False, cfg.add_in_memory)
        gemm(y)
        main.wait_stream(side)

    return {"gemm": gemm, "serial": serial, "fork_shrink": fork_shrink, "fork_all_bound": fork_all_bound}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--adapters", default="1,32")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    timer = GraphTimer(args.reps)
    results = []
    for layer in LAYERS:
        for adapters in (int(a) for a in args.adapters.split(",")):
            c = make_case(layer, args.tokens, adapters, 16, gen=gen, slots=64)
            fns = variants(c)
            want = c["y"].clone()
            fns["serial"](want)
            row = {"layer": layer, "tokens": args.tokens, "adapters": adapters, "us": {}, "errors": {}}
            for name, fn in fns.items():
                y = c["y"].clone()
                fn(y)
                torch.cuda.synchronize()
                if name == "fork_shrink":
                    err = float((y.float() - want.float()).norm() / want.float().norm())
                    row["errors"][name] = err
                    if not err < 1e-2:
                        row["us"][name] = None
                        continue
                row["us"][name] = timer(lambda: fn(y))
            us = row["us"]
            row["lora_serial_us"] = us["serial"] - us["gemm"]
            if us["fork_shrink"]:
                row["lora_fork_shrink_us"] = us["fork_shrink"] - us["gemm"]
            row["lora_fork_all_bound_us"] = us["fork_all_bound"] - us["gemm"]
            results.append(row)
            print(f"{layer:8s} A={adapters:3d} " + " ".join(f"{k} {v:7.1f}" if v else f"{k} -" for k, v in us.items()),
                  flush=True)
            del c
    meta = timing_meta(args.reps, slots=64)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
