"""Engine benchmark: decode throughput with many adapters in one batch, against HF PEFT and
against the memory-bandwidth floor.

    python3 bench/engine_bench.py --out $OUT/engine.json                  # one GPU: Llama-3-8B shape, bf16
    python3 bench/engine_bench.py --shape tiny --quick --out /tmp/e.json   # CPU smoke test

On the same requests (`--batch` prompts of `--prompt-len` random tokens, greedy, EOS
ignored), for 0 (base only), 1, 8, 32 and 64 distinct rank-16 adapters on all seven
projections (`--targets`: a subset) assigned round-robin to the rows:

- loraplex: decode tokens/s over `--decode-steps` steady-state steps (CUDA graphs on; every
  graph is captured in an untimed first pass over the same workload);
- HF transformers + peft, mixed-adapter batch (`generate(..., adapter_names=[...])`), the
  naive baseline: decode tokens/s from two generate lengths (the difference cancels prefill);
- the base-only decode step against its floor: bytes one step must read (every linear
  weight and lm_head once, plus each row's K/V so far) over the measured device copy
  bandwidth ((read + write bytes) / time of a large device-to-device copy).

Writes one JSON document (and prints a short table on stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from checkout import engine_parser, use_checkout  # bench/ is sys.path[0]

use_checkout()

from loraplex.server.adapters import AdapterId, random_adapter  # noqa: E402
from loraplex.server.config import named_shape  # noqa: E402
from loraplex.server.engine import LLMEngine  # noqa: E402
from loraplex.server.kv_cache import KVCache  # noqa: E402
from loraplex.server.sampling import SamplingParams  # noqa: E402
from loraplex.server.settings import ServerSettings  # noqa: E402

log = logging.getLogger("engine_bench")

TARGETS = {"adapters32_vs_base": 0.9, "speedup_vs_hf_peft": 100.0, "base_step_vs_floor": 1.5}


def parse_args(argv=None) -> argparse.Namespace:
    p = engine_parser(__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="concurrent requests (default 64)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default 512)")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps (default 64)")
    p.add_argument("--adapters", default="0,1,8,32,64", help="distinct adapter counts (default 0,1,8,32,64)")
    p.add_argument("--hf-steps", type=int, default=8, help="decode steps timed for HF PEFT (default 8)")
    p.add_argument("--kv-block", type=int, default=64, help="KV length granularity of eager decode (default 64)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="the KV cache's length per row (default: prompt + decode steps + 8)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF PEFT baseline")
    p.add_argument("--queued", type=int, default=0,
                   help="requests queued behind the full batch through the timed steps (an overload: "
                        "the batch's rows never free up, so they wait), then aborted (default 0)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager decode (for comparison)")
    p.add_argument("--no-fused-ops", action="store_true",
                   help="decode's small ops as torch ops, not the server/ops Triton kernels (for comparison)")
    p.add_argument("--no-triton-gemm", action="store_true",
                   help="decode's projections as cuBLAS then add_lora, not kernels.linear (for comparison)")
    p.add_argument("--profile", action="store_true",
                   help="also record per-kernel GPU time of eager decode steps (torch.profiler)")
    p.add_argument("--profile-graph", action="store_true",
                   help="also record the kernels of CUDA-graph decode steps (torch.profiler): GPU busy time, "
                        "and the gaps between kernels by the pair of kernels around them")
    p.add_argument("--every-slot-too", action="store_true",
                   help="also time each adapter count with the LoRA grid sized for every slot, not for the "
                        "step's adapters (the before/after of that change, in one run)")
    p.add_argument("--no-look-ahead", action="store_true",
                   help="wait for each decode step's tokens before launching the next (settings.decode_look_ahead "
                        "off; for comparison)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up that compiles every kernel (for comparison)")
    p.add_argument("--structured-rows", default="",
                   help="also time, per adapter count, the batch with this many rows held to a JSON schema's "
                        "grammar (over a synthetic tokenizer of the shape's vocabulary; needs xgrammar), e.g. 8,64, "
                        "each beside the same batch without, in turn")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="projections each adapter targets (default all seven; PEFT's default for Llama is "
                        "q_proj,v_proj)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.prompt_len, a.decode_steps, a.hf_steps = min(a.batch, 8), min(a.prompt_len, 16), 6, 3
        a.adapters = ",".join(str(min(int(n), a.batch)) for n in a.adapters.split(","))
    a.adapter_counts = sorted({int(n) for n in a.adapters.split(",")})
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """(read + write) bytes per second of a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / min(times)


