"""What one launch can read: the prefill shrink's x (4096 x 4096 bf16, 32 MB), read in
different ways, against the shrink itself.

    python3 bench/read_floor.py --out read_floor.json

The prefill shrink reads x at under half the copy bandwidth in every configuration tried
(kernels_h200_notes.md). This separates what that costs: each variant below reads the same
32 MB once, timed as kernels_bench.py times (CUDA-graph replay, L2 flushed before each,
median), and checked against torch first.

- copy: ``out.copy_(x)``, 32 MB read and 32 MB written (torch);
- torch_sum: ``x.sum(dim=1)`` (torch);
- stream: a Triton kernel that reads x in the shrink's tiles ([32 rows, 128 columns], K cut
  in 4 splits, one program per (split, row block)) from contiguous rows, and writes one
  float per row and split;
- stream_indexed: the same, with the rows read from an index table first, as the shrink
  reads a block's rows (``LoRABatch.block_rows``);
- stream_indexed_dot: the same, summed with ``tl.dot`` against a tile of ones, as the
  shrink multiplies x by A (through shared memory and the tensor cores);
- shrink_qkv_a1 / shrink_qkv_a8 / shrink_o_a1: ``sgmv_shrink`` at its default
  configuration, rank 16 (A read as well, partials written);
- copy_half: ``out.copy_(x[:half])``, 16 MB read and 16 MB written, for the fixed cost.

``--sweep`` also times the streaming kernel over its tile, splits, warps and stages (rows
contiguous, summed without tl.dot): the fastest way found for one launch to read x.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import PREFILL, GraphTimer, copy_bandwidth, make_case, timing_meta  # noqa: E402
from loraplex.kernels import LoRABatch  # noqa: E402
from loraplex.kernels.configs import sgmv_config  # noqa: E402
from loraplex.kernels.shrink import sgmv_shrink  # noqa: E402

BLOCK_M, BLOCK_K, K_SPLITS = 32, 128, 4


@triton.jit
def _stream_kernel(x_ptr, rows_ptr, out_ptr, T, K, K_CHUNK, stride_xt, INDEXED: tl.constexpr, DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    if INDEXED:
        rows = tl.load(rows_ptr + offs_m).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    x_rows = x_ptr + rows[:, None] * stride_xt
    k_lo = pid_k * K_CHUNK
    if DOT:
        acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
        ones = tl.full((BLOCK_K, 16), 1.0, x_ptr.dtype.element_ty)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K):
        xb = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :])
        if DOT:
            acc = tl.dot(xb, ones, acc)
        else:
            acc += xb.to(tl.float32)
    if DOT:
        total = tl.sum(acc, axis=1) / 16
    else:
        total = tl.sum(acc, axis=1)
    tl.store(out_ptr + pid_k * T + rows, total)


def stream(x: torch.Tensor, rows: torch.Tensor | None, dot: bool, block_m: int = BLOCK_M, block_k: int = BLOCK_K,
           k_splits: int = K_SPLITS, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    t, k = x.shape
    out = torch.empty((k_splits, t), dtype=torch.float32, device=x.device)
    grid = (k_splits, t // block_m)
    _stream_kernel[grid](x, rows if rows is not None else out, out, t, k, k // k_splits, x.stride(0),
                         INDEXED=rows is not None, DOT=dot, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps,
                         num_stages=num_stages)
    return out


SWEEP = dict(block_m=(16, 32, 64), block_k=(64, 128, 256), k_splits=(1, 4, 16), num_warps=(4, 8),
             num_stages=(2, 4))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="time the streaming kernel over its parameters")
    args = p.parse_args(argv)
    bw = copy_bandwidth()
    timer = GraphTimer(args.reps)
    gen = torch.Generator().manual_seed(0)
    t = PREFILL[0] * PREFILL[1]
    x = torch.randn(t, 4096, generator=gen).to("cuda", torch.bfloat16)
    rows = torch.randperm(t, generator=gen).to("cuda", torch.int32)  # a permutation: every row once
    want = x.float().sum(dim=1)
    out = torch.empty_like(x)

    variants = {
        "copy": (lambda: out.copy_(x), 2 * x.numel() * 2, None),
        "copy_half": (lambda: out[: t // 2].copy_(x[: t // 2]), x.numel() * 2, None),
        "torch_sum": (lambda: x.sum(dim=1), x.numel() * 2, lambda r: r.float()),
        "stream": (lambda: stream(x, None, False), x.numel() * 2, lambda r: r.sum(0)),
        "stream_indexed": (lambda: stream(x, rows, False), x.numel() * 2, lambda r: r.sum(0)),
        "stream_indexed_dot": (lambda: stream(x, rows, True), x.numel() * 2, lambda r: r.sum(0)),
    }
    results = {}
    for name, (fn, nbytes, total) in variants.items():
        got = fn()
        error = None
        if total is not None:
            error = ((total(got) - want).norm() / want.norm()).item()
            if not error < 2e-2:
                results[name] = {"error": error, "us": None}
                continue
        us = timer(fn)
        results[name] = {"us": us, "bytes": nbytes, "bandwidth": nbytes / (us * 1e-6) / bw, "error": error}
        print(f"{name:20s} {us:7.1f} us  {results[name]['bandwidth']:.2f} of copy bandwidth", flush=True)

    for layer, adapters in (("qkv", 1), ("qkv", 8), ("o", 1)):
        c = make_case(layer, t, adapters, 16, seqs=PREFILL[0], gen=gen)
        batch = LoRABatch.build(c["token_slots"], c["num_slots"], max_adapters=adapters)
        cfg = sgmv_config(batch.num_blocks, batch.block_m, 4096, c["slices"], 16, c["x"].dtype, c["x"].device)
        xc, lora_a = c["x"], c["lora_a"]
        nbytes = xc.numel() * 2 + adapters * lora_a.shape[1] * lora_a.shape[2] * 2
        us = timer(lambda: sgmv_shrink(xc, lora_a, batch, None, 16, cfg.k_splits, cfg.block_k, cfg.num_warps,
                                       cfg.num_stages))
        name = f"shrink_{layer}_a{adapters}"
        results[name] = {"us": us, "bytes": nbytes, "bandwidth": nbytes / (us * 1e-6) / bw, "k_splits": cfg.k_splits,
                         "block_k": cfg.block_k}
        print(f"{name:20s} {us:7.1f} us  {results[name]['bandwidth']:.2f} of copy bandwidth", flush=True)
        del c

    if args.sweep:
        sweep = []
        for values in itertools.product(*SWEEP.values()):
            params = dict(zip(SWEEP, values))
            if params["block_k"] * params["k_splits"] > x.shape[1]:
                continue
            try:
                got = stream(x, None, False, **params)
                error = ((got.sum(0) - want).norm() / want.norm()).item()
                us = timer(lambda: stream(x, None, False, **params)) if error < 2e-2 else None
            except Exception as exc:  # a configuration the compiler refuses: record it, go on
                error, us = repr(exc)[:120], None
            sweep.append({**params, "error": error, "us": us,
                          "bandwidth": x.numel() * 2 / (us * 1e-6) / bw if us else None})
        sweep.sort(key=lambda r: r["us"] or 1e9)
        results["stream_sweep"] = sweep
        for r in sweep[:8]:
            print("sweep", r, flush=True)

    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bw)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
