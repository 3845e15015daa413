"""Builds, checks and times add_lora on Llama-3-8B layer shapes (bf16), on one GPU, in one run.

    python3 bench/kernels_bench.py --out results.json [--quick] [--sweep]

For each case (layer x tokens x distinct adapters x rank), in this order:
  1. ours (add_lora: split-K shrink + expand) and two baselines (a torch gather-then-bmm, a
     loop of one matmul per distinct adapter) are checked against the float32 reference
     (relative error of the LoRA term; bf16 must land under 2e-2);
  2. each is captured in a CUDA graph and its replays timed with L2 flushed before each
     (median of `--reps`), as is the base GEMM of the same layer (x @ W^T);
  3. achieved bandwidth counts the fewest bytes: each distinct adapter's A and B once at
     its rank, x once, y read and written once, against the measured device-to-device
     copy bandwidth (bytes read + written).
`--sweep` also times launch configurations around the default on a subset of cases.
On a GPU with programmatic dependent launch, `ours_no_pdl` / `ours_pdl` time the same
kernels launched the other way than the default configuration's; `ours_add_in_memory` / `ours_load_store` time the expand's other way of adding
into y than the default configuration's. With `--slots N` above the adapters in use, ours
sizes its grid for the adapters in use (as the engine does) and `ours_every_slot` times the
grid sized for all N slots. `--prev DIR` also times another version of the kernels package (a `kernels/`
folder, e.g. from `git archive`) as `prev`, for a before/after ratio from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from loraplex.kernels import LoRABatch, add_lora  # noqa: E402
from loraplex.kernels.batch import DECODE_BLOCK_M, default_block_m  # noqa: E402
from loraplex.kernels.configs import make_config, multiprocessors, sgmv_config, supports_pdl  # noqa: E402
from loraplex.kernels.reference import add_lora_torch  # noqa: E402
from loraplex.kernels.add_lora import sgmv_lora  # noqa: E402

# Llama-3-8B: (in_features, output_slices)
LAYERS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
DECODE_ADAPTERS = (1, 8, 16, 32, "per-token")
RANKS = (8, 16, 64)
PREFILL = (8, 512)  # sequences x tokens
DTYPE = torch.bfloat16
FLUSH_BYTES = 512 << 20  # > L2 (60 MB on an H200)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (ms * 1e-3)


def timing_meta(reps: int, **extra) -> dict:
    """What every GPU bench records of its run: device, versions, the timer, and `extra`."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "reps": reps,
            "timing": "median CUDA-graph replay, L2 flushed before each", **extra}


class GraphTimer:
    """Times a callable as CUDA-graph replays with L2 flushed before each replay."""

    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def clear_l2(self) -> None:
        """Before each replay: FLUSH_BYTES written, more than L2 holds (l2_flush_bench.py times
        what its dirty lines cost the call after it)."""
        self.flush.zero_()

    def __call__(self, fn) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self.clear_l2()
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))  # us
        return times[len(times) // 2]


def loop_per_adapter(y, x, lora_a, lora_b, scaling, groups, slices, rank):
    """Baseline: one matmul per distinct adapter (and slice), rows gathered by index.

    In float32 on upcast inputs it is also the reference the others are checked against.
    """
    for slot, rows in groups:
        v = x[rows] @ lora_a[slot].T  # [t, n*R]
        offset = 0
        for i, width in enumerate(slices):
            vi = v[:, i * rank : (i + 1) * rank] * scaling[slot, i]
            y[rows, offset : offset + width] += vi @ lora_b[slot, offset : offset + width].T
            offset += width


def rel_error(got: torch.Tensor, before: torch.Tensor, expected: torch.Tensor) -> float:
    delta = got.float() - before.float()
    want = expected - before.float()
    return float((delta - want).norm() / want.norm().clamp_min(1e-30))


def make_case(layer, num_tokens, adapters, rank, seqs=None, gen=None, slots=0):
    """One case's tensors. With `slots` above the adapters in use, the buffers hold that many
    slots (as an engine's do) and the adapters sit in a random subset of them."""
    in_features, slices = LAYERS[layer]
    out_features = sum(slices)
    n = len(slices)
    num_adapters = num_tokens if adapters == "per-token" else adapters
    num_slots = max(num_adapters, slots)
    if seqs:  # prefill: contiguous sequences, adapter i % num_adapters for sequence i
        per_seq = num_tokens // seqs
        token_slots = torch.arange(num_tokens) // per_seq % num_adapters
    else:  # decode: one row per request, adapters interleaved in a random order
        token_slots = torch.arange(num_tokens) % num_adapters
        token_slots = token_slots[torch.randperm(num_tokens, generator=gen)]
    if num_slots > num_adapters:
        token_slots = torch.randperm(num_slots, generator=gen)[:num_adapters][token_slots]
    dev = "cuda"
    x = torch.randn(num_tokens, in_features, generator=gen).to(dev, DTYPE)
    y = torch.randn(num_tokens, out_features, generator=gen).to(dev, DTYPE)
    lora_a = (torch.randn(num_slots, n * rank, in_features, generator=gen) / math.sqrt(in_features)).to(dev, DTYPE)
    lora_b = (torch.randn(num_slots, out_features, rank, generator=gen) / math.sqrt(rank)).to(dev, DTYPE)
    scaling = (torch.rand(num_slots, n, generator=gen) + 0.5).to(dev)
    weight = (torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)).to(dev, DTYPE)
    token_slots = token_slots.to(torch.int32).to(dev)
    return dict(x=x, y=y, lora_a=lora_a, lora_b=lora_b, scaling=scaling, weight=weight, token_slots=token_slots,
                slices=slices, num_adapters=num_adapters, num_slots=num_slots, rank=rank)


