"""What the timer's L2 flush itself costs the call it times.

    python3 bench/l2_flush_bench.py --out l2_flush.json

kernels_bench.py clears L2 before each timed replay by writing 512 MB (``flush.zero_()``),
as the issue's peer measurements did. That leaves L2 full of dirty lines of the flush
buffer, and every line the timed call then brings in evicts one of them: the call pays for
writing back up to an L2's worth of bytes it never touched. This times the same calls
after three flushes, in one run:

- ``write``: 512 MB written (kernels_bench.py's timer);
- ``read``: 512 MB read (``flush.sum()``): L2 as cold, but its lines clean;
- ``write_read``: 512 MB written, then 128 MB of another buffer read: the write-backs
  happen before the timed call;
- ``none``: no flush (the call's inputs may still be in L2 from the replay before).

Cases: a trivial launch (one 4 KB tile), reading 32 MB (``x.sum``), ``add_lora`` and the base
GEMM on q/k/v and o at decode (64 tokens, 16 rank-16 adapters) and prefill (4096 tokens,
8 adapters), each checked against the float32 reference once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from checkout import use_checkout  # bench/ is sys.path[0]

use_checkout()

from kernels_bench import (FLUSH_BYTES, GraphTimer, _touch_kernel, copy_bandwidth, fewest_bytes,  # noqa: E402
                           loop_per_adapter, make_case, rel_error, timing_meta)
from loraplex.kernels import LoRABatch, add_lora  # noqa: E402

MODES = ("write", "read", "write_read", "none")
CASES = (  # (layer, tokens, adapters, prefill sequences)
    ("qkv", 64, 16, None),
    ("o", 64, 16, None),
    ("qkv", 4096, 8, 8),
    ("o", 4096, 8, 8),
)


class FlushTimer(GraphTimer):
    """kernels_bench.GraphTimer with the flush before each replay chosen by `mode`."""

    def __init__(self, reps: int):
        super().__init__(reps)
        self.clean = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        self.mode = "write"

    def clear_l2(self) -> None:
        if self.mode in ("write", "write_read"):
            self.flush.zero_()
        if self.mode == "read":
            self.flush.view(torch.float32).sum()
        if self.mode == "write_read":
            self.clean.view(torch.float32).sum()

    def __call__(self, fn, mode: str) -> float:
        self.mode = mode
        return super().__call__(fn)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    timer = FlushTimer(args.reps)
    bandwidth = copy_bandwidth()
    rows = []

    def time_all(name, fn, nbytes=None, **extra):
        row = {"case": name, "us": {m: timer(fn, m) for m in MODES}, **extra}
        if nbytes:
            row["bytes"] = nbytes
            row["bandwidth_fraction"] = {m: nbytes / (us * 1e-6) / bandwidth for m, us in row["us"].items()}
        rows.append(row)
        print(name, " ".join(f"{m} {us:.1f}" for m, us in row["us"].items()), flush=True)

    tile = torch.zeros(1024, dtype=torch.float32, device="cuda")
    time_all("one_launch", lambda: _touch_kernel[(1,)](tile, tile.numel(), BLOCK=1024))
    x32 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    sums = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
    time_all("read_32mb", lambda: torch.sum(x32, dim=1, out=sums), nbytes=x32.numel() * 2)
    copy_out = torch.empty_like(x32)
    time_all("copy_32mb", lambda: copy_out.copy_(x32), nbytes=2 * x32.numel() * 2)

    for layer, tokens, adapters, seqs in CASES:
        c = make_case(layer, tokens, adapters, 16, seqs=seqs, gen=gen)
        x, y0, a, b, scaling, slots, slices = (c["x"], c["y"], c["lora_a"], c["lora_b"], c["scaling"],
                                               c["token_slots"], c["slices"])
        batch = LoRABatch.build(slots, c["num_slots"], max_adapters=adapters)
        groups = [(s, torch.nonzero(slots == s).flatten()) for s in range(c["num_slots"])]
        groups = [(s, rows) for s, rows in groups if rows.numel()]
        expected = y0.float()
        loop_per_adapter(expected, x.float(), a.float(), b.float(), scaling, groups, slices, 16)
        y = y0.clone()
        add_lora(y, x, a, b, scaling, batch, output_slices=slices)
        err = rel_error(y, y0, expected)
        if not err < 2e-2:
            raise SystemExit(f"{layer} {tokens} tokens: relative error {err} against the float32 reference")
        name = f"{layer}_{'prefill' if seqs else 'decode'}_{tokens}x{adapters}"
        time_all(f"{name}_add_lora", lambda: add_lora(y, x, a, b, scaling, batch, output_slices=slices),
                 nbytes=fewest_bytes(c), error=err)
        out = torch.empty_like(y0)
        time_all(f"{name}_base_gemm", lambda: torch.matmul(x, c["weight"].T, out=out),
                 nbytes=(x.numel() + c["weight"].numel() + out.numel()) * 2)

    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bandwidth, flush_bytes=FLUSH_BYTES,
                       modes=list(MODES))
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
