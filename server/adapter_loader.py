"""The load path: an adapter's bytes down the tiers into the GPU slot it was given.

Where it sits in the adapter cache's data flow::

    request -> lookup, refs, pins      adapter_cache.py
            -> slot choice / eviction  slot_table.py     (want hands a row not on disk to `stage`,
                                                          pump hands (row, slot) to `start`)
            -> stage from its source   adapter_loader.py (here, on a staging thread: no slot held)
            -> load through the tiers  adapter_loader.py (here, on a load worker thread)
            -> ready                   slot_table.py     (the cache's `done` callback: finish_load)

Stage first: an adapter not on local disk (`needs_fetch`, the check `host_copy` makes) is
fetched by `stage` on a staging thread (as many as load workers) before it waits for a slot;
its load then reads it from disk. Files no load has read yet are checked there too (their
config, header and shapes: `_check_files`), so files that do not fit fail before a slot is
taken for them (evicting an idle adapter). A load that finds it must fetch after all (its version
replaced on disk meanwhile) does not: it gives its slot back to stage it (`unstaged`).

One load, fastest tier that holds the adapter first::

    host     the row's in-memory copy, or the HostTier's       -> straight to the slot
    disk     a registered PEFT directory, or --adapter-cache-dir/<name>/ (the node agent's cache)
             -> read_into_host (safetensors into pinned memory, chunks on the read threads:
                disk_read.py), each chunk's bytes copied to the slot as they land
             -> kept in the HostTier if it fits
    source   staged before the load (fetch_adapter, through the node agent or here), then as disk
    slot     copy_to_slot: on CUDA a side stream and an event, so the decode loop never waits on PCIe

Every failure becomes one AdapterLoadError (`load_error`), handed to `done`; it fails only
that adapter. One that lies in the adapter's files (FILE_FAILURES: a cut or garbled file,
shapes that do not fit, a config that is not JSON, a file missing) is kept with those files'
stamp (`BrokenFiles`): while the files are the same, `broken` gives that error back and the
cache starts no load of them, which would take a slot (evicting an idle adapter) to fail the
same way. Other failures (out of memory, a fetch) are not kept: the next try may work. The disk
lookups here (`disk_dir`, `staged`) also serve the cache's lazy discovery of adapters the node
agent staged.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterSpec,
    BaseSpec,
    read_adapter,
    serving_weights,
    staged_version,
)
from .adapter_names import is_adapter_name
from .adapter_sources import (AdapterLoadError, Fetched, FetchThreads, fetch_adapter, load_error, redact,
                              sweep_abandoned_fetches)
from .adapters import AdapterId, LoRABuffers
from .disk_read import DiskRead, PlanCache, StalePlan, files_stamp
from .host_tier import HostCopy, HostTier, read_into_host
from .slot_table import CachedAdapter

log = logging.getLogger(__name__)

# done(row, slot, tier, error or None, t0): the load of `row` into `slot` finished; its bytes
# came from `tier` (host, disk, source); it started at clock `t0`.
LoadDone = Callable[[CachedAdapter, int, str, AdapterLoadError | None, float], None]
# staged(row, version, fetched or None, error or None): the staging of `row` (for `version`)
# finished; `fetched` is None when the version was on disk already (nothing fetched).
StageDone = Callable[[CachedAdapter, tuple, Fetched | None, AdapterLoadError | None], None]


# The reasons (AdapterLoadError.reason) of a failure that lies in the files read: the same
# files fail the same way at every load, so none is tried again until they change.
FILE_FAILURES = frozenset({"corrupt", "mismatch", "missing"})

# A failed fetch is not tried again for a while (`fetch_backoff`), as the kubelet backs off an
# image pull: 2 s, doubled after each failure in a row, up to 2 minutes.
FETCH_RETRY_FIRST_S = 2.0
FETCH_RETRY_MAX_S = 120.0


def doubling_backoff(failures: int, first: float, most: float) -> float:
    """Seconds to wait after `failures` failures in a row (at least one): `first`, doubled
    after each, at most `most`. The exponent is capped: 2.0 ** 1024 overflows a float (some
    34 hours of failures at 2 minutes each)."""
    return min(most, first * 2.0 ** min(max(failures, 1) - 1, 64))


class Unstaged(Exception):
    """A load found its adapter not on local disk (host_copy): it is staged before it loads."""


@dataclass
class BrokenFiles:
    """A load of `row` (of `version`: CachedAdapter.version) failed on the files under `path`,
    whose stamp (files_stamp) was `stamp`, with `error` (its reason one of FILE_FAILURES)."""

    row: CachedAdapter
    version: tuple[str, str | None]
    path: Path
    stamp: tuple
    error: AdapterLoadError


@dataclass
class FailedFetch:
    """The fetches of `row` (of `version`: CachedAdapter.version) failed `count` times in a
    row, the last with `error` at clock `at`; none is started again before clock `until`."""

    row: CachedAdapter
    version: tuple[str, str | None]
    error: AdapterLoadError
    count: int
    at: float
    until: float


class AdapterLoader:
    """Load workers (at most `max_concurrent_loads`) and the tier walk each of them runs; read
    threads (`read_threads`, default min(8, CPUs)) that the loads' disk reads share; staging
    threads (`max_concurrent_fetches`, default `max_concurrent_loads`) that fetch adapters not
    on local disk before their loads take a slot."""

    def __init__(self, buffers: LoRABuffers, base: BaseSpec, host: HostTier, *, lock: threading.RLock,
                 done: LoadDone, max_concurrent_loads: int = 4, cache_dir: str | Path | None = None,
                 node_agent_url: str | None = None, namespace: str | None = None, clock: Callable[[], float],
                 read_threads: int | None = None,
                 staged: StageDone | None = None, unstaged: Callable[[CachedAdapter, int], None] | None = None,
                 max_concurrent_fetches: int | None = None, node_agent_token_file: str | Path | None = None):
        self.buffers = buffers
        self.base = base
        self.host = host
        self._lock = lock  # the cache's: guards the rows (a load reads e.path, writes e.spec and e.id)
        self.done = done
        self.staged_done = staged  # the cache's: finish_stage
        self.unstaged = unstaged  # the cache's: unstage (slot back, stage first); None: fetch in the load
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.node_agent_url = node_agent_url.rstrip("/") if node_agent_url else None
        if self.cache_dir is not None and self.node_agent_url is None:
            sweep_abandoned_fetches(self.cache_dir)  # what a crash of this server's fetches left
        self.namespace = namespace  # the server's Kubernetes namespace: the node agent's folder for it
        self.node_agent_token_file = Path(node_agent_token_file) if node_agent_token_file else None
        self.clock = clock
        self.pin_memory = buffers.device.type == "cuda"
        self.dtype_name = str(buffers.dtype).removeprefix("torch.")  # the slots' dtype, as files name it
        self.read_plans = PlanCache()  # the first read of a fleet's next adapter is planned already
        # name -> the files its last load failed on (`broken`); under the cache's lock. A row
        # dropped since (an unload) is a stale entry, let go at the next look.
        self._broken: dict[str, BrokenFiles] = {}
        # name -> its fetches' failures in a row (`fetch_backoff`); under the cache's lock.
        self._failed_fetches: dict[str, FailedFetch] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, max_concurrent_loads),
                                                           thread_name_prefix="loraplex-load")
        # Fetches (seconds each) on their own threads: they hold no slot and no load worker.
        self.max_concurrent_fetches = max(1, max_concurrent_fetches or max_concurrent_loads)
        self._staging = FetchThreads(self.max_concurrent_fetches, "loraplex-stage")
        # The checks of files on disk (`_check_files`, milliseconds each) on a thread of their
        # own: behind a slow fetch, a load from disk would wait for a staging thread. One, so
        # that rows checked wait for their slots in the order they were asked for.
        self._checking = FetchThreads(1, "loraplex-check")
        # One file is read as a few MB-sized chunks at once: a single thread copies from the page
        # cache at well under the host's memory bandwidth.
        self.read_threads = read_threads or min(8, os.cpu_count() or 1)
        self.read_pool = concurrent.futures.ThreadPoolExecutor(self.read_threads, thread_name_prefix="loraplex-read")
        self._local = threading.local()  # a side CUDA stream per load worker
        # Held by a load thread around its CUDA calls, and by the engine while it captures a
        # CUDA graph: a global-mode capture forbids other threads' allocations and syncs.
        self.cuda_lock = threading.Lock()

    def close(self) -> None:
        # First (a staging ends in a load), and without waiting for fetches: a download in
        # flight ends at its next chunk, a node agent's answer is not waited for.
        self._staging.stop()
        self._checking.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.read_pool.shutdown(wait=True)

    # -- the disk tier: where an adapter's files are ------------------------------------------------

    def staged(self, name: str) -> Path | None:
        """<cache_dir>/<name>/ if the node agent (or a fetch) put an adapter there."""
        if self.cache_dir is not None and is_adapter_name(name) and (self.cache_dir / name / CONFIG_FILE).is_file():
            return self.cache_dir / name
        return None

    def staged_names(self) -> list[str]:
        """Names under --adapter-cache-dir that may be adapters, sorted (files not checked)."""
        if self.cache_dir is None or not self.cache_dir.is_dir():
            return []
        return [child.name for child in sorted(self.cache_dir.iterdir()) if is_adapter_name(child.name)]

    def disk_dir(self, e: CachedAdapter) -> Path | None:
        """The PEFT directory `e` loads from: its registered path, else the node agent's copy."""
        if e.path is not None and (e.path / CONFIG_FILE).is_file():
            return e.path
        return self.staged(e.name)

    def files_stamp(self, path: Path) -> tuple:
        """The stamp of the adapter files under `path` as a load reads them (files_stamp: the
        folder, config, weights and the served copy of the weights)."""
        return files_stamp(path, serving_weights(path, self.dtype_name))

    def broken(self, e: CachedAdapter) -> AdapterLoadError | None:
        """The error of `e`'s last load if it failed on its files (FILE_FAILURES) and a load now
        would read those same files: the same row and version, the folder it would load from
        the one that failed (or none on disk: a plan's local source, read in place), the same
        stamp. None once any of that changed (a new version staged or registered, the files
        rewritten, an unload): then a load is tried again. Under the cache's lock: a few stat
        calls, for a row whose files failed only."""
        failed = self._broken.get(e.name)
        if failed is None:
            return None
        where = self.disk_dir(e)
        if (failed.row is not e or failed.version != e.version or e.memory is not None or e.name in self.host
                or (where is not None and where != failed.path) or self.files_stamp(failed.path) != failed.stamp):
            del self._broken[e.name]
            return None
        return failed.error

    def fetch_backoff(self, e: CachedAdapter) -> AdapterLoadError | None:
        """The error of `e`'s last fetch if it failed and its back-off has not run out (2 s,
        doubled after each failure in a row, up to 2 minutes): a request meanwhile fails at once
        with it, instead of starting another download of what has just failed (a CR whose
        sha256 does not match its source would otherwise download the whole file again for
        every request, on as many staging threads). None once the back-off ran out, the row or
        its version changed (a new CR, a new sha256), or a fetch is no longer needed (the node
        agent staged it meanwhile). Under the cache's lock."""
        failed = self._failed_fetches.get(e.name)
        if failed is not None and (failed.row is not e or failed.version != e.version):
            del self._failed_fetches[e.name]  # another row or version: its failures are not this one's
        left = self.fetch_retry_in(e)
        if left is None or not self.needs_fetch(e):
            return None  # kept: the count goes on if the next fetch fails too
        failed = self._failed_fetches[e.name]
        times = "once" if failed.count == 1 else f"{failed.count} times in a row"
        return AdapterLoadError(e.name, failed.error.reason,
                                f"{failed.error.message} (its fetch failed {times}; the next is "
                                f"tried in {left:.1f} s, or at once for a new version)")

    def fetch_retry_in(self, e: CachedAdapter) -> float | None:
        """Seconds until a fetch of `e` is tried again, while its back-off runs (for GET
        /v1/adapters); None when it is not backing off. Under the cache's lock."""
        failed = self._failed_fetches.get(e.name)
        if failed is None or failed.row is not e or failed.version != e.version:
            return None
        left = failed.until - self.clock()
        return left if left > 0 else None

    def _record_fetch(self, e: CachedAdapter, version: tuple, error: AdapterLoadError | None) -> None:
        """Count a fetch of `e` (for `version`) that failed, or forget the failures of one that
        worked. Under the cache's lock."""
        if error is None:
            self._failed_fetches.pop(e.name, None)
            return
        last = self._failed_fetches.get(e.name)
        count = last.count + 1 if last is not None and last.row is e and last.version == version else 1
        now = self.clock()
        delay = doubling_backoff(count, FETCH_RETRY_FIRST_S, FETCH_RETRY_MAX_S)
        self._failed_fetches[e.name] = FailedFetch(e, version, error, count, now, now + delay)

    # -- staging: the source onto local disk, before a slot (staging thread) ------------------------

    def needs_fetch(self, e: CachedAdapter) -> bool:
        """Whether a load of `e` would have to fetch it from its source (host_copy's check):
        not in host memory, and no folder on disk holding its version. Under the cache's lock:
        a few stat calls and the staged folder's small version record."""
        if e.memory is not None or e.name in self.host:
            return False
        path = self.disk_dir(e)
        return path is None or (not e.admin and not _holds(path, e.sha256, e.source))

    def needs_stage(self, e: CachedAdapter) -> bool:
        """Whether `e` goes to a staging thread before it waits for a slot: to be fetched
        (`needs_fetch`), or to have its files checked (`_check_files`) when no load or check of
        these files (their stamp) worked yet. Under the cache's lock: a few stat calls."""
        if self.needs_fetch(e):
            return True
        if e.memory is not None or e.name in self.host:
            return False
        path = self.disk_dir(e)
        return path is not None and (e.disk_read is None or e.disk_read.stamp != self.files_stamp(path))

    def stage(self, e: CachedAdapter) -> None:
        """Bring `e` onto local disk and check its files, on a staging thread (a check alone, of
        one on disk, on a check thread); `staged_done` hears how it went. Under the cache's lock."""
        (self._staging if self.needs_fetch(e) else self._checking).submit(self._stage_run, e)

    def _stage_run(self, e: CachedAdapter) -> None:
        t0 = self.clock()
        with self._lock:
            identity, path = e.version, self.disk_dir(e)
            version, source, admin, missing = e.sha256, e.source, e.admin, e.path
        fetched: Fetched | None = None
        error: AdapterLoadError | None = None
        try:
            # Checked again here, off the lock: a node agent may have staged it meanwhile.
            if path is None or (not admin and not _holds(path, version, source)):
                if path is not None:
                    # The node's cache holds another version under the name (the previous one,
                    # its successor not staged yet): staging the plan's replaces it.
                    log.info("adapter %s: %s holds another version than the plan's; staging it", e.name, path)
                path = self._fetch(e.name, version, source, admin, missing)
                fetched = Fetched(identity, path, self.clock() - t0)
        except AdapterLoadError as err:
            error = err
        except BaseException as err:  # noqa: BLE001 - any failure fails this adapter only
            error = load_error(e.name, err)
        with self._lock:
            self._record_fetch(e, identity, error)
        if error is None:
            assert path is not None
            try:
                self._check_files(e, path, identity)
            except AdapterLoadError as err:
                error = err
        self.staged_done(e, identity, fetched, error)

    def _check_files(self, e: CachedAdapter, path: Path, identity: tuple) -> None:
        """Parse and check `e`'s files under `path` (read_adapter: the config, the weights'
        header, their shapes against the base; no weights read), before a slot is taken for
        them: files that do not fit fail here (kept as `broken`), not in a load that has
        evicted an idle adapter for them. The spec is kept for the load (DiskRead with no read
        plan). Files that change during the check are left to the load to read and judge."""
        t0 = self.clock()
        stamp = self.files_stamp(path)
        try:
            spec = read_adapter(path, self.base)
        except (AdapterError, OSError) as err:
            if self.files_stamp(path) != stamp:
                return
            raise self._failed_on_files(e, identity, path, stamp, err) from err
        if self.files_stamp(path) != stamp:
            return
        with self._lock:
            if e.version == identity:
                e.disk_read = DiskRead(stamp, spec, None, self.clock() - t0)

    def _failed_on_files(self, e: CachedAdapter, identity: tuple, path: Path, stamp: tuple,
                         err: BaseException) -> AdapterLoadError:
        """The error of a read or check of `e`'s files (of stamp `stamp`, unchanged since) that
        failed with `err`; one that lies in the files (FILE_FAILURES) is kept as `broken`."""
        error = load_error(e.name, err)
        if error.reason in FILE_FAILURES and not isinstance(err, StalePlan):
            with self._lock:
                self._broken[e.name] = BrokenFiles(e, identity, path, stamp, error)
        return error

    def _fetch(self, name: str, version: str | None, source: str | None, admin: bool,
               missing: Path | None) -> Path:
        """Fetch adapter `name` (the version of sha256 `version` or of `source`) onto local
        disk: its folder there. `missing`: its registered folder, for the error message."""
        path = fetch_adapter(name, source, version, self.cache_dir, self.node_agent_url,
                             missing=missing, dtype=self.dtype_name, namespace=self.namespace,
                             stop=self._staging.stopping, agent_token_file=self.node_agent_token_file)
        if not admin and not _holds(path, version, source):  # replaced by another staging meanwhile
            raise AdapterLoadError(name, "fetch", f"{path} holds another version than the plan's "
                                   f"(another adapter of that name staged on this node?)")
        return path

    # -- one load (worker thread) -------------------------------------------------------------------

    def start(self, e: CachedAdapter, slot: int) -> None:
        """Load `e` into `slot` on a load worker; `done` hears how it went."""
        self._pool.submit(self._run, e, slot)

    def _run(self, e: CachedAdapter, slot: int) -> None:
        t0 = self.clock()
        tier = "host"
        error: AdapterLoadError | None = None
        writer = SlotWriter(self, slot)
        with self._lock:  # what its staging fetched, for this load (nothing else sets it while loading)
            fetched, e.fetched = e.fetched, None
            # The check of its files before the slot (parsing them), which this load's read skips.
            checked = e.disk_read.seconds if e.disk_read is not None and e.disk_read.plan is None else 0.0
        try:
            copy, tier = self.host_copy(e, writer, fetched)
            self.copy_to_slot(copy, slot, writer)
        except Unstaged:
            writer.close()  # nothing enqueued: the check comes before any read
            self.unstaged(e, slot)
            return
        except AdapterLoadError as err:
            error = err
        except BaseException as err:  # noqa: BLE001 - any failure fails this adapter only
            error = load_error(e.name, err)
        finally:
            writer.close()  # a failed load's transfers land before the slot goes to another
        # Counted as the load's: the fetch of a load from the source, and the check of its
        # files before a first read (their parse, which the read skips); not the wait for a slot.
        if tier == "source" and fetched is not None:
            t0 -= fetched.seconds + checked
        elif tier == "disk":
            t0 -= checked
        self.done(e, slot, tier, error, t0)

    def host_copy(self, e: CachedAdapter, writer: "SlotWriter | None" = None,
                  fetched: Fetched | None = None) -> tuple[HostCopy, str]:
        """The adapter in host memory, reading it if needed; the tier it came from. A disk read
        hands each region of the copy to `writer` as it is read, so the copy into the slot runs
        under the rest of the read. `fetched`: what the row's staging put on disk for this
        load (the tier is then "source"). One that must be fetched first raises Unstaged, for
        the load to give its slot back (a loader made without `unstaged` fetches it here)."""
        if e.memory is not None:
            return e.memory, "host"
        copy = self.host.get(e.name)
        if copy is not None:
            return copy, "host"
        with self._lock:
            path = self.disk_dir(e)
            # A new version registered during the read (CachedAdapter.version): this copy is not it.
            identity, version, source = e.version, e.sha256, e.source
            admin = e.admin  # its folder, given by load_lora_adapter or --lora-modules, is read as it is
            missing = e.path
        tier = "disk"
        if fetched is not None and fetched.version == identity and (fetched.path / CONFIG_FILE).is_file():
            path, tier = fetched.path, "source"  # staged for this load; checked again after the read
        elif path is not None and not admin and not _holds(path, version, source):
            path = None  # another version on disk: the plan's is staged first
        if path is None:
            if self.unstaged is not None:
                raise Unstaged(e.name)
            path, tier = self._fetch(e.name, version, source, admin, missing), "source"
        copy, spec, stamp = self._read_disk(e, path, writer, identity)
        # The same files (the stamp a spec and a read plan are reused under) give the same
        # bytes, and so the same K/V for a prompt: prefixes kept under it outlive the slot.
        copy.content = ("files", stamp)
        if not admin and not _holds(path, version, source):  # replaced again, meanwhile or by the staging
            raise AdapterLoadError(e.name, "fetch", f"{path} holds another version than the plan's "
                                   f"(another adapter of that name staged on this node?)")
        digest = version or _stat_digest(path / WEIGHTS_FILE)
        with self._lock:
            e.spec, e.disk_read = spec, DiskRead(stamp, spec, copy.read_plan)
            e.id = AdapterId(name=e.name, digest=digest, uri=str(path))
            current = e.version == identity
            # Kept under the lock that `register` holds to drop the host copy of a replaced
            # version: a new version registered between the check and the add would otherwise
            # find no copy to drop, and the old one would go in after it.
            kept = current and self.host.add(e.name, copy)
        if not current:
            # The slot gets this copy (a new version takes effect at the next load), but the host
            # tier must not keep it: the next load would serve the old version from there.
            log.info("adapter %s: a new version was registered during its load; its host copy is not kept", e.name)
        elif not kept:
            log.debug("adapter %s: no room in the host tier", e.name)
        return copy, tier

    # A disk read whose files changed under it is read again, this many times at most; then the
    # load fails (its requests get the reason) rather than pair one version's spec with another's
    # weights.
    DISK_READ_ATTEMPTS = 5

    def _read_disk(self, e: CachedAdapter, path: Path, writer: "SlotWriter | None", identity: tuple
                   ) -> tuple[HostCopy, AdapterSpec, tuple]:
        """Read `e`'s files (of version `identity`) under `path` into a new host copy; (copy,
        spec, the files' stamp). A read that fails on the files (FILE_FAILURES) while they stay
        as they were is kept with their stamp (`broken`), and a read that works forgets it.

        A reload (its host copy dropped) of the same files reuses the spec and the read plan of
        the last read: parsing, checking and planning again cost 4-8 ms for Llama-3-8B
        (bench/results/disk_read_cpu_notes.md). The
        config and the weights are read at different moments, so a new version renamed in
        meanwhile (the node agent staging a rollout) could pair one version's spec with
        another's weights, or fail on their mismatch: when the files' stamp changed during a
        read, it is read again from the start, DISK_READ_ATTEMPTS times at most."""
        on_region = writer.weights if writer is not None else None

        def files_now() -> tuple:
            return self.files_stamp(path)

        for _ in range(self.DISK_READ_ATTEMPTS):
            stamp = files_now()
            with self._lock:
                last = e.disk_read if e.disk_read is not None and e.disk_read.stamp == stamp else None
            try:
                if last is not None:  # (its plan None: checked before the load, not read yet)
                    spec = last.spec
                    copy = read_into_host(path, spec, self.buffers, self.pin_memory, self.cuda_lock,
                                          self.read_pool, on_region=on_region, plan=last.plan,
                                          plans=self.read_plans)
                else:
                    spec = read_adapter(path, self.base)
                    copy = read_into_host(path, spec, self.buffers, self.pin_memory, self.cuda_lock,
                                          self.read_pool, on_region=on_region, plans=self.read_plans)
            except (AdapterError, RuntimeError, OSError) as err:  # StalePlan among them
                if files_now() != stamp:
                    log.info("adapter %s: its files changed during a read that failed; reading them again", e.name)
                    continue
                # The files are as they were: the error is theirs, or the host's (out of memory).
                raise self._failed_on_files(e, identity, path, stamp, err) from err
            if files_now() == stamp:
                with self._lock:
                    self._broken.pop(e.name, None)
                return copy, spec, stamp
            log.info("adapter %s: its files changed during the read; reading them again", e.name)
        raise AdapterError(f"its files changed during each of {self.DISK_READ_ATTEMPTS} reads (a new version "
                           f"being staged?); a later request loads the version in place then")

    def copy_to_slot(self, copy: HostCopy, slot: int, writer: "SlotWriter | None" = None) -> None:
        """Host -> slot: the weights `writer` has not copied yet (all of them without one), the
        scales and ranks, then wait for the transfers. On CUDA they run on this worker's side
        stream and it waits on an event, so the decode loop never waits on PCIe; the slot is
        not in any batch until the load is marked ready."""
        with SlotWriter(self, slot) if writer is None else contextlib.nullcontext(writer) as w:
            for lo, hi in w.missing(copy.nbytes):
                w.weights(copy, lo, hi)
            w.meta(copy)
            w.close()

    def side_stream(self) -> torch.cuda.Stream:
        """This load worker's side stream (CUDA)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.buffers.device)
        return stream


class SlotWriter:
    """One load's copy into its slot, range by range: `weights` enqueues byte ranges of the host
    copy (a disk read's, as they are written, in any order; or all at once), `meta` the scales
    and ranks, `close` waits for every transfer it enqueued. On CUDA each enqueue holds the
    loader's cuda_lock briefly (a graph capture waits at most that long), and so does the wait
    (~the last transfer); on the CPU the copies run as they are enqueued."""

    def __init__(self, loader: AdapterLoader, slot: int):
        self.loader, self.slot = loader, slot
        self.cuda = loader.buffers.device.type == "cuda"
        self._ranges: list[tuple[int, int]] = []  # of the flat buffer, enqueued so far
        self._pending = False  # transfers enqueued and not yet waited for

    def weights(self, copy: HostCopy, start: int, end: int) -> None:
        if end > start:
            self._enqueue(lambda: copy.copy_weights(self.loader.buffers, self.slot, start, end))
            self._ranges.append((start, end))

    def missing(self, nbytes: int) -> list[tuple[int, int]]:
        """The ranges of [0, nbytes) not enqueued yet."""
        gaps, pos = [], 0
        for lo, hi in sorted(self._ranges):
            if lo > pos:
                gaps.append((pos, lo))
            pos = max(pos, hi)
        return gaps + [(pos, nbytes)] if pos < nbytes else gaps

    def meta(self, copy: HostCopy) -> None:
        self._enqueue(lambda: copy.copy_meta(self.loader.buffers, self.slot))

    def _enqueue(self, copy) -> None:
        if not self.cuda:
            copy()
            return
        with self.loader.cuda_lock, torch.cuda.stream(self.loader.side_stream()):
            copy()
            self._pending = True

    def close(self) -> None:
        """Wait for what was enqueued (a no-op once waited)."""
        if not self._pending:
            return
        with self.loader.cuda_lock:
            done = torch.cuda.Event()
            done.record(self.loader.side_stream())
            done.synchronize()
        self._pending = False

    def __enter__(self) -> "SlotWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _holds(path: Path, sha256: str | None, source: str | None) -> bool:
    """Whether the staged folder `path` is the version the plan names, as far as its record
    says: the same sha256, or without one the same source (query strings aside), as the node
    agent tells versions apart. A folder with no record is taken as it is."""
    staged_sha, staged_source = staged_version(path)
    if sha256 is not None:
        return staged_sha in (None, sha256)
    if source is not None and staged_source is not None:
        return redact(staged_source) == redact(source)
    return True


def _stat_digest(path: Path) -> str:
    """A cheap version stamp when no sha256 is known: hashing 80 MB would cost more than the copy."""
    st = path.stat()
    return f"stat:{st.st_size}-{st.st_mtime_ns}"
