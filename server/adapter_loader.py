"""The load path: an adapter's bytes down the tiers into the GPU slot it was given.

Where it sits in the adapter cache's data flow::

    request -> lookup, refs, pins      adapter_cache.py
            -> slot choice / eviction  slot_table.py     (pump hands (row, slot) to `start`)
            -> load through the tiers  adapter_loader.py (here, on a load worker thread)
            -> ready                   slot_table.py     (the cache's `done` callback: finish_load)

One load, fastest tier that holds the adapter first::

    host     the row's in-memory copy, or the HostTier's       -> straight to the slot
    disk     a registered PEFT directory, or --adapter-cache-dir/<name>/ (the node agent's cache)
             -> read_into_host (safetensors into pinned memory, chunks on the read threads)
             -> kept in the HostTier if it fits
    source   fetch_adapter (through the node agent, or here) onto disk, then as disk
    slot     copy_to_slot: on CUDA a side stream and an event, so the decode loop never waits on PCIe

Every failure becomes one AdapterLoadError (`load_error`), handed to `done`; it fails only
that adapter. The disk lookups here (`disk_dir`, `staged`) also serve the cache's lazy
discovery of adapters the node agent staged.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from .adapter_format import CONFIG_FILE, WEIGHTS_FILE, BaseSpec, read_adapter
from .adapter_sources import AdapterLoadError, fetch_adapter, load_error
from .adapters import AdapterId, LoRABuffers
from .host_tier import HostCopy, HostTier, read_into_host
from .slot_table import CachedAdapter

log = logging.getLogger(__name__)

# An adapter name as it may appear in a path under --adapter-cache-dir: no separators, no "..".
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,252}$")

# done(row, slot, tier, error or None, t0): the load of `row` into `slot` finished; its bytes
# came from `tier` (host, disk, source); it started at clock `t0`.
LoadDone = Callable[[CachedAdapter, int, str, AdapterLoadError | None, float], None]


class AdapterLoader:
    """Load workers (at most `max_concurrent_loads`) and the tier walk each of them runs; read
    threads (`read_threads`, default min(8, CPUs)) that the loads' disk reads share."""

    def __init__(self, buffers: LoRABuffers, base: BaseSpec, host: HostTier, *, lock: threading.RLock,
                 done: LoadDone, max_concurrent_loads: int = 4, cache_dir: str | Path | None = None,
                 node_agent_url: str | None = None, clock: Callable[[], float], read_threads: int | None = None):
        self.buffers = buffers
        self.base = base
        self.host = host
        self._lock = lock  # the cache's: guards the rows (a load reads e.path, writes e.spec and e.id)
        self.done = done
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.node_agent_url = node_agent_url.rstrip("/") if node_agent_url else None
        self.clock = clock
        self.pin_memory = buffers.device.type == "cuda"
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, max_concurrent_loads),
                                                           thread_name_prefix="loraplex-load")
        # One file is read as a few MB-sized chunks at once: a single thread copies from the page
        # cache at well under the host's memory bandwidth.
        self.read_threads = read_threads or min(8, os.cpu_count() or 1)
        self.read_pool = concurrent.futures.ThreadPoolExecutor(self.read_threads, thread_name_prefix="loraplex-read")
        self._local = threading.local()  # a side CUDA stream per load worker
        # Held by a load thread around its CUDA calls, and by the engine while it captures a
        # CUDA graph: a global-mode capture forbids other threads' allocations and syncs.
        self.cuda_lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.read_pool.shutdown(wait=True)

    # -- the disk tier: where an adapter's files are ------------------------------------------------

    def staged(self, name: str) -> Path | None:
        """<cache_dir>/<name>/ if the node agent (or a fetch) put an adapter there."""
        if self.cache_dir is not None and _NAME.match(name) and (self.cache_dir / name / CONFIG_FILE).is_file():
            return self.cache_dir / name
        return None

    def staged_names(self) -> list[str]:
        """Names under --adapter-cache-dir that may be adapters, sorted (files not checked)."""
        if self.cache_dir is None or not self.cache_dir.is_dir():
            return []
        return [child.name for child in sorted(self.cache_dir.iterdir()) if _NAME.match(child.name)]

    def disk_dir(self, e: CachedAdapter) -> Path | None:
        """The PEFT directory `e` loads from: its registered path, else the node agent's copy."""
        if e.path is not None and (e.path / CONFIG_FILE).is_file():
            return e.path
        return self.staged(e.name)

    # -- one load (worker thread) -------------------------------------------------------------------

    def start(self, e: CachedAdapter, slot: int) -> None:
        """Load `e` into `slot` on a load worker; `done` hears how it went."""
        self._pool.submit(self._run, e, slot)

    def _run(self, e: CachedAdapter, slot: int) -> None:
        t0 = self.clock()
        tier = "host"
        error: AdapterLoadError | None = None
        try:
            copy, tier = self.host_copy(e)
            self.copy_to_slot(copy, slot)
        except AdapterLoadError as err:
            error = err
        except BaseException as err:  # noqa: BLE001 - any failure fails this adapter only
            error = load_error(e.name, err)
        self.done(e, slot, tier, error, t0)

    def host_copy(self, e: CachedAdapter) -> tuple[HostCopy, str]:
        """The adapter in host memory, reading (and fetching) it if needed; the tier it came from."""
        if e.memory is not None:
            return e.memory, "host"
        copy = self.host.get(e.name)
        if copy is not None:
            return copy, "host"
        with self._lock:
            path = self.disk_dir(e)
        tier = "disk"
        if path is None:
            path, tier = fetch_adapter(e.name, e.source, e.sha256, self.cache_dir, self.node_agent_url,
                                       missing=e.path, dtype=str(self.buffers.dtype).removeprefix("torch.")), "source"
        spec = read_adapter(path, self.base)
        digest = e.sha256 or _stat_digest(path / WEIGHTS_FILE)
        copy = read_into_host(path, spec, self.buffers, self.pin_memory, self.cuda_lock, self.read_pool)
        with self._lock:
            e.spec = spec
            e.id = AdapterId(name=e.name, digest=digest, uri=str(path))
        if not self.host.add(e.name, copy):
            log.debug("adapter %s: no room in the host tier", e.name)
        return copy, tier

    def copy_to_slot(self, copy: HostCopy, slot: int) -> None:
        """Host -> slot. On CUDA: a side stream and an event this worker waits on, so the decode
        loop never waits on PCIe; the slot is not in any batch until the load is marked ready."""
        if self.buffers.device.type != "cuda":
            copy.copy_to(self.buffers, slot)
            return
        with self.cuda_lock:  # ~bytes / PCIe bandwidth: a graph capture waits at most that long
            stream = getattr(self._local, "stream", None)
            if stream is None:
                stream = self._local.stream = torch.cuda.Stream(self.buffers.device)
            with torch.cuda.stream(stream):
                copy.copy_to(self.buffers, slot)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()


def _stat_digest(path: Path) -> str:
    """A cheap version stamp when no sha256 is known: hashing 80 MB would cost more than the copy."""
    st = path.stat()
    return f"stat:{st.st_size}-{st.st_mtime_ns}"
