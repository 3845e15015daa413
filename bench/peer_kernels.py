"""add_lora against the peers' Triton LoRA kernels, on the same inputs, in one run (bf16, one GPU).

    bench/fetch_peers.sh                      # once, where pip can download: fills .peers/
    python3 bench/peer_kernels.py --out peers.json [--quick] [--ranks 16] [--phases decode,prefill]
    python3 bench/peer_kernels.py --out peers.json --phases decode --layer   # and the layer measure
    python3 bench/peer_kernels.py --smoke     # CPU, Triton's interpreter: every path checked, none timed

The peers are the op files of vLLM and SGLang, extracted from their wheels into `.peers/`
(VERSIONS names the releases) and loaded by file path; the few names they import from the
rest of their packages are shim modules (`peer_loading.py`; no peer file is edited). The
paths, ours and each peer's (`peer_paths.py`):

  vllm            lora_shrink then lora_expand (Punica SGMV; what PunicaWrapperGPU.add_lora_linear
                  runs): per-slice A [S, r, in] and B [S, out_i, r], the float32 [n, T, r] buffer
                  zeroed by the shrink, LoRAKernelMeta over max_loras = S slots, the default
                  (unspecialised) grid of S + 1 LoRA ids;
  sglang_triton   SGLang's classic "triton" backend: sgemm_lora_a, then qkv_lora_b (q/k/v),
                  gate_up_lora_b (gate/up) or sgemm_lora_b (o, down); decode segments merged by
                  adapter over the sorted tokens, prefill one segment per request;
  sglang_csgmv    the "csgmv" backend (SGLang's default): chunked_sgmv_shrink / _expand over the
                  tokens sorted by adapter in chunks of 16 (its default --max-lora-chunk-size);
                  sglang_csgmv_chunk128 with --max-lora-chunk-size 128 where that changes the
                  chunk (its heuristic: 32 from 64 tokens, 128 from 256);
  sglang_v2       the "triton_v2" backend: DenseLoraRunner's shrink then expand (routing, grouped /
                  per-row / all-slots families, tiles and split-K from its sm90 plan table), as
                  run_a then run_b, i.e. without the side-stream overlap its plans may ask for
                  (--layer times that overlap, in the layer: below).

Every path adds the same LoRA term into y: ours with its float32 [S, n] scaling; the peers
take one scale (vLLM) or one per slot (SGLang), so each slice's scaling is folded into their
copy of B (bf16, as vLLM folds it at load time) and their scale is 1. Weight copies, layouts
and each step's metadata (the peers' routing, our LoRABatch) are built outside the timed
region, as they are once per forward for every layer. Each path is checked against the
float32 reference first (relative error of the term, bf16 under 2e-2); a path that fails
the check or raises is recorded and not timed. Then each is timed as kernels_bench.py times
ours: CUDA-graph replays, L2 flushed before each, the median of --reps; beside the base GEMM.
Per case: us per path, the best peer, ours / best peer and the fastest path.

--layer (JSON key `layer_results`, beside `results`, which it leaves as they were): the whole
decode layer y = x W^T + LoRA term, on the decode cases up to the rows where the engine runs
lora_linear (server/model.py's TRITON_GEMM_MAX_TOKENS; --layer-tokens all: every decode case),
on the same case tensors, each path writing the whole output into a buffer:
  ours_layer          what the engine runs for that many rows: lora_linear (our GEMM with the
                      shrink beside it and the expand after it, chained by PDL) up to the rule's
                      rows, torch.matmul then add_lora above;
  cublas_then_ours    torch.matmul (cuBLAS) then add_lora;
  cublas_then_<peer>  torch.matmul then that peer path's LoRA term, one after the other, one stream;
  sglang_v2_overlap   SGLang's own DenseLoraRunner.apply (what TritonV2LoRABackend.forward_with_base
                      calls for a linear layer) with its table's plan: with overlap "a" (every sm90
                      decode plan) the shrink on a side stream beside the base GEMM, the expand after
                      it on the caller's stream, through LoraWorkspace.run_parallel's two events;
                      captured in the same CUDA graph as the rest (the events fork the side stream
                      into the capture and join it back); a plan with no overlap runs, and is
                      timed, in apply's sequential order; the note records the plan's overlap.
Each is checked against the float32 x W^T + term (relative error of the whole output, under
2e-2) before timing and again on what the timed replays left; timed as above (CUDA-graph
replays, L2 flushed; a path whose capture fails is timed by CUDA events over eager launches,
and `timers` says which). Per case the base GEMM alone (and our GEMM alone where ours runs
lora_linear), ours_layer over the best peer layer, SGLang's overlap over its sequential layer;
a short table at the end. --layer-only skips the LoRA-term table.
"""

from __future__ import annotations

import sys
import os

