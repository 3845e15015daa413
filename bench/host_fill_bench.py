"""Where a host copy's `fill` spends its time: zeroing, or walking the layout.

    python3 bench/host_fill_bench.py --out fill.json

`HostCopy.fill` (server/host_tier.py) writes zeros wherever an adapter's tensors do not
land: rows of A and columns of B past a module's rank, the projections it does not target,
the alignment gaps. For adapters on q/v alone (PEFT's default for Llama) and on all seven
projections, Llama-3-8B shape, rank 16, bf16, pinned when CUDA is there, this times `fill`
(median of `--repeats`) with the zeroing done three ways: numpy on the calling thread (the
server's), torch's `zero_` (which opens a parallel region per call), and not at all (the
walk alone, a lower bound; not a correct copy). It also times one `zero_` of a buffer of
the zeroed bytes, for the bandwidth of host writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from loraplex.server import host_tier  # noqa: E402
from loraplex.server.adapters import LoRABuffers, random_adapter, slot_groups  # noqa: E402
from loraplex.server.config import named_shape  # noqa: E402
from loraplex.server.host_tier import HostCopy  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ZEROS = {"numpy": host_tier.zero, "torch_zero_": lambda view: view.zero_(), "none": lambda view: None}


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--repeats", type=int, default=31)
    args = p.parse_args(argv)
    cfg = named_shape(args.shape)
    pin = torch.cuda.is_available()
    results = {"shape": args.shape, "pinned": pin, "torch_threads": torch.get_num_threads(), "cases": []}
    for targets in (("q_proj", "v_proj"), ALL):
        spec, _ = random_adapter(cfg, 16, targets=targets, dtype=torch.bfloat16)
        buffers = LoRABuffers(cfg, 1, 16, torch.device("cpu"), torch.bfloat16, groups=slot_groups(targets))
        copy = HostCopy(buffers, pin)
        zeroed = []
        host_tier.zero = lambda view: zeroed.append(view.numel())
        copy.fill(spec, lambda key, dst: None)
        row = {"targets": ",".join(targets), "slot_bytes": buffers.bytes_per_slot,
               "zeroed_bytes": 2 * sum(zeroed), "zero_calls": len(zeroed), "fill_ms": {}}
        for name, fn in ZEROS.items():
            host_tier.zero = fn
            row["fill_ms"][name] = median_ms(lambda: copy.fill(spec, lambda key, dst: None), args.repeats)
        flat = torch.empty(max(1, sum(zeroed)), dtype=torch.bfloat16, pin_memory=pin)
        row["one_zero_of_those_bytes_ms"] = median_ms(flat.zero_, args.repeats)
        host_tier.zero = ZEROS["numpy"]
        results["cases"].append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
