"""A decode layer's base GEMM plus its LoRA term, the way the engine runs it now (cuBLAS, then
``add_lora``) against ``lora_linear`` (our GEMM with the shrink overlapping it), on
Llama-3-8B decode shapes (bf16), in one run.

    python3 bench/linear_sweep.py --out linear.json [--sweep]

For each layer and token count:
  1. ``cublas``: ``torch.matmul(x, W.T)``; ``gemm``: ``loraplex.kernels.linear.gemm`` at its
     default configuration (``--sweep``: and around it), checked against float32 first;
  2. with adapters (rank 16, rows assigned as kernels_bench.py assigns them), each checked
     against the float32 reference (relative error of the whole output):
     - ``cublas_add_lora``: cuBLAS, then ``add_lora`` (the engine's decode layer before);
     - ``gemm_add_lora``: our GEMM, then ``add_lora``, one after the other;
     - ``lora_linear``: the shrink, our GEMM and the expand overlapped (PDL);
     - ``lora_linear_shrink4``: the same with the shrink cut into 4 K splits;
  3. ``*_lora_us``: each path minus its own GEMM alone, and ``*_over_base``: that over cuBLAS
     alone (the issue's "LoRA term over its base GEMM", in a layer).
With ``--grid``: the GEMM alone (no adapters) at every configuration of a grid around the
token count's tile height (rows per tile, K splits, stages, tile width), for the defaults.
With ``--issue-table``: issue 2's decode table where the engine runs ``lora_linear`` (1, 8,
32 and 64 tokens; 1, 8, 32 adapters and one per token, up to the tokens; ranks 8 and 16),
``cublas``, ``cublas_add_lora`` and ``lora_linear`` only (commit 50989c7's run, when
``lora_linear``'s default was a dropped design, calls the engine's path ``lora_linear_unfused``).
Timing as kernels_bench.py: CUDA-graph replay, L2 flushed before each, median.
Commit 1975db0's version of this script swept the configurations of the GEMM that the
defaults come from (``linear_h200_lora_programs.json``), and 2209403's also timed the
dropped term-first order (``lora_linear_term_first``, ``linear_h200_sweep_term_first.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import torch
import triton

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import (LAYERS, GraphTimer, copy_bandwidth, launch_floor, loop_per_adapter, make_case,  # noqa: E402
                           timing_meta)
from loraplex.kernels import LoRABatch, add_lora  # noqa: E402
from loraplex.kernels.linear import gemm, gemm_config, lora_linear  # noqa: E402

TOKENS = (1, 16, 64)
ADAPTERS = {1: (1,), 16: (1, 16), 32: (1, 8, 32), 64: (1, 8, 16, 32), 128: (16, 32)}
ISSUE_TOKENS = (1, 8, 32, 64)
ISSUE_RANKS = (8, 16)


def issue_adapters(tokens: int) -> tuple[int, ...]:
    """Issue 2's adapter counts (1, 8, 32, one per token) that fit in `tokens` rows."""
    return tuple(sorted({a for a in (1, 8, 32, tokens) if a <= tokens}))


