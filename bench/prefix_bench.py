"""Prefix caching benchmark: requests that share a system prompt, with the prefix cache on
and off, on the same engine and the same requests, in one run.

    python3 bench/prefix_bench.py --out $OUT/prefix.json                   # one GPU: Llama-3-8B shape, bf16
    python3 bench/prefix_bench.py --shape tiny --quick --out /tmp/p.json    # CPU smoke test

`--requests` requests, each `--system-len` tokens of one of `--adapters` system prompts (one
per adapter: rank-16 adapters on all seven projections, round-robin; 0: the base) followed
by `--question-len` tokens of its own, `--max-tokens` greedy tokens each, EOS ignored, run
closed-loop: `--concurrency` requests in flight, the next one added as one finishes. For
each mode it reports the wall time of the whole run, requests/s, the prompt tokens
prefilled, the time to first token (from a request's add to the step that gave its first
token) p50 and p95, and how many requests' outputs equal the other mode's (whole, and their
first tokens), against how many equal between two passes with the cache off that batch the
requests differently (one fewer in flight): in bfloat16 a model of random weights has
near-ties that a change of kernel shapes can flip, and that pass shows how far batching
alone moves them. Modes alternate
(`--rounds` each), after an untimed pass with the cache on that compiles and captures what
the run needs; the cache is emptied before each timed pass (every row forgotten), so each
pass starts cold, as a server's first requests do.

Writes one JSON document (and prints a short table on stderr).
"""

from __future__ import annotations

import json
import logging
import platform
import random
import statistics
import sys
import time

import torch

from checkout import engine_parser, use_checkout  # bench/ is sys.path[0]

use_checkout()

from loraplex.server.adapters import AdapterId, random_adapter  # noqa: E402
from loraplex.server.config import named_shape  # noqa: E402
from loraplex.server.engine import LLMEngine  # noqa: E402
from loraplex.server.prefix_cache import PrefixCache  # noqa: E402
from loraplex.server.prefix_store import HostPrefixStore  # noqa: E402
from loraplex.server.sampling import SamplingParams  # noqa: E402
from loraplex.server.settings import ServerSettings  # noqa: E402

log = logging.getLogger("prefix_bench")


def parse_args(argv=None):
    p = engine_parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128, help="requests per pass (default 128)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    p.add_argument("--system-len", type=int, default=1024, help="shared system prompt tokens (default 1024)")
    p.add_argument("--question-len", type=int, default=64, help="each request's own tokens (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--adapters", type=int, default=4, help="distinct adapters, one system prompt each (default 4)")
    p.add_argument("--system-prompts", type=int, default=0,
                   help="distinct system prompts, round-robin, prompt k on adapter k mod --adapters (default: "
                        "one per adapter)")
    p.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB: also time passes with the cache's host tier of this size (prefix_store.py)")
    p.add_argument("--rounds", type=int, default=2, help="timed passes per mode (default 2)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    p.add_argument("--sdpa-prefill", action="store_true",
                   help="prefill attention as SDPA per prompt, not the fused ops' one launch per layer")
    p.add_argument("--eager-prefill", action="store_true",
                   help="run every prefill step eagerly, not small ones as CUDA graphs (server/prefill_graphs.py)")
    p.add_argument("--profile", action="store_true",
                   help="profile one more pass with the cache on (torch.profiler): its top ops on stderr")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.concurrency, a.system_len, a.question_len, a.max_tokens, a.adapters, a.rounds = \
            12, 4, 48, 8, 4, 2, 1
    return a


def make_workload(args, vocab: int) -> list[tuple[list[int], str | None]]:
    rng = random.Random(0)
    count = args.system_prompts or max(args.adapters, 1)
    if args.requests <= count:
        # Round-robin: every system prompt is asked once, so no mode has a prefix to find.
        log.warning("%d requests over %d system prompts: none is asked twice, nothing to cache", args.requests, count)
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_len)] for _ in range(count)]
    work = []
    for i in range(args.requests):
        k = i % count
        work.append((systems[k] + [rng.randrange(3, vocab) for _ in range(args.question_len)],
                     f"a{k % args.adapters}" if args.adapters else None))
    return work


def set_prefix_caching(engine: LLMEngine, on: bool, store: HostPrefixStore | None = None) -> None:
    """Turn the engine's prefix cache on (empty; with `store`, emptied, as its host tier) or
    off between passes, as the flags would."""
    engine.kv.kept[:] = 0
    if store is not None:
        store.clear()
    engine.prefixes = PrefixCache(engine.kv, store) if on else None
    engine.scheduler.prefixes = engine.prefixes