def fewest_bytes(c) -> int:
    item = 2
    t, k = c["x"].shape
    out = c["y"].shape[1]
    adapters = c["num_adapters"] * (len(c["slices"]) * c["rank"] * k + out * c["rank"]) * item
    return adapters + t * k * item + 2 * t * out * item


def load_kernels(path: Path):
    """Another version of the kernels package, imported as `prev_kernels`."""
    spec = importlib.util.spec_from_file_location("prev_kernels", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["prev_kernels"] = module
    spec.loader.exec_module(module)
    return module


def run_case(c, timer, bandwidth, sweep, prev=None, variants_too=True, baselines=True):
    x, y0, lora_a, lora_b, scaling, slots = c["x"], c["y"], c["lora_a"], c["lora_b"], c["scaling"], c["token_slots"]
    slices, rank, S = c["slices"], c["rank"], c["num_slots"]
    groups = [(s, torch.nonzero(slots == s).flatten()) for s in range(S)]
    groups = [(s, rows) for s, rows in groups if rows.numel()]
    # The grid sized for the adapters in use, as the engine sizes it (a power of two there;
    # the adapter counts here are powers of two or one per token).
    batch = LoRABatch.build(slots, S, max_adapters=len(groups))
    # The float32 reference, one adapter at a time (a per-row gather would not fit at prefill).
    expected = y0.float()
    loop_per_adapter(expected, x.float(), lora_a.float(), lora_b.float(), scaling, groups, slices, rank)

    variants = {
        "ours": lambda y: add_lora(y, x, lora_a, lora_b, scaling, batch, output_slices=slices),
        "gather_bmm": lambda y: add_lora_torch(y, x, lora_a, lora_b, scaling, slots, None, slices),
        "loop": lambda y: loop_per_adapter(y, x, lora_a, lora_b, scaling, groups, slices, rank),
    }
    if not baselines:  # ours (and prev) against the base GEMM only: a before/after run in less time
        del variants["gather_bmm"], variants["loop"]
    default = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, rank, x.dtype, x.device)
    if supports_pdl(x.device) and variants_too:
        other = dataclasses.replace(default, pdl=not default.pdl)
        variants["ours_pdl" if other.pdl else "ours_no_pdl"] = (
            lambda y: sgmv_lora(y, x, lora_a, lora_b, scaling, batch, None, slices, config=other))
    flipped = dataclasses.replace(default, add_in_memory=not default.add_in_memory)
    if variants_too:
            variants["ours_add_in_memory" if flipped.add_in_memory else "ours_load_store"] = (
            lambda y: sgmv_lora(y, x, lora_a, lora_b, scaling, batch, None, slices, config=flipped))
    if batch.block_m > DECODE_BLOCK_M and variants_too:
        # Prefill with more rows a block: A and B are re-read from L2 once per block.
        for block_m in (64, 128):
            wide = LoRABatch.build(slots, S, block_m=block_m, max_adapters=len(groups))
            variants[f"ours_block_m{block_m}"] = (
                lambda y, wide=wide: add_lora(y, x, lora_a, lora_b, scaling, wide, output_slices=slices))
    if S > len(groups) and variants_too:
        every_slot = LoRABatch.build(slots, S)  # the grid sized for every slot
        variants["ours_every_slot"] = lambda y: add_lora(y, x, lora_a, lora_b, scaling, every_slot, output_slices=slices)
    if prev is not None:
        prev_batch = prev.LoRABatch.build(slots, S)
        variants["prev"] = lambda y: prev.add_lora(y, x, lora_a, lora_b, scaling, prev_batch, output_slices=slices)
    row = {"errors": {}, "us": {}}
    for name, fn in variants.items():
        y = y0.clone()
        fn(y)
        torch.cuda.synchronize()
        row["errors"][name] = rel_error(y, y0, expected)
        if not row["errors"][name] < 2e-2:
            row["us"][name] = None
            continue
        y = y0.clone()
        row["us"][name] = timer(lambda: fn(y))
    out = torch.empty_like(y0)
    row["us"]["base_gemm"] = timer(lambda: torch.matmul(x, c["weight"].T, out=out))

    nbytes = fewest_bytes(c)
    row["fewest_bytes"] = nbytes
    # The bytes alone, at the copy bandwidth, as a fraction of the base GEMM: no kernel
    # can go under this ratio on this case.
    row["bytes_floor_over_base"] = nbytes / bandwidth * 1e6 / row["us"]["base_gemm"]
    if row["us"]["ours"]:
        row["ours_over_base"] = row["us"]["ours"] / row["us"]["base_gemm"]
        row["ours_bandwidth_fraction"] = nbytes / (row["us"]["ours"] * 1e-6) / bandwidth

    if sweep:
        sms = multiprocessors(x.device)
        row["sweep"] = []
        base = dict(programs_per_sm=4, block_n=None, block_k=None, k_splits=None, num_warps=4, num_stages=3,
                    device_pdl=supports_pdl(x.device))
        trials = [dict(base)]
        for key, values in (("programs_per_sm", (1, 2, 8, 16)), ("num_warps", (2, 8)), ("num_stages", (1, 2, 4)),
                            ("block_k", (32, 64, 256, 512)), ("block_n", (64, 256)), ("k_splits", (1, 2, 4, 8, 16, 32))):
            for v in values:
                trials.append({**base, key: v})
        for block_m in sorted({16, 32, 64, default_block_m(x.shape[0])}):
            if block_m > 16 and x.shape[0] < 64:
                continue
            b = LoRABatch.build(slots, S, block_m=block_m, max_adapters=len(groups))
            for t in trials if block_m == batch.block_m else [base]:
                cfg = make_config(b.num_blocks, x.shape[1], slices, rank, 2, sms, block_m=block_m, **t)
                for kind, launch in (("split", sgmv_lora),):
                    y = y0.clone()
                    try:
                        launch(y, x, lora_a, lora_b, scaling, b, None, slices, config=cfg)
                        err = rel_error(y, y0, expected)
                        us = timer(lambda: launch(y, x, lora_a, lora_b, scaling, b, None, slices, config=cfg)) if err < 2e-2 else None
                    except Exception as exc:  # a config the compiler refuses: record and go on
                        err, us = repr(exc)[:200], None
                    row["sweep"].append({"kernel": kind, "block_m": block_m, **t, **cfg.__dict__, "error": err, "us": us})
    return row


