"""For a GPU machine (not collected by pytest): why the engine's host-tier CUDA test failed
when it ran after the store's (CUBLAS_STATUS_INTERNAL_ERROR from `cublasCreate`). Each case
runs in a process of its own, since a process makes its cuBLAS handle once. Host memory
registered with CUDA (cudaHostRegister) and freed while still registered breaks the next
handle; `host_buffer` now unregisters it first. Run from the repository root:

    python3 tests/server/cuda_host_register_check.py

Results: bench/results/cuda_host_register_h200.log (notes: bench/results/prefix_h200_notes.md).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# (what the case does, its code after PRELUDE); "freed unregistered": freed, never unregistered
CASES = {
    "pages registered, freed unregistered (old host_buffer), then a matmul": "old(); mm()",
    "pages registered, freed unregistered, then torch.cuda.synchronize and a matmul":
        "old(); torch.cuda.synchronize(); mm()",
    "host_buffer now (unregistered when freed), then a matmul": "new(); mm()",
    "store test, then a matmul": "store(); mm()",
    "store test, then the engine's host-tier test":
        "store(); import server.test_cuda as c; c.test_cuda_host_tier_gives_what_whole_prefills_give(); "
        "print('  engine test ok')",
}
PRELUDE = """
import sys, torch
sys.path.insert(0, '.')
import server.test_prefix_store as t
def store():
    t.test_cuda_saves_on_their_copy_stream_load_back_bit_for_bit()
    f, tot = torch.cuda.mem_get_info()
    print(f'  after store test: {(tot-f)/2**20:.0f} MiB in use, {torch.cuda.memory_reserved()/2**20:.0f} MiB reserved by torch')
def old():
    t = torch.empty(768 << 20, dtype=torch.uint8)
    print('  register', int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)))
    del t
def new():
    from loraplex.server.prefix_store import host_buffer
    t = host_buffer((768 << 20,), torch.uint8, True)
    print('  pinned', t.is_pinned())
    del t
def mm():
    a = torch.randn(64, 64, device='cuda')
    print('  matmul ok', float((a @ a).sum()) == float((a @ a).sum()))
"""


def main() -> int:
    for name, code in CASES.items():
        p = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=TESTS, capture_output=True, text=True,
                           timeout=120)
        out = (p.stdout + p.stderr).strip().splitlines()
        print(f"=== {name}: rc={p.returncode}")
        print("\n".join(out[-6:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
