"""Checks and times the fused decode ops (server/ops) against the torch ops they replace, on
Llama-3-8B decode shapes (batch 64, kv_len 576, bf16), on one GPU, in one run.

    python3 bench/ops_bench.py --out results.json [--sweep]
    python3 bench/ops_bench.py --quick --out /tmp/ops.json   # CPU smoke test (Triton interpreter)

For each op, in this order:
  1. the fused op is checked against its torch reference (server/ops/reference.py): the
     largest error relative to the reference's largest magnitude must be under the dtype's
     tolerance, or the run fails;
  2. the fused op and the torch-op sequence `LlamaModel._decode_torch` runs in its place
     are each captured in a CUDA graph and their replays timed with L2 flushed before each
     (median of `--reps`);
  3. achieved bandwidth counts the fewest bytes (each input read once, each output written
     once; for attention the K/V rows each row's keys cover), against the measured
     device-to-device copy bandwidth.
`per_step` adds the ops up as a 32-layer decode step calls them (attention, RoPE and silu*mul
once per layer, add+RMSNorm twice, RMSNorm once). `--sweep` times decode attention's launch
configurations (splits x keys per step and warps x stages) at several batch sizes, beside
the configuration `attention_config` picks for each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

QUICK_BATCH, QUICK_KV_LEN, QUICK_MAX_LEN = 4, 40, 48
# Largest error relative to the reference's largest magnitude: about two roundings.
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}
SWEEP = dict(splits=(1, 2, 3, 4, 6), tile=((32, 4), (64, 4), (64, 8), (128, 8)), num_stages=(2, 3))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--batch", type=int, default=64, help="decode rows")
    p.add_argument("--kv-len", type=int, default=576, help="keys read per row (the step's kv_len)")
    p.add_argument("--max-len", type=int, default=1024, help="KV cache length (rows are strided by it)")
    p.add_argument("--reps", type=int, default=50, help="timed graph replays per op (median)")
    p.add_argument("--sweep", action="store_true", help="also time decode attention's launch configurations")
    p.add_argument("--sweep-batches", default="8,32,64", help="batch sizes the sweep runs at (comma-separated)")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny shapes (batch {QUICK_BATCH}, kv_len {QUICK_KV_LEN}, the 'tiny' model); "
                        "float16 through the Triton interpreter when there is no GPU")
    return p.parse_args(argv)


class WallTimer:
    """Eager calls timed on the host (the CPU smoke run: numbers mean nothing, code paths do)."""

    def __init__(self, reps: int):
        self.reps = reps

    def __call__(self, fn) -> float:
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return sorted(times)[len(times) // 2]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


class Case:
    """The inputs of one decode step's layer at the chosen shape, and each op's two versions."""

    def __init__(self, cfg, batch: int, kv_len: int, max_len: int, device, dtype):
        from loraplex.server.model import rope_inv_freq

        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*shape, scale=1.0):
            return torch.randn(shape, generator=gen, device=device).mul_(scale).to(dtype)

        self.cfg, self.batch, self.kv_len, self.dtype = cfg, batch, kv_len, dtype
        h, d, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.scale = d ** -0.5
        # As a bucketed step sees them: kv_len = max position + 1 rounded up to 16.
        self.positions = (kv_len - 1 - torch.randint(0, 16, (batch,), generator=gen, device=device)).clamp_min(0)
        self.positions[0] = kv_len - 1
        self.rows = torch.arange(batch, device=device)
        self.k_cache = randn(batch, nkv, max_len, d)
        self.v_cache = randn(batch, nkv, max_len, d)
        self.q = randn(batch, nq, d, scale=self.scale)
        self.qkv = randn(batch, (nq + 2 * nkv) * d)
        self.x, self.delta = randn(batch, h), randn(batch, h)
        self.weight = torch.rand(h, generator=gen, device=device).add_(0.5).to(dtype)
        self.gate_up = randn(batch, 2 * cfg.intermediate_size, scale=2.0)
        # RoPE tables as LlamaModel builds them: float32 [max_len, d]; the torch path's per-step
        # tables [B, heads + kv_heads, d] with the q scale and rotate_half's sign folded in.
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1).to(device)
        self.cos, self.sin = emb.cos(), emb.sin()
        head_scale = torch.ones(nq + nkv, 1, device=device)
        head_scale[:nq] = self.scale
        sign = torch.ones(d, device=device)
        sign[: d // 2] = -1.0
        self.step_cos = (self.cos[self.positions].unsqueeze(1) * head_scale).to(dtype)
        self.step_sin = (self.sin[self.positions].unsqueeze(1) * head_scale * sign).to(dtype)
        keys = torch.arange(kv_len, device=device)
        self.future = (keys[None, :] > self.positions[:, None]).view(batch, 1, 1, kv_len)

    def keys_read(self) -> int:
        return int(torch.clamp(self.positions + 1, max=self.kv_len).sum())

    # -- the torch-op sequences of LlamaModel._decode_torch -----------------------------------

    def torch_attention(self):
        cfg, b = self.cfg, self.batch
        qg = self.q.view(b, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
        scores = torch.matmul(qg, self.k_cache[:, :, : self.kv_len].transpose(-1, -2))
        probs = torch.softmax(scores.masked_fill_(self.future, float("-inf")), dim=-1)
        return torch.matmul(probs, self.v_cache[:, :, : self.kv_len])

    def torch_rope(self):
        cfg, b, d = self.cfg, self.batch, self.cfg.head_dim
        nq, nkv = cfg.num_heads, cfg.num_kv_heads
        qk = self.qkv[:, : (nq + nkv) * d].view(b, nq + nkv, d)
        qk = torch.addcmul(qk * self.step_cos, qk.roll(d // 2, dims=-1), self.step_sin)
        self.k_cache[self.rows, :, self.positions] = qk[:, nq:]
        self.v_cache[self.rows, :, self.positions] = self.qkv[:, (nq + nkv) * d:].view(b, nkv, d)
        return qk[:, :nq]

    def torch_add_rms_norm(self):
        x = self.x + self.delta
        return x, F.rms_norm(x, (x.shape[1],), self.weight, self.cfg.rms_norm_eps)

    def torch_rms_norm(self):
        return F.rms_norm(self.x, (self.x.shape[1],), self.weight, self.cfg.rms_norm_eps)

    def torch_silu_mul(self):
        gate, up = self.gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def run_ops(case: Case, timer, bandwidth: float, attention_config) -> list[dict]:
    from loraplex.server import ops
    from loraplex.server.ops import reference as ref

    cfg, b, isz = case.cfg, case.batch, case.dtype.itemsize
    eps, d, nq, nkv, h = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    x, delta, weight = case.x, case.delta, case.weight

    def fused_attention():
        return ops.decode_attention(case.q, case.k_cache, case.v_cache, case.positions, case.kv_len,
                                    config=attention_config)

    def fused_rope():
        return ops.rope_and_cache_write(case.qkv, case.cos, case.sin, case.k_cache, case.v_cache, case.rows,
                                        case.positions, case.scale)

    def fused_add_rms_norm():
        return ops.add_rms_norm(x, delta, weight, eps)

    def fused_rms_norm():
        return ops.rms_norm(x, weight, eps)

    def fused_silu_mul():
        return ops.silu_mul(case.gate_up)

    def check(fused, reference):
        """The error of fused() against reference(), the largest over tuple outputs."""
        def run():
            got, want = fused(), reference()
            if isinstance(got, tuple):
                return max(rel_error(g, w) for g, w in zip(got, want))
            return rel_error(got, want)
        return run

    def check_rope():
        """q, and the K/V entries the step writes, against the reference on copies of the caches."""
        kc, vc = case.k_cache.clone(), case.v_cache.clone()
        want = ref.rope_and_cache_write_reference(case.qkv, case.cos, case.sin, kc, vc, case.rows, case.positions,
                                                  case.scale)
        got = fused_rope()
        written = (case.rows, slice(None), case.positions)
        return max(rel_error(got, want), rel_error(case.k_cache[written], kc[written]),
                   rel_error(case.v_cache[written], vc[written]))

    layers = cfg.num_layers
    specs = [
        # op, calls per step, fused, torch ops, error check, fewest bytes
        ("decode_attention", layers, fused_attention, case.torch_attention,
         check(fused_attention, lambda: ref.decode_attention_reference(case.q, case.k_cache, case.v_cache,
                                                                       case.positions, case.kv_len)),
         2 * case.keys_read() * nkv * d * isz + 2 * b * nq * d * isz),
        ("rope_and_cache_write", layers, fused_rope, case.torch_rope, check_rope,
         2 * b * (nq + 2 * nkv) * d * isz + 2 * b * d * 4),
        ("add_rms_norm", 2 * layers, fused_add_rms_norm, case.torch_add_rms_norm,
         check(fused_add_rms_norm, lambda: ref.add_rms_norm_reference(x, delta, weight, eps)),
         4 * b * h * isz + h * isz),
        ("rms_norm", 1, fused_rms_norm, case.torch_rms_norm,
         check(fused_rms_norm, lambda: ref.rms_norm_reference(x, weight, eps)),
         2 * b * h * isz + h * isz),
        ("silu_mul", layers, fused_silu_mul, case.torch_silu_mul,
         check(fused_silu_mul, lambda: ref.silu_mul_reference(case.gate_up)),
         3 * b * cfg.intermediate_size * isz),
    ]
    results = []
    for name, count, fused, baseline, check_fn, nbytes in specs:
        error = check_fn()
        if not error <= TOLERANCE[case.dtype]:
            raise SystemExit(f"{name}: error {error:.3g} over the {case.dtype} tolerance {TOLERANCE[case.dtype]}")
        fused_us, torch_us = timer(fused), timer(baseline)
        results.append({
            "op": name, "count_per_step": count, "bytes": nbytes, "max_error": error,
            "tolerance": TOLERANCE[case.dtype], "fused_us": fused_us, "torch_us": torch_us,
            "speedup": torch_us / fused_us, "fused_GBps": nbytes / fused_us / 1e3,
            "floor_us": nbytes / bandwidth * 1e6, "fused_vs_floor": fused_us / (nbytes / bandwidth * 1e6)})
        print(f"{name:22s} fused {fused_us:8.1f} us  torch {torch_us:8.1f} us  x{torch_us / fused_us:5.2f}  "
              f"{nbytes / fused_us / 1e3:7.0f} GB/s  err {error:.2e}", flush=True)
    return results


def sweep_attention(case: Case, timer, bandwidth: float) -> dict:
    """Every configuration of SWEEP at this case's batch, fastest first, and the default's."""
    from loraplex.server.ops import decode_attention
    from loraplex.server.ops.attention import AttentionConfig, attention_config, split_keys
    from loraplex.server.ops.reference import decode_attention_reference

    cfg = case.cfg
    want = decode_attention_reference(case.q, case.k_cache, case.v_cache, case.positions, case.kv_len)
    nbytes = 2 * case.keys_read() * cfg.num_kv_heads * cfg.head_dim * case.dtype.itemsize
    configs = {}
    for splits, (block_n, num_warps), num_stages in itertools.product(*SWEEP.values()):
        splits = split_keys(case.kv_len, splits, block_n)[1]  # distinct effective splits only
        configs[splits, block_n, num_warps, num_stages] = AttentionConfig(splits, block_n, num_warps, num_stages)
    rows = []
    for config in configs.values():
        fn = lambda: decode_attention(case.q, case.k_cache, case.v_cache, case.positions, case.kv_len,  # noqa: E731
                                      config=config)
        try:
            error = rel_error(fn(), want)
            us = timer(fn)
        except Exception as e:  # a configuration that does not compile (shared memory) is recorded
            rows.append({**asdict(config), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        if not error <= TOLERANCE[case.dtype]:
            rows.append({**asdict(config), "error": f"max error {error:.3g} over the tolerance"})
            continue
        rows.append({**asdict(config), "us": us, "kv_GBps": nbytes / us / 1e3,
                     "vs_copy_bandwidth": nbytes / us / 1e3 / (bandwidth / 1e9), "max_error": error})
    rows.sort(key=lambda r: r.get("us", float("inf")))
    default = asdict(attention_config(case.batch, cfg.num_kv_heads, case.kv_len, cfg.head_dim, case.q.device))
    default_row = next((r for r in rows if all(r[k] == v for k, v in default.items())), None)
    print(f"sweep batch {case.batch}: best {rows[0]}\n  default {default_row}", flush=True)
    return {"batch": case.batch, "default": default, "configs": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when server/ops' kernels are defined
    from loraplex.server.config import named_shape
    from loraplex.server.ops.attention import attention_config

    if args.quick:
        cfg = named_shape("tiny")
        batch, kv_len, max_len, reps = QUICK_BATCH, QUICK_KV_LEN, QUICK_MAX_LEN, 3
    else:
        cfg = named_shape("llama-3-8b")
        batch, kv_len, max_len, reps = args.batch, args.kv_len, args.max_len, args.reps
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float16
    case = Case(cfg, batch, kv_len, max_len, device, dtype)
    if cuda:
        from kernels_bench import GraphTimer, copy_bandwidth

        timer, bandwidth = GraphTimer(reps), copy_bandwidth()
    else:
        timer, bandwidth = WallTimer(reps), 1e9  # placeholder bandwidth: the smoke run checks code paths
    config = attention_config(batch, cfg.num_kv_heads, kv_len, cfg.head_dim, device)
    ops_results = run_ops(case, timer, bandwidth, config)
    doc = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__,
                     "python": platform.python_version()},
        "shape": {"model": "tiny" if args.quick else "llama-3-8b", "batch": batch, "kv_len": kv_len,
                  "max_len": max_len, "dtype": str(dtype).removeprefix("torch."), "keys_read": case.keys_read()},
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "attention_config": asdict(config),
        "ops": ops_results,
        "per_step": {
            "fused_us": sum(r["count_per_step"] * r["fused_us"] for r in ops_results),
            "torch_us": sum(r["count_per_step"] * r["torch_us"] for r in ops_results),
        },
    }
    doc["per_step"]["saved_us"] = doc["per_step"]["torch_us"] - doc["per_step"]["fused_us"]
    if args.sweep:
        doc["attention_sweep"] = [sweep_attention(Case(cfg, int(n), kv_len, max_len, device, dtype), timer, bandwidth)
                                  for n in args.sweep_batches.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"per step: fused {doc['per_step']['fused_us']:.0f} us, torch {doc['per_step']['torch_us']:.0f} us "
          f"-> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
