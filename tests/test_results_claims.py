"""README's performance numbers are the committed results' numbers.

Each test finds one of README's measured claims (the benchmark headlines, the warm-up and
look-ahead figures) and recomputes its numbers from the JSON under `bench/results/` that the
notes name for it, rounded as README writes them. A new measurement changes the JSON, the
notes and README together (and the file named here); a README number that no committed
result holds fails here. Reads files only: no GPU, no network.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# README on one line with single spaces, so a claim may wrap anywhere.
TEXT = " ".join((ROOT / "README.md").read_text().split())


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def claims(pattern: str) -> list[tuple[str, ...]]:
    """Every match of `pattern` in README (at least one), as tuples of its groups."""
    found = [m.groups() for m in re.finditer(pattern, TEXT)]
    assert found, f"README no longer states {pattern!r}: update this test with it"
    return found


def f0(x: float) -> str:
    return f"{x:,.0f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def by_adapters(run: dict) -> dict:
    return {row["adapters"]: row for row in run["loraplex"]}


def test_engine_headline_is_its_json():
    run = load("engine_h200_head_e9d59af.json")
    cfg = run["config"]
    assert (cfg["batch"], cfg["rank"], cfg["prompt_len"]) == (64, 16, 512)
    assert len(cfg["targets"].split(",")) == 7 and run["warmup"]["seconds"] > 0
    rows = by_adapters(run)
    want = [f0(rows[0]["decode_tok_s"]), f2(run["floor"]["ratio"])]
    for n in (1, 8, 32, 64):
        want += [f0(rows[n]["decode_tok_s"]), f2(rows[n]["vs_base"])]
    for got in claims(
        r"runs ([\d,]+) tokens/s base only \(([\d.]+)x its bandwidth floor\) and, with distinct"
        r" rank-16 adapters on all seven projections, ([\d,]+) with one adapter \(([\d.]+)x base\),"
        r" ([\d,]+) with 8 \(([\d.]+)x\), ([\d,]+) with 32 \(([\d.]+)x\) and ([\d,]+) with 64 \(([\d.]+)x\)"
    ):
        assert list(got) == want


def test_hf_peft_ratio_is_one_runs():
    run = load("engine_h200.json")
    ours = by_adapters(run)[32]["decode_tok_s"]
    hf = {row["adapters"]: row["decode_tok_s"] for row in run["hf_peft"]}[32]
    for (got,) in claims(r"([\d.]+)x HF transformers \+ peft's mixed batch with 32 adapters"):
        assert got == f1(ours / hf)


def test_batch_32_ranges():
    runs = [by_adapters(load(f"engine_h200_b32_now_{i}.json")) for i in (1, 2)]
    base = sorted(r[0]["decode_tok_s"] for r in runs)
    lora = sorted(r[32]["decode_tok_s"] for r in runs)
    for got in claims(r"at batch 32, ([\d,]+)-([\d,]+) tokens/s base only and ([\d,]+)-([\d,]+) with 32 adapters"):
        assert list(got) == [f0(base[0]), f0(base[1]), f0(lora[0]), f0(lora[1])]


def test_look_ahead_gains_compare_runs_of_one_call():
    gains = []
    for i in (1, 2):
        off = by_adapters(load(f"engine_h200_look_ahead_off_{i}.json"))
        on = by_adapters(load(f"engine_h200_look_ahead_on_{i}.json"))
        gains += [on[n]["decode_tok_s"] / off[n]["decode_tok_s"] for n in off]
    mix = load("serving_mix_h200.json")["look_ahead_over_waiting"]
    for got in claims(r"([\d.]+)-([\d.]+)x tokens/s in steady decode and ([\d.]+)x with requests arriving"):
        assert list(got) == [f2(min(gains)), f2(max(gains)), f2(mix)]


def test_our_gemm_against_cublas_in_one_call():
    now = by_adapters(load("engine_h200_triton_gemm_now.json"))[32]["vs_base"]
    prev = by_adapters(load("engine_h200_triton_gemm_prev.json"))[32]["vs_base"]
    warm = by_adapters(load("engine_h200_triton_gemm_warm.json"))[32]["vs_base"]
    for got in claims(
        r"projections run at ([\d.]+)x of base throughput, where cuBLAS then `add_lora` ran ([\d.]+)x"
        r" in the same call \(([\d.]+)x in the next call"
    ):
        assert list(got) == [f2(now), f2(prev), f2(warm)]


def test_add_lora_headline_is_the_kernel_files():
    decode = [
        r
        for name in ("kernels_h200_decode_one_launch.json", "kernels_h200_decode_r8_align.json")
        for r in load(name)["results"]
        if r["rank"] <= 16
    ]
    prefill = load("kernels_h200_prefill_final.json")["results"]
    dec = [r["us"]["gather_bmm"] / r["us"]["ours"] for r in decode]
    pre = [r["us"]["gather_bmm"] / r["us"]["ours"] for r in prefill]
    one_token = [r["us"]["ours"] for r in decode if r["tokens"] == 1]
    bandwidth = [r["ours_bandwidth_fraction"] * 100 for r in prefill if r["rank"] == 16]
    (got,) = claims(
        r"`add_lora` is ([\d.]+)x to ([\d.]+)x faster than a torch gather-then-bmm at decode with"
        r" ranks 8 and 16 \(median ([\d.]+)x\) and ([\d.]+)x to ([\d.]+)x at prefill, costs"
        r" ([\d.]+)-([\d.]+) us for one decode token at rank <= 16 on every Llama-3-8B layer, and"
        r" reaches (\d+)-(\d+)% of the copy bandwidth at rank-16 prefill"
    )
    assert list(got) == [
        f1(min(dec)), f"{max(dec):.0f}", f1(statistics.median(dec)),
        f"{min(pre):.0f}", f"{max(pre):.0f}",
        f1(min(one_token)), f1(max(one_token)),
        f"{min(bandwidth):.0f}", f"{max(bandwidth):.0f}",
    ]


def test_warm_up_figures():
    at_start = load("engine_h200_graphs_at_start.json")
    assert at_start["config"]["max_model_len"] == 4096 and at_start["config"]["batch"] == 64
    slowest = by_adapters(at_start)[32]["first_pass"]["step_ms_max"]
    for got in claims(r"([\d.]+) s at start for 64 rows, 32 slots and a 4,096-token cache, after which the slowest decode step of a serving run was ([\d.]+) ms"):
        assert list(got) == [f1(at_start["warmup"]["seconds"]), f1(slowest)]
    for (got,) in claims(r"after it, the slowest decode step of a first pass was ([\d.]+) ms at 32 adapters"):
        assert got == f1(slowest)
    qv = load("engine_h200_qv_warm_masks.json")
    assert qv["config"]["targets"] == "q_proj,v_proj"
    for got in claims(r"with 32 q/v adapters loaded at start, ([\d.]+) s and a slowest first-pass step of ([\d.]+) ms"):
        assert list(got) == [f1(qv["warmup"]["seconds"]), f1(by_adapters(qv)[32]["first_pass"]["step_ms_max"])]
    for (got,) in claims(r"compiles them all: ([\d.]+) s with an empty cache"):
        assert got == f1(load("engine_h200_prefill_warmup_warm.json")["warmup"]["seconds"])


def test_cold_load_figures():
    host = load("cold_load_h200.json")["cold_load"]["host"]["vs_floor"]
    for (got,) in claims(r"a cold adapter load from pinned host memory takes ([\d.]+)x its bytes/bandwidth floor"):
        assert got == f2(host)

    def warm(name: str, key: str = "disk_page_cache_warm") -> float:
        return load(f"cold_load_h200_{name}.json")["cold_load"][key]["median_ms"]

    # Every call since the read plans (17877db), and the code before them in the same calls.
    with_plans = ["read_plans_now", "read_plans_repeat_now", "first_reads_now", "header_cache_now",
                  "profile_new_header", "gc_freeze_on", "pairs32", "head_a4d3343"]
    before = ["read_plans_prev", "read_plans_repeat_prev", "first_reads_prev", "header_cache_prev"]
    # A fleet's next adapter: every call since the header cache (7b85820), at its defaults.
    fleet = ["header_cache_now", "profile_new_header", "gc_freeze_on", "pairs32", "head_a4d3343"]
    reload_now = [warm(n) for n in with_plans]
    reload_before = [warm(n) for n in before]
    next_adapter = [warm(n, "disk_page_cache_warm_first") for n in fleet]
    (got,) = claims(
        r"a reload from local disk with the page cache warm ([\d.]+)-([\d.]+) ms \(its read plan kept;"
        r" ([\d.]+)-([\d.]+) ms before, in the same calls\), the first read of a fleet's next adapter"
        r" ([\d.]+)-([\d.]+) ms \(([\d.]+) before, in one call\)"
    )
    assert list(got) == [
        f1(min(reload_now)), f1(max(reload_now)), f1(min(reload_before)), f1(max(reload_before)),
        f1(min(next_adapter)), f1(max(next_adapter)), f1(warm("header_cache_prev", "disk_page_cache_warm_first")),
    ]


def test_serving_copy_figures():
    h200 = load("serving_copy_h200.json")["loads"]
    for got in claims(r"in float32 ([\d.]+) ms from the node agent's bf16 copy against ([\d.]+) ms from its own file"):
        assert list(got) == [f1(h200["bf16_copy"]["median_ms"]), f1(h200["f32_file"]["median_ms"])]
    cpu = load("serving_copy_cpu.json")
    assert cpu["machine"]["cpus"] == 2 and cpu["same_bits"]
    for (got,) in claims(r"bf16 load ([\d.]+)x faster on a 2-core machine, the same bits"):
        assert got == f2(cpu["speedup"])


def test_cache_policy_headline():
    head = load("cache_sim.json")["headline"]
    assert (head["s"], head["n_adapters"], head["slots"]) == (1.0, 1000, 100)
    for got in claims(r"policy hits ([\d.]+)% where LRU hits ([\d.]+)% \(Zipf 1.0, 1,000 adapters, 100 slots"):
        assert list(got) == [f1(head["hit_rate"]["lfu-aged"] * 100), f1(head["hit_rate"]["lru"] * 100)]


def test_peer_headline_is_its_json():
    run = load("peer_kernels_h200_wide_steps.json")
    rows = [r for r in run["results"] if r["rank"] == 16]
    ratios = [r["ours_over_best_peer"] for r in rows]
    wins = sum(r["fastest"] == "ours" for r in rows)
    want = [str(wins), str(len(rows)), f2(min(ratios)), f2(max(ratios)), f2(statistics.geometric_mean(ratios))]
    versions = run["meta"]["peers"]
    assert (versions["vllm"], versions["sglang"]) == ("0.33.0", "0.5.23")
    for got in claims(r"`add_lora` is the fastest on (\d+) of (\d+) rank-16 cases of the Llama-3-8B decode and "
                      r"prefill table, at ([\d.]+)x-([\d.]+)x the best peer's time \(geomean ([\d.]+)x;"):
        assert list(got) == want, (got, want)


def test_peer_rank_64_headline_is_its_json():
    """Decode from the run at the committed rank-64 expand steps; prefill, which that change
    left alone, from the run before it."""
    decode = load("peer_kernels_h200_r64_block_n_rule.json")["results"]
    prefill = [r for r in load("peer_kernels_h200_r64_block_n.json")["results"] if r["phase"] == "prefill"]
    rows = [r for r in decode + prefill if r["rank"] == 64]
    assert sorted({r["phase"] for r in decode}) == ["decode"] and len(prefill) == 8
    ratios = [r["ours_over_best_peer"] for r in rows]
    wins = sum(r["fastest"] == "ours" for r in rows)
    want = [str(wins), str(len(rows)), f2(min(ratios)), f2(max(ratios)), f2(statistics.geometric_mean(ratios))]
    for got in claims(r"and on (\d+) of (\d+) rank-64 cases, at ([\d.]+)x-([\d.]+)x \(geomean ([\d.]+)x;"):
        assert list(got) == want, (got, want)


def test_peer_layer_headline_is_its_json():
    run = load("peer_kernels_h200_layer_wide_steps.json")
    rows = run["layer_results"]
    assert {r["rank"] for r in rows} == {16} and all("sglang_v2_overlap" in r["layer_us"] for r in rows)
    ratios = [r["ours_layer_over_best_peer"] for r in rows]
    wins = sum(r <= 1 for r in ratios)
    want = [str(wins), str(len(rows)), f2(min(ratios)), f2(max(ratios)), f2(statistics.geometric_mean(ratios))]
    for got in claims(r"ours is the fastest on (\d+) of (\d+) rank-16 cases against each peer's term after cuBLAS and "
                      r"triton_v2 with its own side-stream overlap, at ([\d.]+)x-([\d.]+)x the best peer's layer "
                      r"\(geomean ([\d.]+)x;"):
        assert list(got) == want, (got, want)


def test_structured_rows_claim_is_its_json():
    run = load("engine_h200_structured_rows.json")
    assert run["config"]["batch"] == 64
    ratios = {(s["adapters"], s["structured_rows"]): s["ratio"] for s in run["structured"]}
    (all_rows, some_rows), = claims(r"rows held to a JSON schema decode at ([\d.]+)x the tokens/s of the same batch "
                                    r"without grammars when all 64 rows are held, and ([\d.]+)x when 8 are")
    assert all_rows == f2(ratios[(0, 64)]) and some_rows == f2(ratios[(0, 8)])


def test_prefix_caching_cpu_figures():
    run = load("prefix_cpu_tiny_shared.json")
    args, summary = run["meta"]["args"], run["summary"]
    assert (args["requests"], args["concurrency"], args["system_len"], args["adapters"]) == (64, 8, 512, 4)
    assert summary["outputs_equal"] == "64 of 64"
    want = (f2(summary["speedup_wall"]), f"{summary['prefilled_ratio_on_over_off']:.3f}",
            f"{summary['ttft_p50_ratio_on_over_off']:.3f}", f"{summary['ttft_p95_ratio_on_over_off']:.3f}")
    for got in claims(r"a run took ([\d.]+)x less time with it than without, prefilled ([\d.]+)x the prompt "
                      r"tokens \(each system prompt once\), cut the time to first token at p50 to ([\d.]+)x and "
                      r"at p95 to ([\d.]+)x"):
        assert got == want


def test_prefix_caching_h200_figures():
    runs = [load("prefix_h200.json"), load("prefix_h200_base.json")]
    assert [r["meta"]["args"]["adapters"] for r in runs] == [4, 0] and runs[0]["meta"]["dtype"] == "torch.bfloat16"
    assert all(r["meta"]["args"]["requests"] == 128 and r["meta"]["args"]["concurrency"] == 32 for r in runs)
    assert load("prefix_h200_fp32.json")["summary"]["outputs_equal"] == "64 of 64"
    s = [r["summary"] for r in runs]
    want = (f2(s[0]["speedup_wall"]), f2(s[1]["speedup_wall"]), f"{s[0]['prefilled_ratio_on_over_off']:.3f}",
            f"{s[1]['prefilled_ratio_on_over_off']:.3f}", f"{s[0]['ttft_p50_ratio_on_over_off']:.3f}",
            f"{s[1]['ttft_p50_ratio_on_over_off']:.3f}")
    for got in claims(r"it took ([\d.]+)x less time with four adapters and ([\d.]+)x less for the base, "
                      r"prefilling ([\d.]+)x and ([\d.]+)x the prompt tokens, time to first token p50 "
                      r"([\d.]+)x and ([\d.]+)x"):
        assert got == want


def test_prefill_attention_kernel_figures():
    kernel, sdpa = load("prefix_h200_kernel.json"), load("prefix_h200_sdpa.json")
    assert not kernel["meta"]["args"]["sdpa_prefill"] and sdpa["meta"]["args"]["sdpa_prefill"]
    assert kernel["meta"]["args"]["adapters"] == sdpa["meta"]["args"]["adapters"] == 4
    want = (f2(kernel["summary"]["speedup_wall"]), f2(sdpa["summary"]["speedup_wall"]))
    for got in claims(r"the four-adapter case took ([\d.]+)x less time with the cache than without, "
                      r"against ([\d.]+)x with SDPA per prompt"):
        assert got == want


def test_prefill_graph_figures():
    graphs, eager, base = (load(f"prefix_h200_{n}.json") for n in ("graphs", "eager", "base_graphs"))
    assert eager["meta"]["args"]["eager_prefill"] and not graphs["meta"]["args"]["eager_prefill"]
    assert (graphs["meta"]["args"]["adapters"], base["meta"]["args"]["adapters"]) == (4, 0)
    want = (f2(graphs["summary"]["speedup_wall"]), f2(base["summary"]["speedup_wall"]),
            f"{graphs['summary']['ttft_p50_ratio_on_over_off']:.3f}", f"{base['summary']['ttft_p50_ratio_on_over_off']:.3f}")
    for got in claims(r"it takes ([\d.]+)x less with four adapters and ([\d.]+)x less for the base, time to first\s+"
                      r"token p50 ([\d.]+)x and ([\d.]+)x"):
        assert got == want
    step = load("prefill_step_h200_graphs.json")
    case = next(c for c in step["cases"] if (c["prompts"], c["tokens_each"], c["cached"]) == (1, 64, 1024))
    assert step["meta"]["args"]["adapters"] == 4
    want = (f2(case["adapters_graph"]["ms"]), f2(case["adapters"]["ms"]), f2(case["adapters_graph_speedup"]),
            f2(case["base_graph"]["ms"]), f2(case["base"]["ms"]), f2(case["base_graph_speedup"]))
    for got in claims(r"took ([\d.]+) ms with four\s+adapters against ([\d.]+) ms eagerly \(([\d.]+)x\), and ([\d.]+) ms "
                      r"against ([\d.]+) ms base only \(([\d.]+)x\)"):
        assert got == want
    mix = load("serving_mix_h200_prefill_graphs.json")
    assert mix["config"]["compare"] == "prefill-graphs" and mix["config"]["adapters"] == 32
    for got in claims(r"the graphs gave ([\d.]+)x the tokens/s of eager prefill in one run"):
        assert got == (f2(mix["prefill_graphs_over_eager_prefill"]),)


def test_kv_offloading_cpu_figures():
    run = load("prefix_cpu_tiny_offload.json")
    args, host = run["meta"]["args"], run["summary"]["host_tier"]
    assert (args["system_prompts"], args["adapters"], args["concurrency"]) == (32, 4, 8)
    assert host["outputs_equal_to_off"] == "128 of 128"
    assert all(r["prompt_tokens_prefilled"] == r["prompt_tokens"] for r in run["on"])  # the rows found nothing
    want = (f"{host['prefilled_ratio_over_on']:.3f}", f2(host["speedup_wall_over_on"]),
            f"{host['ttft_p50_ratio_over_on']:.3f}")
    for got in claims(r"with the host tier a run prefilled ([\d.]+)x the prompt tokens and took ([\d.]+)x less "
                      r"time,\s+time to first token p50 ([\d.]+)x"):
        assert got == want


def test_kv_offloading_h200_figures():
    reuse, once = load("prefix_h200_offload_reuse.json"), load("prefix_h200_offload.json")
    args = reuse["meta"]["args"]
    assert (args["requests"], args["system_prompts"], args["adapters"], args["system_len"]) == (384, 128, 4, 1024)
    assert once["meta"]["args"]["requests"] == once["meta"]["args"]["system_prompts"] == 128
    assert all(r["prompt_tokens_prefilled"] == r["prompt_tokens"] for r in reuse["on"])  # the rows found nothing
    host = reuse["summary"]["host_tier"]
    want = (f"{host['prefilled_ratio_over_on']:.3f}", f2(host["speedup_wall_over_on"]),
            f"{host['ttft_p50_ratio_over_on']:.3f}", f2(once["summary"]["host_tier"]["speedup_wall_over_on"]))
    for got in claims(r"the host tier prefilled ([\d.]+)x the prompt tokens of the rows alone and took ([\d.]+)x "
                      r"less time, time to first token p50 ([\d.]+)x; with no prompt asked twice its saves cost "
                      r"([\d.]+)x"):
        assert got == want


def test_async_saves_h200_figure():
    now, prev = load("prefix_h200_async_saves2_once_now.json"), load("prefix_h200_async_saves2_once_prev.json")
    for run in (now, prev):
        assert run["meta"]["args"]["requests"] == run["meta"]["args"]["system_prompts"] == 128
    assert prev["summary"]["host_tier"]["speedup_wall_over_on"] < now["summary"]["host_tier"]["speedup_wall_over_on"]
    (got,) = claims(r"and ([\d.]+)x since each save's copy to the host runs on a stream of its own")
    assert got == (f"{now['summary']['host_tier']['speedup_wall_over_on']:.3f}",)