@triton.jit
def _touch_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.load(ptr + offs, mask=offs < n) + 1, mask=offs < n)


def launch_floor(timer) -> dict:
    """What the timer reports for one and for two back-to-back launches of a kernel that
    reads and writes one 4 KB tile from DRAM: the fixed cost under every number here."""
    buf = torch.zeros(1024, dtype=torch.float32, device="cuda")
    touch = lambda: _touch_kernel[(1,)](buf, buf.numel(), BLOCK=1024)  # noqa: E731
    return {"one_launch_us": timer(touch), "two_launches_us": timer(lambda: (touch(), touch()))}


def check_no_sync():
    """LoRABatch.build and add_lora must capture into a CUDA graph (any host sync would fail)."""
    slots = torch.randint(-1, 8, (64,), device="cuda", dtype=torch.int32)
    x = torch.randn(64, 256, device="cuda", dtype=DTYPE)
    y = torch.zeros(64, 512, device="cuda", dtype=DTYPE)
    a = torch.randn(8, 16, 256, device="cuda", dtype=DTYPE)
    b = torch.randn(8, 512, 16, device="cuda", dtype=DTYPE)
    sc = torch.ones(8, device="cuda")
    LoRABatch.build(slots, 8)
    add_lora(y, x, a, b, sc, LoRABatch.build(slots, 8))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            add_lora(y, x, a, b, sc, LoRABatch.build(slots, 8))
    graph.replay()
    torch.cuda.synchronize()
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument("--sweep", action="store_true", help="time configurations around the default")
    parser.add_argument("--sweep-ranks", default="16", help="ranks whose sweep cases --sweep times (default 16)")
    parser.add_argument("--sweep-cases", default=None,
                        help="decode cases --sweep times, as TOKENS:ADAPTERS,... (default 1:1,64:16,64:32,"
                             "256:per-token and prefill with 8 adapters)")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--prev", type=Path, help="another kernels/ folder to time beside ours")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)), help="ranks to run (default 8,16,64)")
    parser.add_argument("--phases", default="decode,prefill", help="decode, prefill or both (default both)")
    parser.add_argument("--no-variants", action="store_true", help="time ours without its no-PDL / other-add variants")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the torch gather-then-bmm and the loop per adapter (the base GEMM stays)")
    parser.add_argument("--slots", type=int, default=0,
                        help="adapter slots in the buffers when more than the adapters in use (an engine's --max-loras)")
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth()
    timer = GraphTimer(args.reps)
    prev = load_kernels(args.prev) if args.prev else None
    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bandwidth, graph_capture_without_sync=check_no_sync(),
                       dtype=str(DTYPE), slots=args.slots)
    meta["launch_floor"] = launch_floor(timer)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; launch floor {meta['launch_floor']}", flush=True)

    cases = []
    for layer in args.layers.split(","):
        for rank in map(int, args.ranks.split(",")):
            for t in DECODE_TOKENS:
                for adapters in DECODE_ADAPTERS:
                    if adapters != "per-token" and adapters > t:
                        continue
                    if adapters == "per-token" and t in (1,):
                        continue
                    cases.append(dict(layer=layer, phase="decode", tokens=t, adapters=adapters, rank=rank))
            for adapters in (1, 8):
                cases.append(dict(layer=layer, phase="prefill", tokens=PREFILL[0] * PREFILL[1], adapters=adapters, rank=rank))
    cases = [c for c in cases if c["phase"] in args.phases.split(",")]
    if args.quick:
        cases = [c for c in cases if c["rank"] == 16 and c["tokens"] in (1, 64, 4096)]
    sweep_ranks = {int(r) for r in args.sweep_ranks.split(",")}
    sweep_keys = {("decode", 1, 1), ("decode", 64, 16), ("decode", 64, 32), ("decode", 256, "per-token"), ("prefill", 4096, 8)}
    if args.sweep_cases:
        sweep_keys = {("decode", int(t), a if a == "per-token" else int(a))
                      for t, a in (item.split(":") for item in args.sweep_cases.split(","))}

    results = []
    started = time.time()
    for spec in cases:
        try:
            c = make_case(spec["layer"], spec["tokens"], spec["adapters"], spec["rank"],
                          seqs=PREFILL[0] if spec["phase"] == "prefill" else None, gen=gen, slots=args.slots)
            sweep = args.sweep and spec["rank"] in sweep_ranks and (spec["phase"], spec["tokens"], spec["adapters"]) in sweep_keys
            row = {**spec, **run_case(c, timer, bandwidth, sweep, prev, not args.no_variants, not args.no_baselines)}
            del c
        except Exception as exc:  # record and carry on: one broken case must not lose the run
            row = {**spec, "failure": repr(exc)[:500]}
        results.append(row)
        us = row.get("us", {})
        fmt = lambda v: f"{v:8.1f}" if isinstance(v, (int, float)) else "       -"
        print(f"{spec['layer']:8s} {spec['phase']:7s} T={spec['tokens']:5d} A={str(spec['adapters']):9s} r={spec['rank']:2d} "
              + " ".join(f"{name} {fmt(v)}" for name, v in us.items())
              + f" ratio {row.get('ours_over_base', float('nan')):.2f} "
              f"bw {row.get('ours_bandwidth_fraction', float('nan')):.2f} {row.get('failure', '')}", flush=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    meta["seconds"] = time.time() - started
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
