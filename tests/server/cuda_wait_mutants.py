"""Mutation check of the host tier's CUDA ordering, for a GPU machine (not collected by pytest).

The CUDA test of the prefix store passes by luck if the copies it races happen to finish in
time; this runs it as committed, under PyTorch's CUDA sanitizer (which reports kernels of two
streams touching one tensor unordered), and once with each of the three stream waits of
`server/prefix_store.py` taken out, each of which it must fail. The file is restored after
each mutant. Prints one line per run and writes them as JSON to --out.

    python3 tests/server/cuda_wait_mutants.py --out $OUT/mutants.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "server" / "prefix_store.py"
TESTS = ["server/test_prefix_store.py", "server/test_cuda.py"]

# (name, the line's code as committed, what stands in for it)
MUTANTS = [
    ("load waits for no save", "compute.wait_event(f[2])", "pass"),
    ("copy waits for no gather", "self._copier.wait_event(gathered)", "pass"),
    ("gather waits for no copy", "compute.wait_event(self._chunk_done[j])", "pass"),
]


def run_tests(selection: str, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k", selection]
    proc = subprocess.run(cmd, cwd=ROOT / "tests", env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"rc": proc.returncode, "tail": tail}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--select", default="cuda_saves or host_tier",
                        help="pytest -k expression: the store's CUDA test and the engine's host-tier one")
    parser.add_argument("--out", type=Path, help="JSON of every run")
    args = parser.parse_args()
    env = dict(os.environ, TRITON_INTERPRET="0")
    runs = []

    def record(name: str, result: dict, want_pass: bool) -> None:
        ok = (result["rc"] == 0) == want_pass
        runs.append({"run": name, "want": "pass" if want_pass else "fail", "ok": ok, **result})
        print(f"{'ok  ' if ok else 'BAD '} {name}: rc={result['rc']} (want {'pass' if want_pass else 'fail'})")
        print("     " + "\n     ".join(result["tail"][-3:]))

    record("as committed", run_tests(args.select, env), True)
    record("as committed, TORCH_CUDA_SANITIZER=1", run_tests(args.select, dict(env, TORCH_CUDA_SANITIZER="1")), True)
    source = STORE.read_text()
    try:
        for name, code, stand_in in MUTANTS:
            lines = [i for i, line in enumerate(source.splitlines()) if line.strip().startswith(code)]
            if len(lines) != 1:
                raise SystemExit(f"{code!r} is on {len(lines)} lines of {STORE}, not one: update MUTANTS")
            mutated = source.splitlines(keepends=True)
            i = lines[0]
            indent = mutated[i][: len(mutated[i]) - len(mutated[i].lstrip())]
            mutated[i] = f"{indent}{stand_in}  # mutant: {name}\n"
            STORE.write_text("".join(mutated))
            record(f"mutant: {name}", run_tests(args.select, env), False)
    finally:
        STORE.write_text(source)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
