"""Serving-mix benchmark: the engine under churn, with and without the decode look-ahead
(or the prefill CUDA graphs).

    python3 bench/serving_mix_bench.py --out $OUT/mix.json              # one GPU: Llama-3-8B shape, bf16
    python3 bench/serving_mix_bench.py --shape tiny --quick --out /tmp/m.json   # CPU smoke test

`engine_bench.py` times steady decode (every row decoding, no arrivals). Here requests of
random prompt lengths and output lengths over the base and `--adapters` rank-16 adapters
arrive while others run (`--arrivals` per step until all are in), so steps mix prefills,
decodes, rows leaving and rows joining, as a server's do. Each mode (`--no-decode-look-ahead`
and the default) runs the same requests in turn, `--rounds` times, alternating, on one engine
(its graphs captured in an untimed first round); per round: generated tokens per second over
the round's wall time, and the steps taken. `--compare prefill-graphs` alternates every
prefill step run eagerly against steps of up to 1,024 tokens replayed as CUDA graphs
(server/prefill_graphs.py) instead, the look-ahead on in both.
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
from loraplex.server.sampling import SamplingParams  # noqa: E402
from loraplex.server.settings import ServerSettings  # noqa: E402

log = logging.getLogger("serving_mix_bench")


def set_look_ahead(engine: LLMEngine, on: bool) -> None:
    engine.look_ahead = on  # on the CPU it gains nothing, but runs


def set_prefill_graphs(engine: LLMEngine, on: bool) -> None:
    engine.prefill_graphs.enabled = on and engine.prefill_graphs.use_graphs


# --compare: (the mode without, the mode with, how to set it)
COMPARES = {"look-ahead": ("waiting", "look_ahead", set_look_ahead),
            "prefill-graphs": ("eager_prefill", "prefill_graphs", set_prefill_graphs)}


def parse_args(argv=None):
    p = engine_parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=384, help="requests per round (default 384)")
    p.add_argument("--batch", type=int, default=64, help="rows decoded together (default 64)")
    p.add_argument("--adapters", type=int, default=32, help="distinct adapters; a fifth of requests use the base")
    p.add_argument("--arrivals", type=int, default=2, help="requests arriving per step (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per mode (default 2)")
    p.add_argument("--compare", choices=sorted(COMPARES), default="look-ahead",
                   help="what the two modes differ in (default look-ahead)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.batch, a.adapters, a.rounds = 24, 8, 4, 1
    return a


def workload(args, vocab: int) -> list[tuple[list[int], int, str | None]]:
    """(prompt, max_tokens, adapter) per request: prompts of 32-1024 tokens, outputs of 16-256."""
    rng = random.Random(2026)
    short = args.quick
    out = []
    for i in range(args.requests):
        n = rng.randrange(4, 24) if short else rng.randrange(32, 1024)
        prompt = [rng.randrange(3, vocab) for _ in range(n)]
        max_tokens = rng.randrange(2, 8) if short else rng.randrange(16, 256)
        adapter = None if i % 5 == 4 else f"a{rng.randrange(args.adapters)}"
        out.append((prompt, max_tokens, adapter))
    return out


def run_round(engine: LLMEngine, work, arrivals: int) -> dict:
    pending = list(work)
    steps = tokens = 0
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while pending or engine.has_work():
        for prompt, max_tokens, adapter in pending[:arrivals]:
            engine.add_request(engine.make_request(
                prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), adapter))
        del pending[:arrivals]
        tokens += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    sync()
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "steps": steps,
            "look_ahead_hits": engine.look_ahead_hits, "look_ahead_misses": engine.look_ahead_misses}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("loraplex.server.adapters").setLevel(logging.WARNING)
    cfg = named_shape(args.shape)
    work = workload(args, cfg.vocab_size)
    longest = max(len(p) + m for p, m, _ in work)
    settings = ServerSettings(dummy_weights=args.shape, device=args.device, dtype=args.dtype,
                              max_num_seqs=args.batch, max_model_len=longest + 8, max_prefill_tokens=8192,
                              max_loras=args.adapters, max_lora_rank=args.rank, warmup=False)
    engine = LLMEngine.from_settings(settings)
    for i in range(args.adapters):
        spec, tensors = random_adapter(cfg, args.rank, seed=100 + i, device=engine.device, dtype=engine.dtype)
        engine.adapters.install(AdapterId(f"a{i}", f"random-{i}", "memory"), spec, tensors)
    cuda = engine.device.type == "cuda"
    run_round(engine, work, args.arrivals)  # untimed: compiles and captures what the rounds need
    without, with_, switch = COMPARES[args.compare]
    rounds = {without: [], with_: []}
    for _ in range(args.rounds):
        for mode in rounds:
            switch(engine, mode == with_)
            engine.look_ahead_hits = engine.look_ahead_misses = 0
            r = run_round(engine, work, args.arrivals)
            rounds[mode].append(r)
            log.info("%-14s %8.1f tok/s  %d tokens in %.2f s, %d steps (look-ahead used %d, missed %d)", mode,
                     r["tok_s"], r["tokens"], r["seconds"], r["steps"], r["look_ahead_hits"], r["look_ahead_misses"])
    gain = statistics.median(r["tok_s"] for r in rounds[with_]) / statistics.median(
        r["tok_s"] for r in rounds[without])
    log.info("%s / %s: %.3fx tokens/s (medians)", with_, without, gain)
    doc = {
        "benchmark": "serving_mix",
        "device": torch.cuda.get_device_name(engine.device) if cuda else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "config": {"shape": args.shape, "dtype": str(engine.dtype).removeprefix("torch."), "batch": args.batch,
                   "requests": args.requests, "adapters": args.adapters, "rank": args.rank,
                   "arrivals_per_step": args.arrivals, "quick": args.quick, "compare": args.compare},
        "rounds": rounds,
        f"{with_}_over_{without}": gain,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
