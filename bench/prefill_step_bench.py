"""One prefill step, with and without adapters: where its time goes.

    python3 bench/prefill_step_bench.py --out $OUT/prefill_step.json        # one GPU
    python3 bench/prefill_step_bench.py --shape tiny --quick --out /tmp/s.json

`model.prefill` of the engine, called as a serving step calls it, on prompts packed into
one step: `--cases` lists (prompts, tokens each, cached positions before them) triples,
e.g. 4x64@1024 is four 64-token questions after a 1,024-token system prompt that the
prefix cache supplied (the K/V at those positions is whatever the rows hold; attention
reads it all the same). Each case runs base only and with the prompts over `--adapters`
rank-16 adapters on all seven projections (round-robin), each timed by CUDA events over
`--reps` calls after an untimed one, with the host's share (the time to launch a call,
not waiting for the device): eagerly, and (steps that fit, on CUDA) replayed as the
engine's prefill CUDA graph (server/prefill_graphs.py), in turn. With adapters, also the
LoRA launch variants `--variants` names, eagerly: `pdl-off` (every kernel launched
plainly), `block-32` (blocks of 32 rows at every prefill size, not 16 below 512 rows).
`--profile` adds, per case, the GPU time per eager call of each kernel (torch.profiler).

Writes one JSON document and prints a table on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from checkout import engine_parser, use_checkout  # bench/ is sys.path[0]

use_checkout()

from loraplex.kernels import batch as lora_batch  # noqa: E402
from loraplex.kernels import configs as lora_configs  # noqa: E402
from loraplex.server.adapters import AdapterId, random_adapter  # noqa: E402
from loraplex.server.batch import adapter_bucket  # noqa: E402
from loraplex.server.config import named_shape  # noqa: E402
from loraplex.server.engine import LLMEngine  # noqa: E402
from loraplex.server.model import PrefillSeq  # noqa: E402
from loraplex.server.settings import ServerSettings  # noqa: E402

log = logging.getLogger("prefill_step_bench")
VARIANTS = ("pdl-off", "block-32")


def parse_case(text: str) -> tuple[int, int, int]:
    """'4x64@1024' -> (4 prompts, 64 tokens each, 1024 cached positions before them)."""
    try:
        counts, _, cached = text.partition("@")
        prompts, tokens = counts.split("x")
        case = int(prompts), int(tokens), int(cached or 0)
    except ValueError:
        raise SystemExit(f"--cases: {text!r} is not PROMPTSxTOKENS[@CACHED], e.g. 4x64@1024") from None
    if case[0] < 1 or case[1] < 1 or case[2] < 0:
        raise SystemExit(f"--cases: {text!r} needs at least one prompt of one token")
    return case


def parse_args(argv=None):
    p = engine_parser(__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x64@1024,4x64@1024,16x64@1024,30x64@1024,1x1088,4x1088",
                   help="PROMPTSxTOKENS[@CACHED] triples, comma-separated")
    p.add_argument("--adapters", type=int, default=4, help="distinct adapters over the prompts (default 4)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per measure (default 10)")
    p.add_argument("--variants", default="",
                   help=f"LoRA launch variants timed beside the default, of {', '.join(VARIANTS)} (default none)")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel of each case with adapters")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        a.cases, a.adapters, a.reps = "1x8@16,3x8@16,2x24", 2, 2
    a.cases = [parse_case(c) for c in a.cases.split(",") if c]
    a.variants = [v for v in a.variants.split(",") if v]
    for v in a.variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    return a


@contextmanager
def variant(name: str | None):
    """The LoRA launch variant `name` (None: the default) for the calls inside."""
    saved_env, saved_min = os.environ.get("LORAPLEX_PDL"), lora_batch.PREFILL_MIN_TOKENS
    try:
        if name == "pdl-off":
            os.environ["LORAPLEX_PDL"] = "0"
        elif name == "block-32":
            lora_batch.PREFILL_MIN_TOKENS = 0
        lora_configs.supports_pdl.cache_clear()
        yield
    finally:
        if saved_env is None:
            os.environ.pop("LORAPLEX_PDL", None)
        else:
            os.environ["LORAPLEX_PDL"] = saved_env
        lora_batch.PREFILL_MIN_TOKENS = saved_min
        lora_configs.supports_pdl.cache_clear()


def step_inputs(engine: LLMEngine, case, adapters: int):
    """The packed step of `case` on the host: tokens, token slots, sequences, max_adapters,
    layer groups."""
    prompts, length, cached = case
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, engine.model.cfg.vocab_size, (prompts * length,), generator=gen).tolist()
    slots = [i % adapters if adapters else -1 for i in range(prompts) for _ in range(length)]
    seqs = [PrefillSeq(row=i, start=i * length, length=length, pos=cached) for i in range(prompts)]
    groups = engine.lora.groups_of(s for s in slots if s >= 0) if adapters else 0
    return tokens, slots, seqs, adapter_bucket(min(adapters, prompts)), groups


def eager_call(engine: LLMEngine, inputs):
    """`model.prefill` on the step, its inputs sent to the device first (as the engine does)."""
    tokens, slots, seqs, max_adapters, groups = inputs
    device = engine.device
    tokens_d = torch.tensor(tokens, dtype=torch.int64).to(device)
    slots_d = torch.tensor(slots, dtype=torch.int32).to(device)
    return lambda: engine.model.prefill(tokens_d, slots_d, seqs, max_adapters, lora_groups=groups)


def graph_call(engine: LLMEngine, inputs):
    """The step through the engine's prefill graphs, or None where it does not take it."""
    tokens, slots, seqs, max_adapters, groups = inputs
    graphs = engine.prefill_graphs
    if not graphs.use_graphs or not graphs.takes(len(tokens), len(seqs)):
        return None
    return lambda: graphs.run(tokens, slots, seqs, max_adapters, groups)


def sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def time_calls(engine: LLMEngine, call, reps: int) -> dict:
    """Median device time per call (CUDA events; wall time on the CPU) and median host time
    to launch one, after an untimed call (which compiles, or captures, what it needs)."""
    call()
    sync(engine)
    device_ms, host_ms = [], []
    for _ in range(reps):
        if engine.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        call()
        host_ms.append(1e3 * (time.perf_counter() - t0))
        if engine.device.type == "cuda":
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
        else:
            device_ms.append(host_ms[-1])
    return {"ms": statistics.median(device_ms), "host_ms": statistics.median(host_ms)}


def kernel_times(engine: LLMEngine, call, reps: int) -> dict[str, dict]:
    """GPU time per call of each kernel name over `reps` calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        sync(engine)
    out = {}
    for e in prof.key_averages():
        total = getattr(e, "self_device_time_total", None)
        if total is None:
            total = e.self_cuda_time_total
        if total > 0 and e.count:
            out[e.key[:80]] = {"us_per_call": total / reps, "launches_per_call": e.count / reps}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us_per_call"])[:14])


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("loraplex.server.adapters").setLevel(logging.WARNING)
    cfg = named_shape(args.shape)
    longest = max(length + cached for _, length, cached in args.cases)
    settings = ServerSettings(
        dummy_weights=args.shape, device=args.device, dtype=args.dtype,
        max_num_seqs=max(max(p for p, _, _ in args.cases), 2), max_model_len=longest + 8,
        max_prefill_tokens=max(p * n for p, n, _ in args.cases), max_loras=max(args.adapters, 1),
        max_lora_rank=args.rank, warmup=True)
    engine = LLMEngine.from_settings(settings)
    for i in range(args.adapters):
        spec, tensors = random_adapter(cfg, args.rank, seed=100 + i, device=engine.device, dtype=engine.dtype)
        engine.adapters.install(AdapterId(f"a{i}", f"random-{i}", "memory"), spec, tensors)
    engine.warm_up()
    results = []
    for case in args.cases:
        prompts, length, cached = case
        row = {"prompts": prompts, "tokens_each": length, "cached": cached, "rows": prompts * length}
        for name, adapters in (("base", 0), ("adapters", args.adapters)):
            if name == "adapters" and not adapters:
                continue
            inputs = step_inputs(engine, case, adapters)
            row[name] = time_calls(engine, eager_call(engine, inputs), args.reps)
            graph = graph_call(engine, inputs)
            if graph is not None:
                row[f"{name}_graph"] = time_calls(engine, graph, args.reps)
                row[f"{name}_graph_speedup"] = row[name]["ms"] / row[f"{name}_graph"]["ms"]
            if name == "adapters":
                for v in args.variants:
                    with variant(v):
                        row[v] = time_calls(engine, eager_call(engine, inputs), args.reps)
            if args.profile and engine.device.type == "cuda":
                row[f"kernels_{name}"] = kernel_times(engine, eager_call(engine, inputs), args.reps)
        if "adapters" in row:
            row["adapters_over_base"] = row["adapters"]["ms"] / row["base"]["ms"]
            if "adapters_graph" in row:
                row["adapters_over_base_graph"] = row["adapters_graph"]["ms"] / row["base_graph"]["ms"]
        results.append(row)
        nan = {"ms": float("nan"), "host_ms": float("nan")}
        log.info("%3dx%-5d@%-5d  eager: base %7.2f ms (host %6.2f)  adapters %7.2f ms (host %6.2f)  "
                 "graph: base %7.2f  adapters %7.2f%s", prompts, length, cached, row["base"]["ms"],
                 row["base"]["host_ms"], row.get("adapters", nan)["ms"], row.get("adapters", nan)["host_ms"],
                 row.get("base_graph", nan)["ms"], row.get("adapters_graph", nan)["ms"],
                 "".join(f"  {v} {row[v]['ms']:7.2f}" for v in args.variants if v in row))
        for kind in ("kernels_adapters", "kernels_base"):
            for name, k in row.get(kind, {}).items():
                log.info("    %-16s %-60s %8.1f us  %5.0f launches", kind[8:], name[:60], k["us_per_call"],
                         k["launches_per_call"])
    doc = {"meta": {"device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else
                    platform.processor() or "cpu", "dtype": str(engine.dtype), "torch": torch.__version__,
                    "shape": args.shape,
                    "args": {k: v for k, v in vars(args).items() if k != "out"}},
           "cases": results}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