if "--smoke" in sys.argv or ("--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]):
    # Triton reads it when a kernel is decorated: before ours or any peer file is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels_bench import (  # noqa: E402  (bench/ is sys.path[0]; it maps the checkout)
    LAYERS, PREFILL, GraphTimer, copy_bandwidth, fewest_bytes, launch_floor, loop_per_adapter, make_case,
    rel_error, timing_meta,
)
from loraplex.kernels.linear import gemm, gemm_config  # noqa: E402
from peer_loading import PEER_NAMES, Peers, SGLangPhase, _load, _pydantic_shim  # noqa: E402
from peer_paths import (  # noqa: E402
    CSGMV_MAX_CHUNK, EngineRule, engine_rule, layer_paths, ours_path, peer_paths, sglang_v2_overlap_path,
    sglang_v2_path, v2_plan_note,
)

DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
DECODE_ADAPTERS = (1, 8, 32, "per-token")
TOLERANCE = 2e-2
log = logging.getLogger("peer_kernels")


# --------------------------------------------------------------------------------------
# One case: reference, checks, timings.
# --------------------------------------------------------------------------------------

def reference(c, start: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `start` (by default y) plus the LoRA term."""
    slots, S = c["token_slots"], c["num_slots"]
    groups = [(s, torch.nonzero(slots == s).flatten()) for s in range(S)]
    groups = [(s, rows) for s, rows in groups if rows.numel()]
    expected = c["y"].float() if start is None else start
    loop_per_adapter(expected, c["x"].float(), c["lora_a"].float(), c["lora_b"].float(), c["scaling"], groups,
                     c["slices"], c["rank"])
    return expected


def check_and_time(c, paths, P, timer, expected) -> dict:
    """paths: [(name, builder)]; each is built, checked, then timed (timer None: checks only)."""
    y0 = c["y"]
    row = {"errors": {}, "us": {}, "failures": {}, "notes": {}}
    for name, build in paths:
        try:
            fn, note = build(c, P)
            row["notes"][name] = note
            y = y0.clone()
            fn(y)
            if y.is_cuda:
                torch.cuda.synchronize()
            err = rel_error(y, y0, expected)
            row["errors"][name] = err
            if not err < TOLERANCE:
                row["failures"][name] = f"relative error {err:.3g} >= {TOLERANCE}"
                row["us"][name] = None
                continue
            if timer is not None:
                y = y0.clone()
                row["us"][name] = timer(lambda: fn(y))
                del y
        except Exception as exc:  # record and go on: one peer's refusal must not lose the case
            row["failures"][name] = repr(exc)[:500]
            row["us"][name] = None
        finally:
            fn = None  # noqa: F841  (drop the path's weight copies before the next one)
    return row


def summarize(row: dict) -> None:
    us = row["us"]
    peers = {k: v for k, v in us.items() if k not in ("ours", "base_gemm") and v}
    lora = {k: v for k, v in us.items() if k != "base_gemm" and v}
    if peers:
        best = min(peers, key=peers.get)
        row["best_peer"] = best
        row["best_peer_us"] = peers[best]
        if us.get("ours"):
            row["ours_over_best_peer"] = us["ours"] / peers[best]
    if lora:
        row["fastest"] = min(lora, key=lora.get)


def run_case(c, P, timer, bandwidth, wanted) -> dict:
    expected = reference(c)
    paths = [("ours", ours_path)] + peer_paths(c, P, wanted)
    row = check_and_time(c, paths, P, timer, expected)
    out = torch.empty_like(c["y"])
    x, w = c["x"], c["weight"]
    row["us"]["base_gemm"] = timer(lambda: torch.matmul(x, w.T, out=out))
    row["peer_load_errors"] = {k: v for k, v in P.errors.items() if k in wanted}
    summarize(row)
    nbytes = fewest_bytes(c)
    row["fewest_bytes"] = nbytes
    for key, name in (("ours", "ours"), ("best_peer", row.get("best_peer"))):
        if name and row["us"].get(name):
            row[f"{key}_bandwidth_fraction"] = nbytes / (row["us"][name] * 1e-6) / bandwidth
    return row


def layer_reference(c) -> torch.Tensor:
    """The whole float32 output: x W^T plus the LoRA term."""
    return reference(c, start=c["x"].float() @ c["weight"].float().T)




def event_timer(timer, fn) -> float:
    """Without a graph: launches timed by CUDA events, L2 flushed before each (the flush's own
    time lets the host queue the launches ahead of the start event), the median of at least
    100. Host launch cost can still show where the launches outlast the flush."""
    reps = max(timer.reps, 100)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        timer.clear_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return times[len(times) // 2]


def time_layer(timer, fn) -> tuple[float, str]:
    """CUDA-graph replays (GraphTimer, as every other number here); where capture fails, CUDA
    events over eager launches. Returns us and the timer used."""
    try:
        return timer(fn), "cuda_graph"
    except Exception as exc:  # noqa: BLE001  (recorded with the timer that replaced it)
        torch.cuda.synchronize()
        return event_timer(timer, fn), f"cuda_events (graph capture failed: {exc!r:.200})"


def check_and_time_layer(c, paths, P, timer, expected) -> dict:
    """Each layer path built, checked (relative error of the whole output against the float32
    x W^T + term, its output filled with NaN first), timed (timer None: checks only), and
    checked again on what the timed replays left in its output."""
    row = {"errors": {}, "layer_us": {}, "timers": {}, "errors_after_timing": {}, "failures": {}, "notes": {}}
    zero = torch.zeros_like(expected)
    for name, build in paths:
        fn = None
        try:
            fn, note = build(c, P)
            after = note.pop("after_timing", None)
            row["notes"][name] = note
            out = torch.full_like(c["y"], float("nan"))
            fn(out)
            if out.is_cuda:
                torch.cuda.synchronize()
            err = rel_error(out, zero, expected)
            row["errors"][name] = err
            if not err < TOLERANCE:
                row["failures"][name] = f"relative error {err:.3g} >= {TOLERANCE}"
                row["layer_us"][name] = None
                continue
            if timer is not None:
                out.fill_(float("nan"))
                row["layer_us"][name], row["timers"][name] = time_layer(timer, lambda: fn(out))
                err = rel_error(out, zero, expected)
                row["errors_after_timing"][name] = err
                if not err < TOLERANCE:
                    row["failures"][name] = f"after timing: relative error {err:.3g} >= {TOLERANCE}"
                    row["layer_us"][name] = None
            if after is not None:
                note.update(after())
        except Exception as exc:  # record and go on, as check_and_time does
            row["failures"][name] = repr(exc)[:500]
            row["layer_us"][name] = None
        finally:
            fn = None  # noqa: F841
    return row


OURS_LAYER = ("ours_layer", "cublas_then_ours")


def summarize_layer(row: dict) -> None:
    us = row["layer_us"]
    peers = {k: v for k, v in us.items() if k not in OURS_LAYER and v}
    timed = {k: v for k, v in us.items() if v}
    if peers:
        best = min(peers, key=peers.get)
        row["best_peer_layer"], row["best_peer_layer_us"] = best, peers[best]
        if us.get("ours_layer"):
            row["ours_layer_over_best_peer"] = us["ours_layer"] / peers[best]
    if timed:
        row["fastest_layer"] = min(timed, key=timed.get)
    base = row.get("base_gemm_us")
    if base:
        row["layer_over_base_gemm"] = {k: v / base for k, v in timed.items()}
    if us.get("sglang_v2_overlap") and us.get("cublas_then_sglang_v2"):
        row["sglang_v2_overlap_over_sequential"] = us["sglang_v2_overlap"] / us["cublas_then_sglang_v2"]


def run_layer_case(c, P, timer, wanted, rule: EngineRule) -> dict:
    row = check_and_time_layer(c, layer_paths(c, P, wanted, rule), P, timer, layer_reference(c))
    x, w, T = c["x"], c["weight"], c["x"].shape[0]
    out = torch.empty_like(c["y"])
    row["base_gemm_us"] = timer(lambda: torch.matmul(x, w.T, out=out))
    if row["notes"].get("ours_layer", {}).get("runs") == "lora_linear":  # its own GEMM alone, for scale
        config = gemm_config(T, w)
        try:
            row["ours_gemm_us"] = timer(lambda: gemm(x, w, out, config))
        except Exception as exc:  # noqa: BLE001
            row["ours_gemm_us"] = None
            row["failures"]["ours_gemm"] = repr(exc)[:500]
    row["peer_load_errors"] = {k: v for k, v in P.errors.items() if k in wanted}
    summarize_layer(row)
    return row


def in_layer_table(spec, args, rule: EngineRule) -> bool:
    """Decode cases, up to the rows where the engine runs lora_linear (--layer-tokens all: every
    decode token count)."""
    return spec["phase"] == "decode" and (args.layer_tokens == "all" or spec["tokens"] <= rule.max_tokens)


LAYER_SHORT = {"ours_layer": "ours", "cublas_then_ours": "cub+ours", "sglang_v2_overlap": "v2_ovl"}


def layer_short(name: str) -> str:
    return LAYER_SHORT.get(name) or short(name.removeprefix("cublas_then_"))


def print_layer_row(spec, row):
    fmt = lambda v: f"{v:6.1f}" if isinstance(v, (int, float)) else "     -"  # noqa: E731
    cols = " ".join(f"{layer_short(k)} {fmt(v)}" for k, v in row.get("layer_us", {}).items())
    ratio = row.get("ours_layer_over_best_peer")
    tail = f"ours/best {ratio:5.2f} ({layer_short(row['best_peer_layer'])})" if ratio else ""
    ovl = row.get("notes", {}).get("sglang_v2_overlap", {}).get("overlap")
    failed = ", ".join(f"{k}: {v[:80]}" for k, v in row.get("failures", {}).items())
    print(f"layer {spec['layer']:7s} T={spec['tokens']:3d} A={str(spec['adapters']):9s} r={spec['rank']:2d} | "
          f"base {fmt(row.get('base_gemm_us'))} | {cols} | {tail} v2 overlap {ovl} {row.get('failure', '')}"
          f"{' FAILED ' + failed if failed else ''}", flush=True)


def print_layer_summary(rows) -> dict:
    """The short table: per case the base GEMM, ours, the best peer layer, their ratio, and
    SGLang's overlapped layer over its sequential one."""
    num = lambda v, w=6, p=1: f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else " " * (w - 1) + "-"  # noqa: E731
    print(f"{'layer':7s} {'T':>3s} {'A':>9s} {'r':>2s} | {'base':>6s} {'ours':>6s} {'ours runs':12s} | "
          f"{'best peer':>14s} {'us':>6s} | {'ours/best':>9s} | {'v2 ovl/seq':>10s}", flush=True)
    ratios = []
    for r in rows:
        us, q = r.get("layer_us", {}), r.get("ours_layer_over_best_peer")
        if q:
            ratios.append((q, r))
        runs = r.get("notes", {}).get("ours_layer", {}).get("runs", "-")[:12]
        print(f"{r['layer']:7s} {r['tokens']:3d} {str(r['adapters']):>9s} {r['rank']:2d} | "
              f"{num(r.get('base_gemm_us'))} {num(us.get('ours_layer'))} {runs:12s} | "
              f"{layer_short(r.get('best_peer_layer', '-')):>14s} {num(r.get('best_peer_layer_us'))} | "
              f"{num(q, 9, 2)} | {num(r.get('sglang_v2_overlap_over_sequential'), 10, 2)}", flush=True)
    summary = {"cases": len(rows), "compared": len(ratios), "ours_not_slower": sum(1 for q, _ in ratios if q <= 1.0),
               "failures": sum(len(r.get("failures", {})) + ("failure" in r) for r in rows)}
    if ratios:
        worst, w = max(ratios, key=lambda p: p[0])
        summary["worst_ratio"] = worst
        summary["worst_case"] = {k: w[k] for k in ("layer", "tokens", "adapters", "rank", "best_peer_layer")}
        summary["geomean_ratio"] = math.exp(sum(math.log(q) for q, _ in ratios) / len(ratios))
        best_counts = {}
        for _, r in ratios:
            best_counts[r["best_peer_layer"]] = best_counts.get(r["best_peer_layer"], 0) + 1
        summary["best_peer_counts"] = best_counts
    print(f"layer: ours <= best peer layer on {summary['ours_not_slower']}/{summary['compared']} cases"
          + (f"; worst ours/best {summary['worst_ratio']:.2f} at {summary['worst_case']}; geomean "
             f"{summary['geomean_ratio']:.2f}; best peer: {summary['best_peer_counts']}" if ratios else ""), flush=True)
    return summary


# --------------------------------------------------------------------------------------
# The table, the printout, the smoke run.
# --------------------------------------------------------------------------------------

def table(args) -> list[dict]:
    cases = []
    for layer in args.layers.split(","):
        for rank in map(int, args.ranks.split(",")):
            for t in DECODE_TOKENS:
                for adapters in DECODE_ADAPTERS:
                    if adapters == "per-token":
                        if t in DECODE_ADAPTERS or t == 1:  # one per token is then a count above
                            continue
                    elif adapters > t:
                        continue
                    cases.append(dict(layer=layer, phase="decode", tokens=t, adapters=adapters, rank=rank))
            for adapters in (1, 8):
                cases.append(dict(layer=layer, phase="prefill", tokens=PREFILL[0] * PREFILL[1], adapters=adapters,
                                  rank=rank))
    cases = [c for c in cases if c["phase"] in args.phases.split(",")]
    if args.quick:
        cases = [c for c in cases if c["tokens"] in (1, 64, PREFILL[0] * PREFILL[1])]
    return cases


def short(name: str) -> str:
    return {"sglang_triton": "sgl_tri", "sglang_csgmv": "sgl_csg", f"sglang_csgmv_chunk{CSGMV_MAX_CHUNK}": "sgl_c128",
            "sglang_v2": "sgl_v2", "base_gemm": "base"}.get(name, name)


def print_row(spec, row):
    fmt = lambda v: f"{v:7.1f}" if isinstance(v, (int, float)) else "      -"  # noqa: E731
    cols = " ".join(f"{short(k)} {fmt(v)}" for k, v in row.get("us", {}).items())
    ratio = row.get("ours_over_best_peer")
    tail = f"ours/best {ratio:5.2f} ({short(row['best_peer'])})" if ratio else ""
    failed = ", ".join(f"{k}: {v[:80]}" for k, v in row.get("failures", {}).items())
    print(f"{spec['layer']:7s} {spec['phase']:7s} T={spec['tokens']:4d} A={str(spec['adapters']):9s} "
          f"r={spec['rank']:2d} | {cols} | {tail} {row.get('failure', '')}{' FAILED ' + failed if failed else ''}",
          flush=True)


def print_summary(results) -> dict:
    ratios = [(r["ours_over_best_peer"], r) for r in results if r.get("ours_over_best_peer")]
    summary = {"cases": len(results), "compared": len(ratios),
               "ours_not_slower": sum(1 for q, _ in ratios if q <= 1.0),
               "peer_failures": sum(len(r.get("failures", {})) for r in results)}
    if ratios:
        worst, w = max(ratios, key=lambda p: p[0])
        summary["worst_ratio"] = worst
        summary["worst_case"] = {k: w[k] for k in ("layer", "phase", "tokens", "adapters", "rank")}
        summary["worst_case"]["best_peer"] = w["best_peer"]
        summary["geomean_ratio"] = math.exp(sum(math.log(q) for q, _ in ratios) / len(ratios))
        wins = {}
        for r in results:
            if r.get("fastest"):
                wins[r["fastest"]] = wins.get(r["fastest"], 0) + 1
        summary["fastest_counts"] = wins
    print(f"ours <= best peer on {summary['ours_not_slower']}/{summary['compared']} cases; "
          + (f"worst ours/best {summary['worst_ratio']:.2f} at {summary['worst_case']}; "
             f"geomean {summary['geomean_ratio']:.2f}; fastest: {summary['fastest_counts']}" if ratios else ""),
          flush=True)
    return summary


# Tiny stand-ins for the Llama-3-8B layers on the CPU: (in_features, output slices).
SMOKE_LAYERS = {"qkv": (64, (64, 32, 32)), "o": (64, (64,)), "gate_up": (64, (96, 96)), "down": (96, (64,))}


def make_smoke_case(layer, num_tokens, adapters, rank, seqs=None, base_rows=0, gen=None, dtype=torch.float16):
    """make_case's tensors at SMOKE_LAYERS sizes on the CPU; `base_rows` rows (at prefill, the
    last `base_rows` sequences) use no adapter."""
    in_features, slices = SMOKE_LAYERS[layer]
    out_features, n = sum(slices), len(slices)
    num_adapters = num_tokens if adapters == "per-token" else adapters
    if seqs:
        token_slots = torch.arange(num_tokens) // (num_tokens // seqs) % num_adapters
    else:
        token_slots = (torch.arange(num_tokens) % num_adapters)[torch.randperm(num_tokens, generator=gen)]
    if base_rows and seqs:  # at prefill a request has one adapter or none: whole sequences
        per_seq = num_tokens // seqs
        token_slots[num_tokens - base_rows * per_seq:] = -1
    elif base_rows:
        token_slots[torch.randperm(num_tokens, generator=gen)[:base_rows]] = -1
    return dict(
        x=torch.randn(num_tokens, in_features, generator=gen).to(dtype),
        y=torch.randn(num_tokens, out_features, generator=gen).to(dtype),
        lora_a=(torch.randn(num_adapters, n * rank, in_features, generator=gen) / math.sqrt(in_features)).to(dtype),
        lora_b=(torch.randn(num_adapters, out_features, rank, generator=gen) / math.sqrt(rank)).to(dtype),
        scaling=torch.rand(num_adapters, n, generator=gen) + 0.5,
        weight=(torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)).to(dtype),
        token_slots=token_slots.to(torch.int32), slices=slices, num_adapters=num_adapters, num_slots=num_adapters,
        rank=rank)