# --structured-rows: a schema no 64-step output completes (200 strings at least), so each
# held row stays held through the timed steps.
STRUCTURED_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 200}


def structured_grammar(vocab: int, eos_ids: tuple[int, ...]):
    """STRUCTURED_SCHEMA compiled over a synthetic byte-level tokenizer of `vocab` tokens
    (structured_bench.py's): dummy weights come with no tokenizer."""
    import tempfile

    from structured_bench import synthetic_tokenizer

    from loraplex.server.structured import Grammars, GrammarSpec
    from loraplex.server.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        synthetic_tokenizer(Path(tmp), vocab)
        grammars = Grammars(Tokenizer(tmp), vocab, eos_ids)
        return grammars.compile(GrammarSpec("json", json.dumps(STRUCTURED_SCHEMA), "bench"))


def make_requests(args, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen).tolist()


def assignment(batch: int, n_adapters: int) -> list[str | None]:
    """Row i uses adapter i mod n (None: the base)."""
    return [None if n_adapters == 0 else f"a{i % n_adapters}" for i in range(batch)]


def run_loraplex(args, engine: LLMEngine, prompts, names, grammar=None, grammar_rows: int = 0) -> dict:
    """One untimed pass (captures the CUDA graphs), then a timed pass on the same requests;
    the first `grammar_rows` rows held to `grammar` (a compiled structured output)."""
    max_tokens = args.decode_steps + 2
    result = {}
    before = engine.decoder.num_graphs
    for timed in (False, True):
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                    grammar=grammar if i < grammar_rows else None)
            engine.add_request(engine.make_request(prompt, params, name))
        t0 = time.perf_counter()
        engine.step()  # admits and prefills everyone (and their first decode is next)
        prefill_s = time.perf_counter() - t0
        assert len(engine.scheduler.running) == len(prompts), "all requests must run in one batch"
        running = list(engine.scheduler.running.values())
        # --queued: requests for the base behind the batch, which wait as long as it runs.
        queued = [engine.make_request(prompts[i % len(prompts)][:16], SamplingParams(max_tokens=1), None)
                  for i in range(args.queued)]
        for req in queued:
            engine.add_request(req)
        times = []
        positions = []
        while any(not r.finished for r in running):
            positions.append(sum(r.position + 1 for r in engine.scheduler.running.values()))
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        for req in queued:  # the overload ends: the queued requests go, unserved
            engine.abort(req.request_id)
        while engine.has_work():
            engine.step()
        held = [r for r in running if r.grammar is not None]
        if held:  # each held row ran to max_tokens inside its grammar, which a fresh walk accepts
            from loraplex.server.structured import GrammarState

            for r in held:
                walk = GrammarState(grammar, engine.eos_ids)
                assert r.finish_reason == "length", (r.finish_reason, r.error)
                assert all(walk.accept(t) for t in r.output_ids), "an output its grammar does not accept"
        # Only full-batch steps count (the last one may be partial).
        times, positions = times[: args.decode_steps], positions[: args.decode_steps]
        if not timed:
            # The untimed pass captures each decode graph the first time its key is seen: the
            # steps that capture stall every running request for that long.
            graphs = engine.decoder.num_graphs
            first_pass = {"step_ms_max": 1e3 * max(times), "step_ms_median": 1e3 * statistics.median(times),
                          "graphs_captured": graphs - before, "prefill_ms": 1e3 * prefill_s}
        if timed:
            total = sum(times)
            result = {"decode_tok_s": len(prompts) * len(times) / total,
                      "step_ms_median": 1e3 * statistics.median(times),
                      "step_ms_mean": 1e3 * total / len(times),
                      "steps": len(times),
                      "kv_tokens_per_step_mean": sum(positions) / len(positions),
                      "cuda_graphs": engine.decoder.num_graphs,
                      "graphs_captured_while_timed": engine.decoder.num_graphs - graphs,
                      "prefill_ms": 1e3 * prefill_s,
                      "first_pass": first_pass}
    return result


