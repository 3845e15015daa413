"""A disk load of an F32 adapter into bf16 slots, from the F32 file against the node agent's
bf16 copy of it (node_agent.convert), page cache warm; and what writing that copy costs once,
at staging. CPU only: the host side of a load (no GPU copy), which is where the conversion
runs.

    python3 bench/serving_copy_bench.py --out serving_copy.json [--shape llama-3-8b] [--repeats 9]

One rank-16 adapter on all seven projections of the shape, saved in float32 as PEFT saves it;
`read_into_host` into one bf16 slot's host copy with the loader's read threads, once from
each file, alternating, median of `--repeats`; each read's result checked equal to the
other's on every element the kernels read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from loraplex.node_agent.convert import write_serving_copy  # noqa: E402
from loraplex.server.adapter_format import (  # noqa: E402
    LORA_MODULES,
    WEIGHTS_FILE,
    BaseSpec,
    read_adapter,
    serving_weights_name,
    write_adapter_config,
)
from loraplex.server.adapters import LoRABuffers, projection_ranks, random_adapter  # noqa: E402
from loraplex.server.config import named_shape  # noqa: E402
from loraplex.server.host_tier import read_into_host  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default="serving_copy.json")
    args = p.parse_args(argv)
    cfg = named_shape(args.shape)
    base = BaseSpec(num_layers=cfg.num_layers, module_shapes=cfg.module_shapes(), max_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adapter"
        path.mkdir()
        _, tensors = random_adapter(cfg, args.rank, seed=1)
        write_adapter_config(path, r=args.rank, lora_alpha=2 * args.rank, target_modules=list(LORA_MODULES))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / WEIGHTS_FILE))
        del tensors
        spec = read_adapter(path, base)
        t0 = time.perf_counter()
        copy_path = write_serving_copy(path, "bfloat16")
        convert_s = time.perf_counter() - t0
        buffers = LoRABuffers(cfg, 1, args.rank, torch.device("cpu"), torch.bfloat16)
        read = buffers.layout.read_mask(projection_ranks(spec))
        hidden = path / ".hidden"  # the copy moved aside: the load reads the F32 file
        threads = min(8, os.cpu_count() or 1)
        times: dict[str, list[float]] = {"f32_file": [], "bf16_copy": []}
        results = {}
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for i in range(args.repeats + 1):  # the first round warms the page cache, untimed
                for name in times:
                    if name == "f32_file":
                        copy_path.rename(hidden)
                    t0 = time.perf_counter()
                    host = read_into_host(path, spec, buffers, pin=False, pool=pool)
                    dt = time.perf_counter() - t0
                    if name == "f32_file":
                        hidden.rename(copy_path)
                    if i:
                        times[name].append(dt)
                    results[name] = host.flat[read].clone()
                    del host
        same = torch.equal(results["f32_file"], results["bf16_copy"])
        row = {name: {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3}
               for name, ts in times.items()}
        doc = {
            "benchmark": "disk load (page cache warm) of an F32 adapter into bf16 slots: F32 file vs staged bf16 copy",
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                        "read_threads": threads, "torch": torch.__version__},
            "shape": args.shape, "rank": args.rank, "repeats": args.repeats,
            "f32_file_bytes": (path / WEIGHTS_FILE).stat().st_size, "bf16_copy_bytes": copy_path.stat().st_size,
            "copy_name": serving_weights_name("bfloat16"),
            "write_copy_ms": convert_s * 1e3, "loads": row, "same_bits": same,
            "speedup": row["f32_file"]["median_ms"] / row["bf16_copy"]["median_ms"],
        }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("loads", "write_copy_ms", "speedup", "same_bits")}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