def _cpu_slice_geometry(P):
    """lora_b.slice_geometry without its CUDA-only checks (the table lives on the CPU)."""
    lora_b = sys.modules["sglang.kernels.ops.lora.common.lora_b"]

    def geometry(offsets, block_size_n, device, out_offsets=None):
        rows, columns = lora_b._geometry_inputs(offsets, block_size_n, out_offsets)
        widths = [hi - lo for lo, hi in zip(rows, rows[1:])]
        uniform = widths[0] if len(set(widths)) == 1 else 0
        stride = columns[1] if len(columns) > 1 else uniform
        regular = stride > 0 and all(col == s * stride for s, col in enumerate(columns))
        head = -(-len(rows) // 4) * 4
        t = torch.tensor(list(rows) + [0] * (head - len(rows)) + list(columns), dtype=torch.int32, device=device)
        return lora_b.SliceGeometry(slice_offsets=t[: len(rows)], out_offsets=t[head:], num_slices=len(widths),
                                    num_column_tiles=sum(triton.cdiv(w, block_size_n) for w in widths),
                                    uniform_width=uniform, out_stride=stride if regular else 0,
                                    full_tiles=all(w % block_size_n == 0 for w in widths), block_size_n=block_size_n)

    P.v2_runner.slice_geometry = geometry


def _interpreter_bool_masks() -> None:
    """Triton's interpreter (3.9) types `bool_vector & (python_int < scalar)` as int64 and
    then refuses it as a load mask (SGLang's per-row expand builds its rank mask so; the
    compiler types it int1). Here a mask of any integer type is read as `!= 0`."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_bool_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype != bool:
            mask = interpreter.TensorHandle(mask.data != 0, tl.int1)
        return mask

    builder.create_masked_load = lambda self, p, mask, *a: load(self, p, as_bool(mask), *a)
    builder.create_masked_store = lambda self, p, v, mask, *a: store(self, p, v, as_bool(mask), *a)
    builder._bool_masks = True


def _forced_v2_plans(P) -> dict:
    """One plan per family pairing and split mode the plan tables use."""
    DensePlan, AF, BF = P.v2_plan.DensePlan, P.v2_plan.AFamily, P.v2_plan.BFamily
    a = {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 2}
    b = {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 2}
    return {
        "grouped": DensePlan(a_tiles=a, b_tiles=b),
        "grouped_splitk_serial": DensePlan(a_tiles={**a, "SPLIT_K": 2}, b_tiles=b),
        "grouped_splitk_planes": DensePlan(a_tiles={**a, "SPLIT_K": 2, "SPLIT_MODE": "planes"}, b_tiles=b),
        "grouped_a_per_row_b": DensePlan(b_family=BF.PER_ROW, a_tiles=a, b_tiles=b),
        "per_row": DensePlan(a_family=AF.PER_ROW, b_family=BF.PER_ROW, a_tiles=a, b_tiles=b),
        "all_slots": DensePlan(a_family=AF.ALL_SLOTS, b_family=BF.PER_ROW, a_tiles=a, b_tiles=b),
        "grouped_block32": DensePlan(block_size=32, a_tiles=a, b_tiles=b),
    }


def check_plan_shim(P) -> dict:
    """Where pydantic is installed, plan.py parses its tables with it; the GPU machine may lack
    it and take the shim. Loads a second plan.py on the shim and compares the plan each
    resolves for every case of the table (both architectures)."""
    if P.third_party.get("pydantic") != "installed" or not P.has("sglang_v2"):
        return {"checked": False}
    real = sys.modules["pydantic"]
    sys.modules["pydantic"] = _pydantic_shim()
    try:
        shim_plan = _load("sglang.srt.lora.dense.plan_on_shim", P.root / "sglang/srt/lora/dense/plan.py")
    finally:
        sys.modules["pydantic"] = real
    compared = 0
    for arch in ("sm90", "sm100", "default"):
        for rank in (8, 16, 32, 64, 128):
            tables = [m.DensePlanTable(arch, rank) for m in (P.v2_plan, shim_plan)]
            for layer, (k, slices) in LAYERS.items():
                for phase in (SGLangPhase.DECODE, SGLangPhase.PREFILL):
                    for t in (1, 2, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
                        got = [v2_plan_note(tb.plan_for(m.DenseLoraKind.LINEAR, phase, t, k, sum(slices)))
                               | {"tiles": (tb.plan_for(m.DenseLoraKind.LINEAR, phase, t, k, sum(slices)).a_tiles,
                                            tb.plan_for(m.DenseLoraKind.LINEAR, phase, t, k, sum(slices)).b_tiles)}
                               for tb, m in zip(tables, (P.v2_plan, shim_plan))]
                        if got[0] != got[1]:
                            raise AssertionError(f"plan shim differs at {arch} r={rank} {layer} {phase} T={t}: {got}")
                        compared += 1
    return {"checked": True, "plans_compared": compared}


def smoke_layer(c, P, wanted, rule, forced) -> dict:
    """The --layer paths on one smoke case, checked (whole output), none timed; SGLang's
    overlap path on the sm90 table (its decode plans ask "a"), and on a forced plan with each
    of the three overlaps so every branch of runner.apply runs (on the CPU run_parallel runs
    the side part, then the base)."""
    paths = layer_paths(c, P, wanted, rule, backend="triton")
    if P.has("sglang_v2") and "sglang_v2" in wanted:
        paths.append(("sglang_v2_overlap[sm90 table]",
                      lambda c, P: sglang_v2_overlap_path(c, P, architecture="sm90")))
        overlap = P.v2_plan.Overlap
        for mode in (overlap.A, overlap.AB_DELTA, overlap.NONE):
            plan = dataclasses.replace(forced["grouped"], overlap=mode)
            paths.append((f"sglang_v2_overlap[grouped, {mode.value}]",
                          lambda c, P, plan=plan: sglang_v2_overlap_path(c, P, plan=plan)))
    return check_and_time_layer(c, paths, P, None, layer_reference(c))


def smoke(args) -> int:
    """Every path on small decode and prefill cases on the CPU (Triton's interpreter, float16),
    each checked against the float32 reference; nothing timed."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    P = Peers()
    if P.has("sglang_v2"):
        _cpu_slice_geometry(P)
    _interpreter_bool_masks()
    gen = torch.Generator().manual_seed(0)
    wanted = [p for p in args.peers.split(",") if p]
    specs = [  # with_layer: the --layer paths too, on the same case
        dict(layer="qkv", phase="decode", tokens=8, adapters=3, base_rows=2, with_layer=True),
        dict(layer="o", phase="decode", tokens=5, adapters="per-token", with_layer=True),
        dict(layer="gate_up", phase="decode", tokens=6, adapters=2, base_rows=1),
        dict(layer="down", phase="decode", tokens=1, adapters=1, with_layer=True),
        dict(layer="qkv", phase="prefill", tokens=512, adapters=2, seqs=2),
        dict(layer="gate_up", phase="prefill", tokens=64, adapters=1, seqs=2),
        dict(layer="down", phase="prefill", tokens=96, adapters=2, seqs=3, base_rows=1),
    ]
    forced = _forced_v2_plans(P) if P.has("sglang_v2") and "sglang_v2" in wanted else {}
    rule = engine_rule(smoke=True)
    results, layer_results, bad = [], [], 0
    started = time.time()
    for spec in specs:
        spec = {"rank": 16, **spec}
        c = make_smoke_case(spec["layer"], spec["tokens"], spec["adapters"], spec["rank"], seqs=spec.get("seqs"),
                            base_rows=spec.get("base_rows", 0), gen=gen)
        c["phase"], c["seqs"] = spec["phase"], spec.get("seqs")
        paths = [("ours", lambda c, P: ours_path(c, P, backend="triton"))] + peer_paths(c, P, wanted)
        if P.has("sglang_v2") and "sglang_v2" in wanted and (spec["phase"] == "decode" or spec["layer"] == "qkv"):
            paths.append(("sglang_v2[sm90 table]", lambda c, P: sglang_v2_path(c, P, architecture="sm90")))
        if spec["layer"] in ("qkv", "gate_up") and spec["phase"] == "decode":
            for pname, plan in forced.items():
                paths.append((f"sglang_v2[{pname}]", lambda c, P, plan=plan: sglang_v2_path(c, P, plan=plan)))
        t0 = time.time()
        row = check_and_time(c, paths, P, None, reference(c))
        row.update(spec)
        results.append(row)
        bad += len(row["failures"])
        errs = " ".join(f"{short(k)} {v:.1e}" for k, v in row["errors"].items())
        print(f"{spec['layer']:7s} {spec['phase']:7s} T={spec['tokens']:3d} A={str(spec['adapters']):9s} "
              f"base rows {spec.get('base_rows', 0)} | {errs} | {time.time() - t0:.0f}s", flush=True)
        for k, v in row["failures"].items():
            print(f"    FAILED {k}: {v}", flush=True)
        if spec.get("with_layer"):
            t0 = time.time()
            lrow = smoke_layer(c, P, wanted, rule, forced)
            lrow.update(spec)
            layer_results.append(lrow)
            bad += len(lrow["failures"])
            errs = " ".join(f"{layer_short(k)} {v:.1e}" for k, v in lrow["errors"].items())
            ovl = {k: n.get("overlap") for k, n in lrow["notes"].items() if "overlap" in n}
            print(f"  layer: {errs} | overlap {ovl} | {time.time() - t0:.0f}s", flush=True)
            for k, v in lrow["failures"].items():
                print(f"    FAILED {k}: {v}", flush=True)
    missing = [p for p in wanted if not P.has(p)]
    for p in missing:
        print(f"peer {p} not loaded: {P.errors[p]}", flush=True)
    shim = check_plan_shim(P)
    print(f"plan-table shim check: {shim}", flush=True)
    out = {"meta": {"mode": "smoke", "device": "cpu (TRITON_INTERPRET)", "dtype": "float16", "peers": P.versions,
                    "third_party": P.third_party, "plan_shim_check": shim, "layer_engine_rule": rule.meta(),
                    "seconds": time.time() - started}, "results": results, "layer_results": layer_results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1, default=str))
    term_checks = sum(len(r["errors"]) for r in results)
    layer_checks = sum(len(r["errors"]) for r in layer_results)
    print(f"smoke: {term_checks + layer_checks} checks ({term_checks} LoRA term, {layer_checks} layer), {bad} failed, "
          f"{len(missing)} peers not loaded ({time.time() - started:.0f}s)", flush=True)
    return 1 if bad or missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="JSON file to write (required on the GPU)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="1, 64 and 4096 tokens only")
    parser.add_argument("--ranks", default="16", help="ranks to run (default 16)")
    parser.add_argument("--phases", default="decode,prefill", help="decode, prefill or both (default both)")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--peers", default=",".join(PEER_NAMES), help="peer paths to run (default all)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the --smoke run")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton's interpreter, small shapes: check every path, time none")
    parser.add_argument("--layer", action="store_true",
                        help="also time the whole decode layer (base GEMM + LoRA term) per path, SGLang's "
                             "triton_v2 with its side-stream overlap too: JSON key layer_results")
    parser.add_argument("--layer-tokens", default="engine", choices=("engine", "all"),
                        help="--layer cases: decode up to the rows where the engine runs lora_linear "
                             "(server/model.py's TRITON_GEMM_MAX_TOKENS, the default) or every decode case")
    parser.add_argument("--layer-only", action="store_true", help="with --layer: skip the LoRA-term table")
    args = parser.parse_args(argv)
    if args.layer_only:
        args.layer = True
    logging.basicConfig(level=logging.WARNING)
    if args.smoke or args.device == "cpu":
        return smoke(args)
    if args.out is None:
        parser.error("--out is required")

    P = Peers()
    for name, err in P.errors.items():
        print(f"peer {name} not loaded: {err}", flush=True)
    wanted = [p for p in args.peers.split(",") if p]
    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth()
    timer = GraphTimer(args.reps)
    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bandwidth, dtype="torch.bfloat16", peers=P.versions,
                       peer_load_errors=P.errors, third_party=P.third_party, tolerance=TOLERANCE,
                       conventions="peers' B carries each slice's scaling (bf16), their scale is 1; weight copies "
                                   "and routing built outside the timed region; vLLM default grid (max_loras+1); "
                                   "csgmv chunk 16 (SGLang's default) and its 128 cap where that differs; "
                                   "triton_v2 as run_a + run_b with its table's plan (no side-stream overlap; --layer "
                                   "times that overlap in its layer)")
    meta["launch_floor"] = launch_floor(timer)
    rule = engine_rule()
    if args.layer:
        meta["layer"] = {
            "engine_rule": rule.meta(), "tokens": args.layer_tokens, "lora_term_table": not args.layer_only,
            "conventions": "whole output y = x W^T + term into a preallocated buffer, checked against float32 "
                           "(relative error of the whole output) before and after timing; base GEMM torch.matmul "
                           "(cuBLAS); ours_layer as the engine runs the rows (lora_linear up to the rule's rows, "
                           "cuBLAS then add_lora above); cublas_then_<path>: cuBLAS then that LoRA-term path, one "
                           "stream; sglang_v2_overlap: DenseLoraRunner.apply with its table's plan (side stream "
                           "per plan.overlap, captured in the same CUDA graph through its events); timer per path "
                           "in 'timers'"}
    print(f"peers {P.versions}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; launch floor {meta['launch_floor']}"
          + (f"; engine rule {rule.meta()}" if args.layer else ""), flush=True)

    results, layer_results = [], []

    def write():
        payload = {"meta": meta, "results": results}
        if args.layer:
            payload["layer_results"] = layer_results
        args.out.write_text(json.dumps(payload, indent=1, default=str))

    started = time.time()
    for spec in table(args):
        layer_case = args.layer and in_layer_table(spec, args, rule)
        if args.layer_only and not layer_case:
            continue
        c = None
        try:
            seqs = PREFILL[0] if spec["phase"] == "prefill" else None
            c = make_case(spec["layer"], spec["tokens"], spec["adapters"], spec["rank"], seqs=seqs, gen=gen)
            c["phase"], c["seqs"] = spec["phase"], seqs
            if not args.layer_only:
                row = {**spec, **run_case(c, P, timer, bandwidth, wanted)}
        except Exception as exc:  # record and carry on: one broken case must not lose the run
            row = {**spec, "failure": repr(exc)[:500]}
        if not args.layer_only:
            results.append(row)
            print_row(spec, row)
        if layer_case:
            try:
                if c is None:
                    raise RuntimeError(row.get("failure", "the case was not built"))
                lrow = {**spec, **run_layer_case(c, P, timer, wanted, rule)}
            except Exception as exc:  # noqa: BLE001
                lrow = {**spec, "failure": repr(exc)[:500]}
            layer_results.append(lrow)
            print_layer_row(spec, lrow)
        del c
        write()
    meta["seconds"] = time.time() - started
    if not args.layer_only:
        meta["summary"] = print_summary(results)
    if args.layer:
        meta["layer_summary"] = print_layer_summary(layer_results)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
