"""Ways to move an adapter file out of a warm page cache onto the GPU, timed side by side.

    python3 bench/host_read_paths.py --out host_read_paths.json

A load from the disk tier reads the file with ``preadv`` on the loader's read threads into a
pinned host copy, then copies that to the slot (server/host_tier.py). The read alone took
5.8-6.9 ms for 84 MB on the H200's host (cold_load_h200_notes.md), 3.7x-4.4x the
host-to-device floor: ``preadv`` copies out of the page cache at a seventh of memcpy's
speed there. This times, on one file of ``--mb`` MB whose pages are in the page cache, each
path end to end (file bytes to a device buffer, synchronised), median of ``--repeats``:

- ``preadv``: the loader's read (``--chunk-mb`` chunks on ``--threads`` threads) into a
  pinned buffer, then one host-to-device copy;
- ``preadv_pipelined``: the same, each chunk's host-to-device copy queued as soon as its
  read is done (in file order), so the copy engine runs under the reads;
- ``mmap_copy``: the file mapped read-only (``MAP_POPULATE``), chunks copied out of the
  mapping into the pinned buffer (``memmove`` on the read threads), copies queued as chunks
  finish, as above;
- ``mmap_register``: the mapping itself page-locked (``cudaHostRegister`` with
  ``cudaHostRegisterReadOnly``) and copied to the device by DMA, no CPU copy; registration
  and unregistration counted in;
- ``mmap_register_pipelined``: the same chunk by chunk, each chunk's DMA queued as soon as
  it is registered (registered in file order on ``--threads`` threads, 1 included), so
  the copy engine runs under the registrations; its time is to the bytes on the device
  (``to_device``), the unregistrations after it reported apart (``unregister``: a loader
  would leave them to another thread, off the load's path);

and the floors: the pinned buffer's host-to-device copy alone, and a memcpy of the same
bytes between two host buffers on the read threads.

On a machine without CUDA it times the host part of each path (a smoke test).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

CUDA_HOST_REGISTER_READ_ONLY = 0x08


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=84, help="file size in MB (a rank-16 Llama-3-8B adapter: 84)")
    p.add_argument("--threads", default="8,16", help="read threads to try, comma-separated")
    p.add_argument("--chunk-mb", default="2,4", help="chunk sizes in MB to try, comma-separated")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default=None, help="where to write the file (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def median_ms(fn, repeats: int) -> dict:
    fn()  # warm: page tables, thread pool, CUDA context
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3}


def chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]


class Paths:
    def __init__(self, path: Path, nbytes: int, device: torch.device | None):
        self.path, self.nbytes, self.device = path, nbytes, device
        cuda = device is not None
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.host_view = memoryview(self.host.numpy())
        self.host_addr = self.host.data_ptr()
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device) if cuda else None
        self.stream = torch.cuda.Stream(device) if cuda else None

    def _h2d(self, offset: int, n: int, src: torch.Tensor | None = None) -> None:
        if self.dev is None:
            return
        src = self.host if src is None else src
        with torch.cuda.stream(self.stream):
            self.dev[offset: offset + n].copy_(src[offset: offset + n], non_blocking=True)

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def preadv(self, pool, chunk: int, pipelined: bool) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            def read(o, n):
                view = self.host_view[o: o + n]
                while len(view):
                    got = os.preadv(fd, [view], o)
                    if got <= 0:
                        raise OSError("short read")
                    o, view = o + got, view[got:]
            parts = chunks(self.nbytes, chunk)
            futures = [pool.submit(read, o, n) for o, n in parts]
            for (o, n), fut in zip(parts, futures):
                fut.result()
                if pipelined:
                    self._h2d(o, n)
            if not pipelined:
                self._h2d(0, self.nbytes)
            self._sync()
        finally:
            os.close(fd)

    def mmap_copy(self, pool, chunk: int) -> None:
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), self.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ)
        try:
            src = np.frombuffer(mm, dtype=np.uint8)
            base = src.ctypes.data
            parts = chunks(self.nbytes, chunk)
            futures = [pool.submit(ctypes.memmove, self.host_addr + o, base + o, n) for o, n in parts]
            for (o, n), fut in zip(parts, futures):
                fut.result()
                self._h2d(o, n)
            self._sync()
            del src
        finally:
            mm.close()

    def mmap_register(self) -> dict:
        """Returns the stages' times (ms); raises when registration fails."""
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            src = np.frombuffer(mm, dtype=np.uint8)
            addr = src.ctypes.data
            t1 = time.perf_counter()
            err = cudart.cudaHostRegister(addr, self.nbytes, CUDA_HOST_REGISTER_READ_ONLY)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister: {err}")
            t2 = time.perf_counter()
            try:
                mapped = torch.from_numpy(src)  # read-only buffer: never written
                with torch.cuda.stream(self.stream):
                    self.dev.copy_(mapped, non_blocking=True)
                self._sync()
                t3 = time.perf_counter()
                del mapped
            finally:
                cudart.cudaHostUnregister(addr)
            t4 = time.perf_counter()
            del src
        finally:
            mm.close()
        return {"map": (t1 - t0) * 1e3, "register": (t2 - t1) * 1e3, "copy": (t3 - t2) * 1e3,
                "unregister": (t4 - t3) * 1e3}

    def mmap_register_pipelined(self, pool, chunk: int) -> dict:
        """Returns the stages' times (ms); raises when a registration fails."""
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        registered, futures = [], None
        try:
            src = np.frombuffer(mm, dtype=np.uint8)
            addr = src.ctypes.data
            mapped = torch.from_numpy(src)  # read-only buffer: never written

            def register(o, n):
                err = cudart.cudaHostRegister(addr + o, n, CUDA_HOST_REGISTER_READ_ONLY)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister: {err}")
                return o

            parts = chunks(self.nbytes, chunk)
            futures = [pool.submit(register, o, n) for o, n in parts] if pool is not None else None
            for i, (o, n) in enumerate(parts):
                registered.append(futures[i].result() if futures is not None else register(o, n))
                self._h2d(o, n, mapped)
            self._sync()
            t1 = time.perf_counter()
        finally:
            if futures is not None:  # a failure: wait for the rest before unregistering
                for fut in futures:
                    if fut.exception() is None and fut.result() not in registered:
                        registered.append(fut.result())
            for o in registered:
                cudart.cudaHostUnregister(addr + o)
            t2 = time.perf_counter()
            mapped = src = None
            mm.close()
        return {"to_device": (t1 - t0) * 1e3, "unregister": (t2 - t1) * 1e3}

    def check(self, want: np.ndarray) -> bool:
        got = self.dev.cpu().numpy() if self.dev is not None else self.host.numpy()
        return bool(np.array_equal(got, want))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else None
    nbytes = args.mb << 20
    threads = [int(t) for t in args.threads.split(",")]
    chunk_sizes = [int(c) << 20 for c in args.chunk_mb.split(",")]
    out: dict = {"meta": {"mb": args.mb, "bytes": nbytes, "repeats": args.repeats, "cpus": os.cpu_count(),
                          "device": torch.cuda.get_device_name(device) if device else "cpu",
                          "torch": torch.__version__, "python": sys.version.split()[0]}, "results": {}}
    res = out["results"]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "adapter_model.safetensors"
        want = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        path.write_bytes(want.tobytes())
        with open(path, "rb") as f:  # the pages into the page cache
            while f.read(16 << 20):
                pass
        paths = Paths(path, nbytes, device)

        if device is not None:
            res["floor_pinned_h2d"] = median_ms(lambda: (paths._h2d(0, nbytes), paths._sync()), args.repeats)
        other = torch.empty_like(paths.host)
        for t in threads:
            with concurrent.futures.ThreadPoolExecutor(t) as pool:
                def memcpy():
                    futs = [pool.submit(ctypes.memmove, paths.host_addr + o, other.data_ptr() + o, n)
                            for o, n in chunks(nbytes, 4 << 20)]
                    for fut in futs:
                        fut.result()
                res[f"floor_memcpy_t{t}"] = median_ms(memcpy, args.repeats)
                for c in chunk_sizes:
                    tag = f"t{t}_c{c >> 20}"
                    for name, fn in (("preadv", lambda: paths.preadv(pool, c, False)),
                                     ("preadv_pipelined", lambda: paths.preadv(pool, c, True)),
                                     ("mmap_copy", lambda: paths.mmap_copy(pool, c))):
                        paths.dev is not None and paths.dev.zero_()
                        res[f"{name}_{tag}"] = median_ms(fn, args.repeats)
                        res[f"{name}_{tag}"]["correct"] = paths.check(want)
        if device is not None:
            try:
                paths.dev.zero_()
                stages = []
                res["mmap_register"] = median_ms(lambda: stages.append(paths.mmap_register()), args.repeats)
                res["mmap_register"]["correct"] = paths.check(want)
                res["mmap_register"]["stages_median_ms"] = {
                    k: statistics.median(s[k] for s in stages) for k in stages[0]}
            except Exception as e:  # recorded, not fatal: the other paths stand
                res["mmap_register"] = {"error": repr(e)}
            for t in [1, *threads]:
                with concurrent.futures.ThreadPoolExecutor(t) if t > 1 else contextlib.nullcontext() as pool:
                    for c in chunk_sizes:
                        name = f"mmap_register_pipelined_t{t}_c{c >> 20}"
                        try:
                            paths.dev.zero_()
                            stages = []
                            median_ms(lambda: stages.append(paths.mmap_register_pipelined(pool, c)), args.repeats)
                            to_device = [s["to_device"] for s in stages[1:]]  # (the first is the warm-up)
                            res[name] = {"median_ms": statistics.median(to_device), "min_ms": min(to_device),
                                         "max_ms": max(to_device), "correct": paths.check(want),
                                         "unregister_median_ms": statistics.median(s["unregister"] for s in stages)}
                        except Exception as e:  # recorded, not fatal
                            res[name] = {"error": repr(e)}
    floor = res.get("floor_pinned_h2d", {}).get("median_ms")
    for name, r in res.items():
        line = f"{name:28s} " + (f"{r['median_ms']:7.2f} ms" if "median_ms" in r else r.get("error", ""))
        if floor and "median_ms" in r:
            r["x_h2d_floor"] = r["median_ms"] / floor
            line += f"  {r['x_h2d_floor']:5.2f}x the H2D floor"
        if "correct" in r:
            line += "" if r["correct"] else "  WRONG BYTES"
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
