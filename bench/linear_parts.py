"""Where a decode layer's ``lora_linear`` spends its time, part by part, and ``lm_head``
through our GEMM, on Llama-3-8B shapes (bf16), in one run.

    python3 bench/linear_parts.py --out parts.json

Per layer, row count and adapters (rank 16, rows assigned as kernels_bench.py assigns them):
  - ``cublas``, ``gemm``: the base GEMM alone;
  - ``shrink``: the shrink alone, as lora_linear launches it (4 K splits);
  - ``shrink_gemm``: the shrink then our GEMM chained by PDL, as in lora_linear, without the
    expand (checked against the base product);
  - ``expand``: the expand alone, on a finished shrink's planes (checked once, then timed
    adding into y again and again);
  - ``lora_linear``: all three (checked against the float32 reference), and
    ``lora_linear_span{S}``: the same with the expand's columns per program set to S;
  - with ``--variants``, the expand with one tile a program (``expand_bn{N}_w{W}``: N columns
    in one load, W warps), alone and in the chain (``chain_...``), and the shrink's K splits,
    step and stages (``chain_shrink_s{S}_k{K}_st{T}``).
Commit 50989c7's version also timed the LoRA term in the GEMM's epilogue, b6da366's B
prefetched into L2 by the shrink and W's loads marked evict-first, c0e68c1's
the GEMM and the expand slice by slice, and 2209403's the term-first order (shrink and
expand before the GEMM, which added their term as it wrote y) part by part (all four
dropped).
Then ``lm_head`` (4096 -> 128,256): cuBLAS against ``gemm`` at its default configuration and
around it.
Timing as kernels_bench.py: CUDA-graph replay, L2 flushed before each, median.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import GraphTimer, copy_bandwidth, launch_floor, loop_per_adapter, make_case, timing_meta  # noqa: E402
from linear_sweep import checked  # noqa: E402
from loraplex.kernels import LoRABatch  # noqa: E402
from loraplex.kernels.configs import sgmv_config  # noqa: E402
from loraplex.kernels.expand import sgmv_expand  # noqa: E402
from loraplex.kernels.linear import gemm, gemm_config, lora_linear  # noqa: E402
from loraplex.kernels.shrink import sgmv_shrink  # noqa: E402

CASES = (("qkv", 64, 16), ("qkv", 64, 32), ("o", 64, 32), ("gate_up", 64, 16), ("gate_up", 64, 32),
         ("down", 64, 32), ("gate_up", 16, 16))
SPANS = (256, 512, 2048)
# (columns per program = columns per load, warps)
EXPAND_VARIANTS = ((256, 4), (512, 4), (512, 8), (1024, 8))
# (K splits, input columns per step, stages)
SHRINK_VARIANTS = ((2, None, 3), (8, None, 3), (4, 64, 5), (4, 256, 3))
LM_HEAD = (4096, 128256)


def run_case(layer: str, tokens: int, adapters: int, timer, variants: bool = False) -> dict:
    gen = torch.Generator().manual_seed(tokens * 100 + adapters)
    c = make_case(layer, tokens, adapters, 16, gen=gen)
    x, weight, slices = c["x"], c["weight"], c["slices"]
    lora_a, lora_b, scaling, slots = c["lora_a"], c["lora_b"], c["scaling"], c["token_slots"]
    batch = LoRABatch.build(slots, c["num_slots"], max_adapters=adapters)
    base_ref = x.float() @ weight.float().T
    expected = base_ref.clone()
    groups = [(s, torch.nonzero(slots == s).flatten()) for s in range(c["num_slots"])]
    loop_per_adapter(expected, x.float(), lora_a.float(), lora_b.float(), scaling,
                     [(s, rows) for s, rows in groups if rows.numel()], slices, 16)
    out = torch.empty(tokens, weight.shape[0], dtype=x.dtype, device=x.device)
    config = gemm_config(tokens, weight)
    sgmv = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, 16, x.dtype, x.device)

    def shrink(trigger=0):
        return sgmv_shrink(x, lora_a, batch, None, 16, config.shrink_splits, sgmv.block_k, sgmv.num_warps,
                           sgmv.num_stages, trigger=trigger)

    def shrink_gemm():
        shrink(trigger=1 if config.pdl else 0)
        return gemm(x, weight, out, config, pdl=config.pdl)

    def chain(span, block_n=None, warps=None, splits=None, block_k=None, stages=None):
        partial = sgmv_shrink(x, lora_a, batch, None, 16, splits or config.shrink_splits, block_k or sgmv.block_k,
                              sgmv.num_warps, stages or sgmv.num_stages, trigger=1 if config.pdl else 0)
        gemm(x, weight, out, config, pdl=config.pdl)
        sgmv_expand(out, partial, lora_b, scaling, batch, None, slices, span, block_n or sgmv.block_n,
                    warps or sgmv.num_warps, sgmv.num_stages, pdl=config.pdl, add_in_memory=True)
        return out

    row = {"layer": layer, "tokens": tokens, "adapters": adapters, "gemm_config": dataclasses.asdict(config),
           "sgmv_config": dataclasses.asdict(sgmv), "errors": {}, "us": {}}
    us, errors = row["us"], row["errors"]
    us["cublas"] = timer(lambda: torch.matmul(x, weight.T, out=out))
    errors["gemm"], us["gemm"] = checked(lambda: gemm(x, weight, out, config), base_ref, timer)
    us["shrink"] = timer(shrink)
    errors["shrink_gemm"], us["shrink_gemm"] = checked(shrink_gemm, base_ref, timer)
    partial = shrink()
    gemm(x, weight, out, config)

    def expand(span=sgmv.span, block_n=sgmv.block_n, warps=sgmv.num_warps):
        sgmv_expand(out, partial, lora_b, scaling, batch, None, slices, span, block_n, warps, sgmv.num_stages,
                    add_in_memory=True)
        return out

    errors["expand"], _ = checked(expand, expected, lambda fn: None)
    us["expand"] = timer(expand)
    for block_n, warps in EXPAND_VARIANTS if variants else ():
        gemm(x, weight, out, config)
        name = f"expand_bn{block_n}_w{warps}"
        errors[name], _ = checked(lambda: expand(block_n, block_n, warps), expected, lambda fn: None)
        us[name] = timer(lambda: expand(block_n, block_n, warps))
    errors["lora_linear"], us["lora_linear"] = checked(
        lambda: lora_linear(x, weight, lora_a, lora_b, scaling, batch, output_slices=slices, out=out, config=config),
        expected, timer)
    for span in SPANS:
        if span != sgmv.span:
            errors[f"lora_linear_span{span}"], us[f"lora_linear_span{span}"] = checked(
                lambda: chain(span), expected, timer)
    for block_n, warps in EXPAND_VARIANTS if variants else ():
        name = f"chain_expand_bn{block_n}_w{warps}"
        errors[name], us[name] = checked(lambda: chain(block_n, block_n, warps), expected, timer)
    for splits, block_k, stages in SHRINK_VARIANTS if variants else ():
        name = f"chain_shrink_s{splits}_k{block_k or sgmv.block_k}_st{stages}"
        errors[name], us[name] = checked(lambda: chain(sgmv.span, splits=splits, block_k=block_k, stages=stages),
                                         expected, timer)
    return row


def run_lm_head(tokens: int, timer) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    k, n = LM_HEAD
    x = torch.randn(tokens, k, generator=gen).to("cuda", torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to("cuda", torch.bfloat16)
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    ref = x.float() @ weight.float().T
    default = gemm_config(tokens, weight)
    row = {"layer": "lm_head", "tokens": tokens, "default": dataclasses.asdict(default), "us": {}, "errors": {},
           "cublas": timer(lambda: torch.matmul(x, weight.T, out=out))}
    variants = {"default": default}
    for block_n in (128, 256):
        variants[f"block_n{block_n}"] = dataclasses.replace(default, block_n=block_n)
    for stages in (3, 4, 5):
        if stages != default.num_stages:
            variants[f"stages{stages}"] = dataclasses.replace(default, num_stages=stages)
    variants["block_n128_warps8"] = dataclasses.replace(default, block_n=128, num_warps=8)
    for name, cfg in variants.items():
        row["errors"][name], row["us"][name] = checked(lambda: gemm(x, weight, out, cfg), ref, timer)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="parts.json")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--variants", action="store_true", help="also time expand and shrink launch variants")
    parser.add_argument("--no-lm-head", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    timer = GraphTimer(args.reps)
    result = {"meta": timing_meta(args.reps, copy_bandwidth=copy_bandwidth(), launch_floor=launch_floor(timer)),
              "rows": [], "lm_head": []}
    for case in CASES:
        row = run_case(*case, timer, args.variants)
        result["rows"].append(row)
        print(f"{case}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in row["us"].items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for tokens in () if args.no_lm_head else (1, 16, 64):
        row = run_lm_head(tokens, timer)
        result["lm_head"].append(row)
        print(f"lm_head {tokens}: cublas {row['cublas']:.1f}, " + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row["us"].items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