def run_pass(args, engine: LLMEngine, work, concurrency: int | None = None) -> dict:
    device = engine.device
    concurrency = concurrency or args.concurrency
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    todo = list(enumerate(work))
    todo.reverse()
    added: dict[str, tuple[int, float]] = {}
    reqs = {}
    ttft = {}
    prefilled0 = engine.metrics.prompt_tokens._value.get()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()

    def add_one() -> None:
        i, (prompt, adapter) = todo.pop()
        r = engine.make_request(prompt, params, adapter)
        engine.add_request(r)
        added[r.request_id] = (i, time.perf_counter())
        reqs[i] = r

    while todo and len(added) < concurrency:
        add_one()
    in_flight = len(added)
    steps = {"prefill": [0, 0.0], "decode": [0, 0.0]}  # steps that prefilled (and decoded) or only decoded: count, s
    while in_flight:
        t_step, before = time.perf_counter(), engine.metrics.prompt_tokens._value.get()
        outs = engine.step()
        now = time.perf_counter()
        kind = steps["prefill" if engine.metrics.prompt_tokens._value.get() > before else "decode"]
        kind[0] += 1
        kind[1] += now - t_step
        for o in outs:
            i, t_add = added[o.request_id]
            if i not in ttft and o.token_ids:
                ttft[i] = now - t_add
            if o.finished:
                in_flight -= 1
                if todo:
                    add_one()
                    in_flight += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    times = sorted(ttft.values())
    return {
        "wall_s": wall,
        "requests_per_s": len(work) / wall,
        "prompt_tokens_prefilled": engine.metrics.prompt_tokens._value.get() - prefilled0,
        "prompt_tokens": sum(len(p) for p, _ in work),
        "cached_tokens": sum(r.cached_tokens for r in reqs.values()),
        "ttft_ms_p50": 1e3 * statistics.median(times),
        "ttft_ms_p95": 1e3 * times[min(len(times) - 1, int(0.95 * len(times)))],
        "prefill_steps": steps["prefill"][0], "prefill_steps_s": steps["prefill"][1],
        "decode_only_steps": steps["decode"][0], "decode_only_steps_s": steps["decode"][1],
        "outputs": [reqs[i].output_ids for i in range(len(work))],
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two passes' greedy outputs (per request) agree: whole, first token, and the
    mean number of tokens before they first differ."""
    common = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        common.append(n)
    return {"equal": sum(x == y for x, y in zip(a, b)), "first_equal": sum(n > 0 for n in common),
            "mean_common": statistics.mean(common)}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("loraplex.server.adapters").setLevel(logging.WARNING)
    cfg = named_shape(args.shape)
    prompt_len = args.system_len + args.question_len
    settings = ServerSettings(
        dummy_weights=args.shape, device=args.device, dtype=args.dtype, max_num_seqs=args.concurrency,
        max_model_len=prompt_len + args.max_tokens + 8, max_prefill_tokens=max(4096, prompt_len),
        max_loras=max(args.adapters, 1), max_lora_rank=args.rank, warmup=True)
    engine = LLMEngine.from_settings(settings)
    engine.model.prefill_kernel = not args.sdpa_prefill
    if args.eager_prefill:
        engine.prefill_graphs.enabled = False
    for i in range(args.adapters):
        spec, tensors = random_adapter(cfg, args.rank, seed=100 + i, device=engine.device, dtype=engine.dtype)
        engine.adapters.install(AdapterId(f"a{i}", f"random-{i}", "memory"), spec, tensors)
    engine.warm_up()
    work = make_workload(args, cfg.vocab_size)
    set_prefix_caching(engine, True)
    first = run_pass(args, engine, work)  # compiles the prefill shapes of both modes' first steps
    set_prefix_caching(engine, False)
    run_pass(args, engine, work[: args.concurrency])
    log.info("untimed first pass: %.2f s", first["wall_s"])
    store = None
    if args.kv_offloading_size:
        store = HostPrefixStore(engine.kv, int(args.kv_offloading_size * 2**30))
        log.info("host tier: %.2f GB, %d blocks", store.nbytes / 1e9, store.num_blocks)
    modes = ("off", "on") + (("host",) if store is not None else ())
    passes: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            set_prefix_caching(engine, mode != "off", store if mode == "host" else None)
            r = run_pass(args, engine, work)
            if mode == "host":
                r["host_tier"] = {"loaded_tokens": store.loaded_tokens, "saved_tokens": store.saved_tokens}
            passes[mode].append(r)
            log.info("prefix cache %-4s  %.2f s  %6.1f req/s  prefilled %7d of %7d prompt tokens  ttft p50 %7.1f ms"
                     "  p95 %7.1f ms  steps: %d prefilling %.2f s, %d decoding only %.2f s", mode, r["wall_s"],
                     r["requests_per_s"], r["prompt_tokens_prefilled"], r["prompt_tokens"], r["ttft_ms_p50"],
                     r["ttft_ms_p95"], r["prefill_steps"], r["prefill_steps_s"], r["decode_only_steps"],
                     r["decode_only_steps_s"])
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        set_prefix_caching(engine, True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            run_pass(args, engine, work)
        table = prof.key_averages()
        for key in (["self_cuda_time_total"] if engine.device.type == "cuda" else []) + ["self_cpu_time_total"]:
            log.info("profile of a pass with the cache on, by %s:\n%s", key, table.table(sort_by=key, row_limit=18))
    set_prefix_caching(engine, False)
    fewer = max(1, args.concurrency - 1)
    rebatched = run_pass(args, engine, work, concurrency=fewer)
    off, on = passes["off"], passes["on"]
    same = agreement(off[-1]["outputs"], on[-1]["outputs"])
    batching = agreement(off[-1]["outputs"], rebatched["outputs"])
    log.info("cache off, %d in flight, against %d: outputs equal %d, first tokens %d of %d",
             args.concurrency, fewer, batching["equal"], batching["first_equal"], len(work))
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    summary = {
        "speedup_wall": med(off, "wall_s") / med(on, "wall_s"),
        "ttft_p50_ratio_on_over_off": med(on, "ttft_ms_p50") / med(off, "ttft_ms_p50"),
        "ttft_p95_ratio_on_over_off": med(on, "ttft_ms_p95") / med(off, "ttft_ms_p95"),
        "prefilled_ratio_on_over_off": med(on, "prompt_tokens_prefilled") / med(off, "prompt_tokens_prefilled"),
        "outputs_equal": f"{same['equal']} of {len(work)}",
        "first_tokens_equal": f"{same['first_equal']} of {len(work)}",
        "mean_tokens_before_a_difference": same["mean_common"],
        "off_rebatched": {"concurrency": fewer,
                          "outputs_equal": f"{batching['equal']} of {len(work)}",
                          "first_tokens_equal": f"{batching['first_equal']} of {len(work)}",
                          "mean_tokens_before_a_difference": batching["mean_common"]},
    }
    log.info("on vs off: %.2fx wall, ttft p50 %.3fx, p95 %.3fx, prefilled %.3fx; outputs equal %s, first tokens %s",
             summary["speedup_wall"], summary["ttft_p50_ratio_on_over_off"], summary["ttft_p95_ratio_on_over_off"],
             summary["prefilled_ratio_on_over_off"], summary["outputs_equal"], summary["first_tokens_equal"])
    if store is not None:
        host = passes["host"]
        same_host = agreement(off[-1]["outputs"], host[-1]["outputs"])
        summary["host_tier"] = {
            "speedup_wall_over_on": med(on, "wall_s") / med(host, "wall_s"),
            "prefilled_ratio_over_on": med(host, "prompt_tokens_prefilled") / med(on, "prompt_tokens_prefilled"),
            "ttft_p50_ratio_over_on": med(host, "ttft_ms_p50") / med(on, "ttft_ms_p50"),
            "ttft_p95_ratio_over_on": med(host, "ttft_ms_p95") / med(on, "ttft_ms_p95"),
            "outputs_equal_to_off": f"{same_host['equal']} of {len(work)}",
            "first_tokens_equal_to_off": f"{same_host['first_equal']} of {len(work)}",
            "mean_tokens_before_a_difference": same_host["mean_common"],
        }
        t = summary["host_tier"]
        log.info("host tier vs rows only: %.2fx wall, prefilled %.3fx, ttft p50 %.3fx, p95 %.3fx; outputs equal to "
                 "off %s, first tokens %s", t["speedup_wall_over_on"], t["prefilled_ratio_over_on"],
                 t["ttft_p50_ratio_over_on"], t["ttft_p95_ratio_over_on"], t["outputs_equal_to_off"],
                 t["first_tokens_equal_to_off"])
    for rs in passes.values():
        for r in rs:
            r.pop("outputs")
    doc = {
        "meta": {"device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else
                 platform.processor() or "cpu", "dtype": str(engine.dtype), "torch": torch.__version__,
                 "shape": args.shape, "args": {k: v for k, v in vars(args).items() if k != "out"}},
        "summary": summary, "off": off, "on": on, **({"host": passes["host"]} if store is not None else {}),
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
