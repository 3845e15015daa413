"""The Python around a load from disk, on the CPU: what each step costs for one rank-16
Llama-3-8B adapter on all seven projections (448 tensors), and what a full garbage
collection adds to a header's parse in a process that has imported the engine.

    python3 bench/disk_read_cpu.py --out bench/results/disk_read_cpu.json

Steps, each the median of `--repeats` on the same files (page cache warm, no read of the
data): `read_adapter` with its header seen before (cached) and never seen (caches cleared);
a HostCopy's per-group views (`layers`); `HostCopy.fill` with the views the tensors go to
and without (a kept plan's reload); `plan_read`. Before them (the process fresh from its
imports, as a server's first loads come after its start-up), the safetensors header's JSON
parsed `--parses` times as it is, then after `freeze_start_up_objects` (the server's
`gc.freeze` once started): median, slowest and the full collections they triggered; and
what one full collection (`gc.collect()`) costs either way, the pause any allocation can
trigger on any thread. The steps run frozen, as in a server.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from cold_load_bench import TARGETS_ALL, write_peft  # noqa: E402
from loraplex.server import adapter_format  # noqa: E402
from loraplex.server.adapter_format import WEIGHTS_FILE, BaseSpec, read_adapter  # noqa: E402
from loraplex.server.adapters import LoRABuffers, random_adapter  # noqa: E402
from loraplex.server.config import named_shape  # noqa: E402
from loraplex.server.disk_read import plan_read  # noqa: E402
from loraplex.server.engine import freeze_start_up_objects  # noqa: E402
from loraplex.server.host_tier import HostCopy  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def parses(raw: bytes, n: int) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        json.loads(raw)
        times.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--parses", type=int, default=20)
    args = p.parse_args(argv)
    cfg = named_shape("llama-3-8b")
    cpu = torch.device("cpu")
    buffers = LoRABuffers(cfg, 1, 16, cpu, torch.bfloat16)
    spec, tensors = random_adapter(cfg, 16, targets=TARGETS_ALL, seed=7, device=cpu, dtype=torch.bfloat16)
    path = Path(tempfile.mkdtemp(prefix="disk-read-cpu-")) / "a"
    write_peft(path, spec, tensors, 16, TARGETS_ALL)
    del tensors
    base = BaseSpec(cfg.num_layers, cfg.module_shapes(), 16)
    weights = path / WEIGHTS_FILE
    # The parses first, as a server's first loads come after its start-up: the objects the
    # imports made are still young enough that allocations soon trigger a full collection.
    with weights.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    objects = len(gc.get_objects())
    full = sum(s["collections"] for s in gc.get_stats()[2:])
    gc_parses = {"objects_tracked": objects, "as_is": parses(raw, args.parses)}
    gc_parses["as_is"]["full_collections"] = sum(s["collections"] for s in gc.get_stats()[2:]) - full
    gc_parses["as_is"]["full_collection_ms"] = median_ms(gc.collect, 5)
    freeze_start_up_objects()
    full = sum(s["collections"] for s in gc.get_stats()[2:])
    gc_parses["frozen"] = parses(raw, args.parses)
    gc_parses["frozen"]["full_collections"] = sum(s["collections"] for s in gc.get_stats()[2:]) - full
    gc_parses["frozen"]["full_collection_ms"] = median_ms(gc.collect, 5)

    def new_header():
        adapter_format.checked_header.cache_clear()
        adapter_format._header_modules.cache_clear()
        return read_adapter(path, base)

    spec = read_adapter(path, base)
    copy = HostCopy(buffers, pin=False)
    targets: list = []
    copy.fill(spec, lambda key, dst: targets.append((key, dst)))
    steps = {
        "read_adapter_header_seen": median_ms(lambda: read_adapter(path, base), args.repeats),
        "read_adapter_header_new": median_ms(new_header, args.repeats),
        "host_copy_views": median_ms(lambda: HostCopy(buffers, pin=False).layers, args.repeats),
        "fill_with_views": median_ms(lambda: copy.fill(spec, lambda key, dst: None), args.repeats),
        "fill_without_views": median_ms(lambda: copy.fill(spec), args.repeats),
        "plan_read": median_ms(lambda: plan_read(weights, targets), args.repeats),
    }
    doc = {"benchmark": "the Python around a load from disk (CPU)", "adapter": "rank-16 Llama-3-8B, all seven",
           "header_bytes": n, "repeats": args.repeats, "python": sys.version.split()[0], "torch": torch.__version__,
           "steps_median_ms": steps, "header_parse_gc": gc_parses}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for name, ms in steps.items():
        print(f"{name:28s} {ms:7.2f} ms")
    for key in ("as_is", "frozen"):
        g = gc_parses[key]
        print(f"header parse, {key:7s} median {g['median_ms']:.2f} ms, slowest {g['max_ms']:.2f} ms "
              f"({g['full_collections']} full collections among them); a full collection "
              f"{g['full_collection_ms']:.1f} ms ({objects} objects tracked before the freeze)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
