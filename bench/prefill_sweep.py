"""Prefill: the shrink and the expand timed apart, each over its own launch parameters.

    python3 bench/prefill_sweep.py --out prefill_sweep.json

`kernels_bench.py --sweep` moves one shared knob at a time for both kernels together. Here,
for prefill q/k/v and o (8 sequences of 512 tokens, rank 16, 1 and 8 adapters), each kernel
is timed alone (CUDA-graph replay, L2 flushed before each, median) at the default
configuration and over a grid of its own parameters, with the fewest bytes each must move
against the copy bandwidth:

- shrink: x once, A once per adapter, the float32 partials written;
- expand: the partials read once, B once per adapter, y read and written.

The default shrink + expand are also timed together, and every configuration's result is
checked against the default's before it is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import PREFILL, GraphTimer, copy_bandwidth, make_case, timing_meta  # noqa: E402
from loraplex.kernels import LoRABatch, add_lora  # noqa: E402
from loraplex.kernels.configs import sgmv_config  # noqa: E402
from loraplex.kernels.expand import sgmv_expand  # noqa: E402
from loraplex.kernels.shrink import sgmv_shrink  # noqa: E402

SHRINK_GRID = dict(k_splits=(1, 2, 4, 8), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3,), block_m=(32,))
# --shrink-block-m: the shrink's rows per program apart from the expand's (the partials are
# indexed by row, so the two kernels may block the rows differently).
SHRINK_BLOCK_M_GRID = dict(k_splits=(2, 4, 8), block_k=(128,), num_warps=(4, 8), num_stages=(3,), block_m=(32, 64, 128))
EXPAND_GRID = dict(spans=(2, 4, 8, 16), block_n=(64, 128, 256), num_warps=(4, 8), num_stages=(3,))


def span_for(slices: tuple[int, ...], spans: int, block_n: int) -> int:
    span = triton.cdiv(triton.cdiv(sum(slices), spans), block_n) * block_n
    return max(block_n, min(span, triton.cdiv(max(slices), block_n) * block_n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--layers", default="qkv,o")
    p.add_argument("--adapters", default="1,8")
    p.add_argument("--shrink-block-m", action="store_true",
                   help="sweep the shrink's rows per program (32, 64, 128) and skip the expand")
    args = p.parse_args(argv)
    bw = copy_bandwidth()
    timer = GraphTimer(args.reps)
    gen = torch.Generator().manual_seed(0)
    results = []
    for layer in args.layers.split(","):
        for adapters in map(int, args.adapters.split(",")):
            c = make_case(layer, PREFILL[0] * PREFILL[1], adapters, 16, seqs=PREFILL[0], gen=gen)
            x, y0, lora_a, lora_b, scaling = c["x"], c["y"], c["lora_a"], c["lora_b"], c["scaling"]
            slices, rank, elt = c["slices"], c["rank"], x.element_size()
            batch = LoRABatch.build(c["token_slots"], c["num_slots"], max_adapters=adapters)
            cfg = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, rank, x.dtype, x.device)
            t, n = x.shape[0], len(slices)
            weights_a = adapters * n * rank * x.shape[1] * elt
            weights_b = adapters * sum(slices) * rank * elt

            batches = {m: LoRABatch.build(c["token_slots"], c["num_slots"], block_m=m, max_adapters=adapters)
                       for m in (32, 64, 128)}

            def shrink(k_splits, block_k, num_warps, num_stages, block_m=batch.block_m):
                return sgmv_shrink(x, lora_a, batches[block_m], None, rank, k_splits, block_k, num_warps, num_stages,
                                   False)

            row = {"layer": layer, "adapters": adapters, "tokens": t, "default": dataclasses.asdict(cfg)}
            y = y0.clone()
            row["both_default_us"] = timer(lambda: add_lora(y, x, lora_a, lora_b, scaling, batch, output_slices=slices))

            # Shrink: the default first, then the grid; each checked against the default's sum.
            want = shrink(cfg.k_splits, cfg.block_k, cfg.num_warps, cfg.num_stages).sum(0)
            shrinks = []
            grid = SHRINK_BLOCK_M_GRID if args.shrink_block_m else SHRINK_GRID
            for ks, bk, nw, ns, bm in itertools.product(*grid.values()):
                try:
                    got = shrink(ks, bk, nw, ns, bm).sum(0)
                    ok = torch.allclose(got, want, rtol=1e-2, atol=1e-2)
                    us = timer(lambda: shrink(ks, bk, nw, ns, bm)) if ok else None
                except Exception as exc:  # a configuration the compiler refuses: record it, go on
                    ok, us = repr(exc)[:120], None
                nbytes = x.numel() * elt + weights_a + ks * t * n * rank * 4
                shrinks.append({"k_splits": ks, "block_k": bk, "num_warps": nw, "num_stages": ns, "block_m": bm,
                                "ok": ok, "us": us,
                                "bandwidth": nbytes / (us * 1e-6) / bw if us else None})
            row["shrink_default_us"] = timer(lambda: shrink(cfg.k_splits, cfg.block_k, cfg.num_warps, cfg.num_stages))
            row["shrink"] = sorted(shrinks, key=lambda s: s["us"] or 1e9)

            if args.shrink_block_m:
                results.append(row)
                print(f"{layer} A={adapters}: shrink default {row['shrink_default_us']:.1f} best {row['shrink'][0]}",
                      flush=True)
                continue
            # Expand, on the default's partials.
            partial = shrink(cfg.k_splits, cfg.block_k, cfg.num_warps, cfg.num_stages)
            ref = y0.clone()
            sgmv_expand(ref, partial, lora_b, scaling, batch, None, slices, cfg.span, cfg.block_n, cfg.num_warps,
                        cfg.num_stages, False, cfg.add_in_memory)
            expands = []
            for spans, bn, nw, ns in itertools.product(*EXPAND_GRID.values()):
                span = span_for(slices, spans, bn)

                def expand(yy):
                    sgmv_expand(yy, partial, lora_b, scaling, batch, None, slices, span, bn, nw, ns, False, False)

                try:
                    yy = y0.clone()
                    expand(yy)
                    ok = torch.allclose(yy.float(), ref.float(), rtol=2e-2, atol=2e-2)
                    yy = y0.clone()
                    us = timer(lambda: expand(yy)) if ok else None
                except Exception as exc:  # a configuration the compiler refuses: record it, go on
                    ok, us = repr(exc)[:120], None
                nbytes = partial.numel() * 4 + weights_b + 2 * y0.numel() * elt
                expands.append({"span": span, "block_n": bn, "num_warps": nw, "num_stages": ns, "ok": ok, "us": us,
                                "bandwidth": nbytes / (us * 1e-6) / bw if us else None})
            yy = y0.clone()
            row["expand_default_us"] = timer(lambda: sgmv_expand(
                yy, partial, lora_b, scaling, batch, None, slices, cfg.span, cfg.block_n, cfg.num_warps, cfg.num_stages,
                False, cfg.add_in_memory))
            row["expand"] = sorted(expands, key=lambda s: s["us"] or 1e9)
            results.append(row)
            best_s, best_e = row["shrink"][0], row["expand"][0]
            print(f"{layer} A={adapters}: both {row['both_default_us']:.1f} | shrink default {row['shrink_default_us']:.1f}"
                  f" best {best_s['us']:.1f} {best_s} | expand default {row['expand_default_us']:.1f} best"
                  f" {best_e['us']:.1f} {best_e}", flush=True)
            args.out.write_text(json.dumps({"results": results}, indent=1))
            del c
    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bw)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