def profile_decode(engine: LLMEngine, prompts, names, repeats: int = 5) -> list[dict]:
    """GPU time per kernel name over `repeats` eager decode steps of the full batch, per step."""
    from torch.profiler import ProfilerActivity, profile

    reqs = [engine.make_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), n)
            for p, n in zip(prompts, names)]
    for r in reqs:
        engine.add_request(r)
    engine.step()  # prefill
    engine.step()  # one decode: leaves its inputs in the decoder's buffers
    args = engine.decoder.last_args
    engine.model.decode(*args)
    sync(engine.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            engine.model.decode(*args)
        sync(engine.device)
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_work():
        engine.step()
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0) or 0
        if t > 0 and evt.key and not evt.key.startswith("aten::") and not evt.key.startswith("cuda"):
            rows.append({"kernel": evt.key[:120], "us_per_step": t / repeats, "calls_per_step": evt.count / repeats})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:25]


def host_share(engine: LLMEngine, prompts, names, steps: int = 24) -> dict:
    """Where a decode step's wall time goes: the step (engine.step(), host and GPU) against
    its decode graph replayed alone, back to back (GPU time only), and the host functions
    that take the most of the steps (cProfile, own time)."""
    import cProfile
    import pstats

    reqs = [engine.make_request(p, SamplingParams(max_tokens=2 * steps + 8, temperature=0, ignore_eos=True), n)
            for p, n in zip(prompts, names)]
    for r in reqs:
        engine.add_request(r)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    sync(engine.device)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    graph, _ = engine.decoder._graphs[engine.decoder.last_key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(engine.device)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    sync(engine.device)
    replay_ms = start.elapsed_time(end) / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    while engine.has_work():
        engine.step()
    stats = pstats.Stats(prof)
    top = sorted(((v[2], f"{k[0].rsplit('/', 1)[-1]}:{k[1]}({k[2]})", v[1]) for k, v in stats.stats.items()),
                 reverse=True)[:15]
    step_ms = 1e3 * statistics.median(walls)
    return {"step_ms_median": step_ms, "graph_replay_ms": replay_ms, "host_ms": step_ms - replay_ms,
            "host_share": 1 - replay_ms / step_ms,
            "profiled_own_ms_per_step": [{"function": f, "ms": 1e3 * t / steps, "calls": c / steps}
                                         for t, f, c in top]}


def profile_graph_decode(engine: LLMEngine, prompts, names, steps: int = 6) -> dict:
    """The kernels of `steps` decode steps as the engine runs them (graph replays), from a
    trace: per step the kernels, the GPU busy time (the union of kernel intervals) and the
    idle gaps between one kernel's end and the next one's start inside the step (gaps over
    `STEP_GAP_US` are the host between steps), with the pairs of kernels around the largest."""
    import tempfile
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    reqs = [engine.make_request(p, SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True), n)
            for p, n in zip(prompts, names)]
    for r in reqs:
        engine.add_request(r)
    engine.step()  # prefill
    engine.step()  # a decode step: its graph is captured (or was)
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    while engine.has_work():
        engine.step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                     if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return {"error": "the trace holds no kernel events"}
    gaps, pairs, by_name = [], defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    busy, end = 0.0, kernels[0][0]
    short = lambda n: re.sub(r"_kernel.*$|^void |<.*$|\(.*$", "", n)[:48]  # noqa: E731
    for i, (t0, t1, name) in enumerate(kernels):
        busy += max(0.0, t1 - max(t0, end))
        by_name[short(name)][0] += t1 - t0
        by_name[short(name)][1] += 1
        if i:
            gap = t0 - end
            if 0 < gap < STEP_GAP_US:
                gaps.append(gap)
                key = f"{short(kernels[i - 1][2])} -> {short(name)}"
                pairs[key][0] += gap
                pairs[key][1] += 1
        end = max(end, t1)
    span = kernels[-1][1] - kernels[0][0]
    top = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:15]
    return {"steps": steps, "kernels_per_step": len(kernels) / steps, "span_us_per_step": span / steps,
            "busy_us_per_step": busy / steps, "gaps_in_step_us_per_step": sum(gaps) / steps,
            "gap_us_median": statistics.median(gaps) if gaps else 0.0,
            "top_gap_pairs": [{"pair": k, "us_per_step": v[0] / steps, "count_per_step": v[1] / steps,
                               "us_each": v[0] / v[1]} for k, v in top],
            "kernels": sorted(({"kernel": k, "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps}
                               for k, v in by_name.items()), key=lambda r: -r["us_per_step"])[:20]}


# A gap between kernels longer than this is the host between two steps, not inside one.
STEP_GAP_US = 200.0


def hf_decode_rate(args, cfg, device, dtype, prompts, counts, on_result=None) -> list[dict]:
    """HF transformers + peft: decode tokens/s of a mixed-adapter batch, per adapter count.
    `on_result(results so far)` runs after each count, so a run cut short keeps what it timed."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "torch_dtype")})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    model.eval()
    targets = args.targets.split(",")
    n_max = max(counts)
    peft_model = None
    if n_max:
        lcfg = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=targets, init_lora_weights=False)
        peft_model = get_peft_model(model, lcfg, adapter_name="a0")
        for i in range(1, n_max):
            peft_model.add_adapter(f"a{i}", lcfg)
        peft_model.to(device=device, dtype=dtype)
        peft_model.eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    out = []
    for n in counts:
        names = [a if a is not None else "__base__" for a in assignment(len(prompts), n)]
        runner = peft_model if peft_model is not None else model
        kwargs = {"adapter_names": names} if peft_model is not None else {}

        def generate(k: int) -> float:
            sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                runner.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                                do_sample=False, pad_token_id=0, **kwargs)
            sync(device)
            return time.perf_counter() - t0

        generate(2)  # warm-up
        # Best of three of each length: the difference is the decode steps alone.
        t_short = min(generate(1) for _ in range(3))
        t_long = min(generate(1 + args.hf_steps) for _ in range(3 if args.quick else 1))
        rate = len(prompts) * args.hf_steps / max(t_long - t_short, 1e-9)
        out.append({"adapters": n, "decode_tok_s": rate, "step_ms": 1e3 * (t_long - t_short) / args.hf_steps})
        log.info("hf peft  adapters=%3d  %9.1f tok/s", n, rate)
        if on_result is not None:
            on_result(out)
    del model, peft_model
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("loraplex.server.adapters").setLevel(logging.WARNING)
    cfg = named_shape(args.shape)
    n_max = max(args.adapter_counts)
    settings = ServerSettings(
        dummy_weights=args.shape, device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
        max_model_len=args.max_model_len or args.prompt_len + args.decode_steps + 8,
        max_prefill_tokens=args.batch * args.prompt_len,
        max_loras=max(n_max, 1), max_lora_rank=args.rank, cuda_graphs=not args.no_cuda_graphs,
        kv_block=args.kv_block, fused_ops=not args.no_fused_ops,
        triton_gemm=not args.no_triton_gemm, decode_look_ahead=not args.no_look_ahead, warmup=False)
    engine = LLMEngine.from_settings(settings)
    device, dtype = engine.device, engine.dtype
    # The adapters are in their slots before the warm-up, as a server's --lora-modules are.
    for i in range(n_max):
        spec, tensors = random_adapter(cfg, args.rank, targets=tuple(args.targets.split(",")), seed=100 + i,
                                       device=device, dtype=dtype)
        engine.adapters.install(AdapterId(f"a{i}", f"random-{i}", "memory"), spec, tensors)
    warmup = {"steps": 0, "seconds": 0.0}
    if not args.no_warmup:  # what the server's start-up does (settings.warmup), timed here
        t0 = time.perf_counter()
        prefills, steps = engine.warm_up()
        warmup = {"prefills": prefills, "steps": steps, "seconds": time.perf_counter() - t0}
        log.info("warm-up: %d prefills and %d eager decode steps in %.1f s", prefills, steps, warmup["seconds"])
    fused_ops, triton_gemm, look_ahead = engine.model.fused_ops, engine.model.triton_gemm, engine.look_ahead
    bw = copy_bandwidth(device, 2 << 30 if device.type == "cuda" else 256 << 20)
    log.info("device %s, %s, copy bandwidth %.0f GB/s", device, dtype, bw / 1e9)
    prompts = make_requests(args, cfg.vocab_size)

    results = []
    every_slot = []
    for n in args.adapter_counts:
        r = run_loraplex(args, engine, prompts, assignment(args.batch, n)) | {"adapters": n}
        results.append(r)
        log.info("loraplex adapters=%3d  %9.1f tok/s  step %.2f ms  prefill %.1f ms  (first pass: %d graphs, slowest "
                 "step %.1f ms, prefill %.1f ms)", n, r["decode_tok_s"], r["step_ms_median"], r["prefill_ms"],
                 r["first_pass"]["graphs_captured"], r["first_pass"]["step_ms_max"], r["first_pass"]["prefill_ms"])
        if args.every_slot_too and n:
            engine.decoder.bound_adapters = False
            e = run_loraplex(args, engine, prompts, assignment(args.batch, n)) | {"adapters": n}
            engine.decoder.bound_adapters = True
            e["vs_step_adapters_grid"] = r["decode_tok_s"] / e["decode_tok_s"]
            every_slot.append(e)
            log.info("  grid for every slot: %9.1f tok/s  step %.2f ms (ours %.3fx)", e["decode_tok_s"],
                     e["step_ms_median"], e["vs_step_adapters_grid"])
    structured = []
    if args.structured_rows:
        grammar = structured_grammar(cfg.vocab_size, engine.eos_ids)
        for n in args.adapter_counts:
            for rows in (int(x) for x in args.structured_rows.split(",")):
                free = run_loraplex(args, engine, prompts, assignment(args.batch, n))
                held = run_loraplex(args, engine, prompts, assignment(args.batch, n), grammar, rows)
                structured.append({"adapters": n, "structured_rows": rows, "without": free, "with": held,
                                   "ratio": held["decode_tok_s"] / free["decode_tok_s"]})
                log.info("structured: adapters=%d, %d rows held to a JSON schema: %.1f against %.1f tok/s (%.3fx)",
                         n, rows, held["decode_tok_s"], free["decode_tok_s"], structured[-1]["ratio"])
    profiles = {}
    if args.profile:
        for n in sorted({0, min(32, n_max)}):
            profiles[str(n)] = prof = profile_decode(engine, prompts, assignment(args.batch, n))
            log.info("profile, %d adapters: %s", n, ", ".join(f"{r['kernel'][:40]} {r['us_per_step']:.0f}us"
                                                             for r in prof[:8]))
    graph_profiles = {}
    if args.profile_graph and not args.no_cuda_graphs:
        for n in sorted({0, min(32, n_max)}):
            h = host_share(engine, prompts, assignment(args.batch, n))
            log.info("host share, %d adapters: step %.3f ms, its graph replayed alone %.3f ms: host %.3f ms (%.1f%%); "
                     "%s", n, h["step_ms_median"], h["graph_replay_ms"], h["host_ms"], 100 * h["host_share"],
                     "; ".join(f"{r['function']} {r['ms']:.3f}" for r in h["profiled_own_ms_per_step"][:8]))
            graph_profiles[str(n)] = g = profile_graph_decode(engine, prompts, assignment(args.batch, n))
            g["host_share"] = h
            if "error" not in g:
                log.info("graph profile, %d adapters: %.0f kernels, span %.0f us, busy %.0f us, gaps %.0f us a step "
                         "(median gap %.2f us); largest: %s", n, g["kernels_per_step"], g["span_us_per_step"],
                         g["busy_us_per_step"], g["gaps_in_step_us_per_step"], g["gap_us_median"],
                         "; ".join(f"{p['pair']} {p['us_per_step']:.0f}us/{p['count_per_step']:.0f}"
                                   for p in g["top_gap_pairs"][:6]))
            else:
                log.info("graph profile, %d adapters: %s", n, g["error"])
    base = next((r for r in results if r["adapters"] == 0), None)
    if base:
        for r in results:
            r["vs_base"] = r["decode_tok_s"] / base["decode_tok_s"]

    # The floor of a base-only decode step: every linear weight and lm_head once (embedding
    # rows are a gather of `batch` rows: negligible), plus the K/V of every row so far.
    w = engine.model.w
    elt = torch.empty((), dtype=dtype).element_size()
    weight_bytes = w.nbytes() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * elt)
    floor = None
    if base:
        kv_bytes = base["kv_tokens_per_step_mean"] * KVCache.bytes_per_token(cfg, dtype)
        floor_s = (weight_bytes + kv_bytes) / bw
        floor = {"weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes, "floor_ms": 1e3 * floor_s,
                 "base_step_ms": base["step_ms_median"], "ratio": base["step_ms_median"] / 1e3 / floor_s}
        log.info("base step %.2f ms vs floor %.2f ms: %.2fx", base["step_ms_median"], 1e3 * floor_s, floor["ratio"])

    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def write(hf: list[dict]) -> None:
        """The JSON document from what has been timed so far (rewritten after each phase)."""
        speedup = {}
        for r in results:
            h = next((x for x in hf if x["adapters"] == r["adapters"]), None)
            if h:
                r["vs_hf_peft"] = speedup[r["adapters"]] = r["decode_tok_s"] / h["decode_tok_s"]
        at32 = next((r for r in results if r["adapters"] == 32), None)
        checks = {}
        if at32 and base:
            checks["adapters32_vs_base"] = {"value": at32["vs_base"], "target": ">= 0.9"}
        if speedup:
            n_ref = 32 if 32 in speedup else max(speedup)
            checks["speedup_vs_hf_peft"] = {"value": speedup[n_ref], "adapters": n_ref, "target": ">= 100"}
        if floor:
            checks["base_step_vs_floor"] = {"value": floor["ratio"], "target": "<= 1.5"}
        for name, c in checks.items():
            c["met"] = c["value"] >= TARGETS[name] if name != "base_step_vs_floor" else c["value"] <= TARGETS[name]
        doc = {
            "benchmark": "engine decode, many adapters in one batch",
            "device": device_name,
            "versions": {"torch": torch.__version__, **_versions()},
            "config": {"shape": args.shape, "dtype": str(dtype).removeprefix("torch."), "batch": args.batch,
                       "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "rank": args.rank,
                       "targets": args.targets, "cuda_graphs": not args.no_cuda_graphs,
                       "kv_block": args.kv_block, "max_model_len": settings.max_model_len, "hf_steps": args.hf_steps, "quick": args.quick,
                       "pdl": os.environ.get("LORAPLEX_PDL", "1") != "0", "fused_ops": fused_ops,
                       "triton_gemm": triton_gemm, "decode_look_ahead": look_ahead, "queued": args.queued},
            "warmup": warmup,
            "copy_bandwidth_GBps": bw / 1e9,
            "loraplex": results,
            "loraplex_grid_for_every_slot": every_slot,
            "structured": structured,
            "hf_peft": hf,
            "floor": floor,
            "checks": checks,
            "profile_eager_decode": profiles,
            "profile_graph_decode": graph_profiles,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    write([])
    if not args.no_hf:
        hf_decode_rate(args, cfg, device, dtype, prompts, args.adapter_counts, on_result=write)
    log.info("wrote %s", args.out)
    return 0


def _versions() -> dict:
    out = {}
    for mod in ("transformers", "peft", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