def around(default):
    """Configurations next to the default: tile width, K splits, stages."""
    for block_n in (32, 128):
        yield dataclasses.replace(default, block_n=block_n)
    for splits in (default.splits * 2, max(1, default.splits // 2)):
        if splits != default.splits:
            yield dataclasses.replace(default, splits=splits)
    yield dataclasses.replace(default, num_stages=8 - default.num_stages)


def rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


def checked(fn, expected, timer, limit=1e-2) -> tuple[float | str, float | None]:
    try:
        y = fn()
        torch.cuda.synchronize()
    except Exception as exc:  # a configuration the compiler refuses (shared memory): recorded, the run goes on
        return repr(exc)[:160], None
    err = rel(y, expected)
    return err, (timer(fn) if err < limit else None)



def grid_configs(default, tokens: int):
    """Tile heights (the rows rounded up to a power of two, up to 128, and half of it), K
    splits 1-4, 3-5 stages, 64 or 128 columns."""
    top = max(16, min(128, triton.next_power_of_2(tokens)))
    for block_m in sorted({top, max(16, top // 2)}):
        for splits, stages, block_n in itertools.product((1, 2, 4), (3, 4, 5), (64, 128)):
            yield dataclasses.replace(default, block_m=block_m, splits=splits, num_stages=stages, block_n=block_n)


def run_grid(layer: str, tokens: int, timer) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    c = make_case(layer, tokens, 1, 16, gen=gen)
    x, weight = c["x"], c["weight"]
    ref = x.float() @ weight.float().T
    out = torch.empty(tokens, weight.shape[0], dtype=x.dtype, device=x.device)
    default = gemm_config(tokens, weight)
    row = {"layer": layer, "tokens": tokens, "default": dataclasses.asdict(default), "grid": [],
           "cublas_us": timer(lambda: torch.matmul(x, weight.T, out=out))}
    row["gemm_error"], row["gemm_us"] = checked(lambda: gemm(x, weight, out, default), ref, timer)
    for cfg in grid_configs(default, tokens):
        err, us = checked(lambda: gemm(x, weight, out, cfg), ref, timer)
        row["grid"].append({**dataclasses.asdict(cfg), "error": err, "us": us})
    timed = [g for g in row["grid"] if g["us"] is not None]
    row["best"] = min(timed, key=lambda g: g["us"]) if timed else None
    return row


def run_shape(layer: str, tokens: int, timer, sweep: bool, rank: int = 16, issue_table: bool = False) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    counts = issue_adapters(tokens) if issue_table else ADAPTERS[tokens]
    c0 = make_case(layer, tokens, counts[0], rank, gen=gen)
    x, weight, slices = c0["x"], c0["weight"], c0["slices"]
    base_ref = x.float() @ weight.float().T
    out = torch.empty(tokens, weight.shape[0], dtype=x.dtype, device=x.device)
    default = gemm_config(tokens, weight)
    row = {"layer": layer, "tokens": tokens, "rank": rank, "default": dataclasses.asdict(default), "adapters": {},
           "cublas_us": timer(lambda: torch.matmul(x, weight.T, out=out))}
    row["gemm_error"], row["gemm_us"] = checked(lambda: gemm(x, weight, out, default), base_ref, timer)
    if sweep:
        row["sweep"] = []
        for cfg in around(default):
            err, us = checked(lambda: gemm(x, weight, out, cfg), base_ref, timer)
            row["sweep"].append({**dataclasses.asdict(cfg), "error": err, "us": us})

    for adapters in counts:
        c = make_case(layer, tokens, adapters, rank, gen=gen)
        lora_a, lora_b, scaling, slots = c["lora_a"], c["lora_b"], c["scaling"], c["token_slots"]
        batch = LoRABatch.build(slots, c["num_slots"], max_adapters=adapters)
        groups = [(s, torch.nonzero(slots == s).flatten()) for s in range(c["num_slots"])]
        expected = base_ref.clone()
        loop_per_adapter(expected, x.float(), lora_a.float(), lora_b.float(), scaling,
                         [(s, rows) for s, rows in groups if rows.numel()], slices, rank)
        args = (lora_a, lora_b, scaling, batch)

        def cublas_add_lora():
            torch.matmul(x, weight.T, out=out)
            return add_lora(out, x, *args, output_slices=slices)

        def gemm_add_lora():
            gemm(x, weight, out, default)
            return add_lora(out, x, *args, output_slices=slices)

        paths = {
            "cublas_add_lora": cublas_add_lora,
            "lora_linear": lambda: lora_linear(x, weight, *args, output_slices=slices, out=out, config=default),
        } if issue_table else {
            "cublas_add_lora": cublas_add_lora,
            "gemm_add_lora": gemm_add_lora,
            "lora_linear": lambda: lora_linear(x, weight, *args, output_slices=slices, out=out, config=default),
            "lora_linear_shrink4": lambda: lora_linear(x, weight, *args, output_slices=slices, out=out,
                                                       config=dataclasses.replace(default, shrink_splits=4)),
        }
        entry = {"errors": {}, "us": {}}
        for name, fn in paths.items():
            entry["errors"][name], entry["us"][name] = checked(fn, expected, timer)
        us = entry["us"]
        for name in paths:
            if us[name] is not None:
                own_base = row["cublas_us"] if name.startswith("cublas") else row["gemm_us"]
                entry[f"{name}_lora_us"] = us[name] - own_base
                entry[f"{name}_over_base"] = (us[name] - row["cublas_us"]) / row["cublas_us"]
        row["adapters"][str(adapters)] = entry
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="linear.json")
    parser.add_argument("--sweep", action="store_true", help="also time GEMM configurations around the default")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--issue-table", action="store_true", help="issue 2's decode table (tokens, adapters, ranks)")
    parser.add_argument("--grid", action="store_true", help="the GEMM alone over a grid of configurations")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    timer = GraphTimer(args.reps)
    result = {"meta": timing_meta(args.reps, copy_bandwidth=copy_bandwidth(), launch_floor=launch_floor(timer)),
              "rows": []}
    start = time.time()
    tokens_list = ISSUE_TOKENS if args.issue_table else tuple(map(int, args.tokens.split(",")))
    ranks = ISSUE_RANKS if args.issue_table else (16,)
    for layer, tokens, rank in itertools.product(args.layers.split(","), tokens_list, ranks):
        if args.grid:
            row = run_grid(layer, tokens, timer)
            result["rows"].append(row)
            best = row["best"] or {}
            print(f"{layer:8s} {tokens:4d} cublas {row['cublas_us']:.1f} default {row['gemm_us']} best "
                  f"{best.get('us')} {({k: best.get(k) for k in ('block_m', 'block_n', 'splits', 'num_stages')})} "
                  f"[{time.time() - start:.0f}s]", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            continue
        row = run_shape(layer, tokens, timer, args.sweep, rank, args.issue_table)
        result["rows"].append(row)
        print(f"{layer:8s} {tokens:4d} r{rank:<3d} cublas {row['cublas_us']:.1f} gemm {row['gemm_us']:.1f} "
              f"[{time.time() - start:.0f}s]", flush=True)
        for adapters, e in row["adapters"].items():
            print("    " + f"{adapters:>3s} adapters: " + ", ".join(
                f"{k} {v:.1f}" if v is not None else f"{k} -" for k, v in e["us"].items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
