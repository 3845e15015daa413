"""The node's local disk cache of PEFT adapter directories.

Layout under the cache directory (the host path the server pods mount read-only):

    <root>/sql-v2 -> .store/3f9a…-5c1e      a symlink per adapter name: the stable path
    <root>/.store/3f9a…-5c1e/               one verified version of one adapter
        adapter_config.json
        adapter_model.safetensors
        adapter_model.bfloat16.safetensors  the F32 tensors in a server's dtype (node_agent.convert),
                                            when a stage request names one
        .loraplex.json                      {"name", "sha256", "source" (its secrets left out),
                                            "sourceSha256" (of the whole source)}: read back at start
    <root>/.tmp/…                           downloads in progress (removed at start)
    <root>/.plan-adapters….json             the warmer's record of each plan's adapters (its
                                            temporary `….json.tmp` removed at start)
    <root>/.namespaces/ml/                  a Kubernetes namespace's adapters, laid out as <root>
        sql-v2 -> .store/…                  is: the operator mounts this folder alone into the
        .store/…                            namespace's serving pods, so two namespaces' adapters
                                            of one name are two adapters, and no pod reads
                                            another namespace's weights

An adapter's identity in the store is its (namespace, name): namespace None for an
adapter asked for without one (a server outside Kubernetes), kept at the top.

Staging an adapter: stream both files into a fresh directory under .tmp (same filesystem),
hashing the weights on the way; check the sha256 (digest of adapter_model.safetensors) and
that the files are whole; fsync the files and the directory; rename it into .store; then
point the name's symlink at it by renaming a new symlink over the old one. Each step is
atomic, so a crash leaves either the old version or the new one behind the name, never a
part. A new version of a name replaces the old one the same way. A request that names a
serving dtype (the plan's, or the server's own) also gets the weights' F32 tensors written
in that dtype beside the original, once, under a temporary name renamed into place; a staged
version that lacks it gets it at the next such request. The copy takes only free budget: it
never evicts an adapter, and without room the adapter is staged without it (its size is
known from the header, so a copy without room is never written).

Budget: staged bytes plus bytes reserved by downloads in flight stay within `budget_bytes`.
To make room the store evicts least recently used adapters, unpinned first, pinned last
and only for another pinned adapter; if even that cannot make room, the staging fails with
`BudgetExceeded` and nothing is evicted. A download whose size the source does not give up
front (no Content-Length) reserves its bytes as they arrive, evicting as it grows, and fails
with `BudgetExceeded` the moment it outgrows what can be made room for (what it evicted on
the way stays evicted; room held by a download that started before it is waited for).
Staged bytes over the budget at start (a smaller budget than the last run's) are evicted,
least recently used first.

At most `max_concurrent_downloads` downloads run at once; concurrent requests for the same
adapter version share one download. Downloads of different versions of one name that
overlap end as they were asked for: one that ends after a version asked for later was
staged is dropped (`Superseded`), never put back over it. A download whose source sends
fewer than `stall_bytes` in `stall_seconds` of waiting on it fails as `Stalled` (sources.Stall),
so that a source that trickles does not hold a download slot for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loraplex.node_agent.adapter_files import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    InvalidAdapter,
    check_adapter_dir,
)
from loraplex.node_agent.convert import serving_copy_size, write_serving_copy
from loraplex.node_agent.metrics import Metrics
from loraplex.node_agent.sources import Fetch, SourceError, Stall, open_source, redact, source_digest
from loraplex.server.adapter_format import (SERVING_DTYPES, STAGED_META_FILE, fsync_dir, read_safetensors_header,
                                            serving_weights_name)
from loraplex.server.adapter_names import InvalidAdapterName, check_adapter_name, is_namespace

log = logging.getLogger(__name__)

META_FILE = STAGED_META_FILE  # what a server reads to know the version behind a name
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# HTTP status the API answers for each failure reason.
REASON_STATUS = {
    "InvalidRequest": 400,
    "Unsupported": 400,
    "NotFound": 404,
    "UnknownAdapter": 404,
    "DigestMismatch": 422,
    "InvalidAdapter": 422,
    "Truncated": 502,
    "HTTPError": 502,
    "Unreachable": 502,
    "Stalled": 502,  # the source sent less than the least rate (sources.Stall)
    "BudgetExceeded": 507,
    "DiskFull": 507,  # the disk itself, under the budget (ENOSPC, EDQUOT)
    "DiskError": 500,
    "Removed": 409,  # removed (it left the plan) while it downloaded
    "Superseded": 409,  # another version of the name, asked for later, was staged first
    "NotThePlansVersion": 409,  # a client asked for another version of a plan adapter
}


class StoreError(Exception):
    """A staging that failed. `reason`: one word (metrics label, API error); message: why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def status(self) -> int:
        return REASON_STATUS.get(self.reason, 500)


# Where a namespace's adapters live under the cache (a dot name: never an adapter's).
NAMESPACES_DIR = ".namespaces"
# The warmer's plan records (`.plan-adapters[.<namespace>.<name>].json`) as written before
# their rename into place (warmer.Warmer._record).
PLAN_RECORD_TMP = ".plan-adapters*.json.tmp"

Key = tuple  # (namespace or None, name)


def namespace_dir(root: Path, namespace: str | None) -> Path:
    """The folder that holds `namespace`'s adapters (`<root>` itself for None)."""
    return Path(root) if namespace is None else Path(root) / NAMESPACES_DIR / namespace


@dataclass(frozen=True)
class AdapterRef:
    """An adapter's identity as the plan or a client gives it: name (in a Kubernetes
    namespace, or None), source URI, digest; and the dtype its servers hold adapters in (a
    copy of its F32 tensors in it is staged too).

    The digest is optional, as in the LoRAAdapter CRD: with one, a download is checked against
    it and a different digest is a new version; without, the source is staged as found (its
    digest computed on the way and shown), and a new version needs a new source or a digest."""

    name: str
    source: str
    sha256: str | None
    dtype: str | None = None
    namespace: str | None = None

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    def validate(self) -> None:
        try:  # the server's rule: every name it can ask for (Kubernetes object names among them)
            check_adapter_name(self.name)
        except InvalidAdapterName as e:
            raise StoreError("InvalidRequest", str(e)) from None
        if self.namespace is not None and not is_namespace(self.namespace):
            raise StoreError("InvalidRequest", f"namespace {self.namespace!r} is not a Kubernetes namespace name "
                             "(a DNS-1123 label: 1-63 lowercase letters, digits and '-')")
        if self.sha256 is not None and (not isinstance(self.sha256, str) or not _SHA256.match(self.sha256)):
            raise StoreError("InvalidRequest", f"sha256 {self.sha256!r} is not 64 lowercase hex digits")
        if not isinstance(self.source, str) or not self.source:
            raise StoreError("InvalidRequest", "source must be a non-empty string")
        if self.dtype is not None and (not isinstance(self.dtype, str) or self.dtype not in SERVING_DTYPES):
            raise StoreError("InvalidRequest", f"dtype {self.dtype!r} is not one of {sorted(SERVING_DTYPES)}")


def is_version(staged: "_Entry | StagedAdapter", ref: AdapterRef) -> bool:
    """`staged` (on disk) is the version `ref` asks for: the same digest, or, where `ref` gives
    none, the same source (compared by digest: the cache keeps no source's secrets)."""
    if ref.sha256 is not None:
        return staged.sha256 == ref.sha256
    return staged.source_digest == source_digest(ref.source)


@dataclass
class _Entry:
    namespace: str | None
    name: str
    sha256: str
    source: str
    blob: str  # directory name under .store
    nbytes: int
    last_used: float
    source_digest: str  # of the whole source (`source` may be redacted: read back from disk)
    asked: int = 0  # the order of the request whose download staged it (0: found at start)

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)


@dataclass(frozen=True)
class StagedAdapter:
    """What GET /v1/adapters shows for one adapter."""

    name: str
    sha256: str
    source: str
    path: str  # <root>/[.namespaces/<namespace>/]<name>: what a server on this node loads
    bytes: int
    pinned: bool
    last_used: float  # seconds since the epoch (the store's clock)
    source_digest: str = ""  # of the whole source: what tells digest-less versions apart
    namespace: str | None = None

    def as_json(self) -> dict:
        return {"name": self.name, "namespace": self.namespace, "sha256": self.sha256, "source": redact(self.source),
                "path": self.path, "bytes": self.bytes, "pinned": self.pinned, "lastUsed": self.last_used}


class AdapterStore:
    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        max_concurrent_downloads: int = 4,
        *,
        session: aiohttp.ClientSession | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        stall_seconds: float = Stall.seconds,
        stall_bytes: int = Stall.min_bytes,
    ) -> None:
        if budget_bytes <= 0 or max_concurrent_downloads <= 0:
            raise ValueError("budget_bytes and max_concurrent_downloads must be positive")
        if not 0 < stall_seconds < float("inf") or stall_bytes < 0:
            raise ValueError("stall_seconds must be positive and finite, stall_bytes not negative")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.max_concurrent_downloads = max_concurrent_downloads
        # A download that brings fewer than stall_bytes in stall_seconds of waiting on its source
        # fails as Stalled (retried): a source that trickles would hold a download slot for ever.
        self.stall_seconds = stall_seconds
        self.stall_bytes = stall_bytes
        self._session = session
        self.metrics = metrics or Metrics()
        # Every reason's failure series from the start, at 0: one born at 1 is missed by
        # increase() and rate(), so an alert on the first failed staging would never fire.
        for reason in REASON_STATUS:
            self.metrics.failures.labels(reason)
        self._clock = clock
        # Called with the (namespace, name) of each adapter evicted to make room (the warmer reports it).
        self.on_evict: Callable[[Key], None] | None = None
        self._tmp_dir = self.root / ".tmp"  # one for every namespace: renamed from there within one filesystem
        self._entries: dict[Key, _Entry] = {}
        self._pinned: frozenset[Key] = frozenset()  # every plan's pins
        self._pins: dict[object, frozenset[Key]] = {}  # each plan's (by its owner's key)
        self._reserved = 0  # bytes promised to downloads in flight
        self._holding: dict[int, int] = {}  # download (in start order) -> bytes it reserved
        self._started = itertools.count()
        self._asked = itertools.count(1)  # downloads in the order they were asked for
        self._released = asyncio.Event()  # set (and replaced) when a download gives bytes back
        self._semaphore = asyncio.Semaphore(max_concurrent_downloads)
        self._inflight: dict[tuple[Key, str, int], asyncio.Future] = {}
        self._generation: dict[Key, int] = {}  # removals so far (a download started before one is void)
        self._copying: dict[tuple[str, str], asyncio.Future] = {}  # (version, dtype) -> the copy's writer
        self.downloads_started = 0
        self.metrics.budget_bytes.set(budget_bytes)
        self._open()

    # -- state --------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def get(self, name: str, namespace: str | None = None) -> StagedAdapter | None:
        e = self._entries.get((namespace, name))
        return None if e is None else self._info(e)

    def list(self) -> list[StagedAdapter]:
        return [self._info(e) for e in sorted(self._entries.values(), key=lambda e: (e.namespace or "", e.name))]

    def set_pinned(self, names: set[str] | frozenset[str], namespace: str | None = None,
                   owner: object = None) -> None:
        """A plan's pinned set, adapters of `namespace`: evicted last, and only to make room for
        another pinned one. Each plan sets its own (`owner`, by default the namespace); the
        other plans' pins stay; an empty set releases the plan's pins."""
        key = namespace if owner is None else owner
        if names:
            self._pins[key] = frozenset((namespace, n) for n in names)
        else:
            self._pins.pop(key, None)
        self._pinned = frozenset().union(*self._pins.values())
        self._update_gauges()

    def touch(self, name: str, namespace: str | None = None) -> None:
        """A server (or a session) used `name`: it moves to the back of the eviction order."""
        e = self._entries.get((namespace, name))
        if e is not None:
            e.last_used = self._clock()
            with contextlib.suppress(OSError):
                os.utime(self._blob_dir(e), (e.last_used, e.last_used))

    # -- staging ------------------------------------------------------------------------------

    async def stage(self, ref: AdapterRef) -> StagedAdapter:
        """Make `ref` present and verified on local disk; return it. Raises StoreError."""
        ref.validate()
        generation = self._generation.get(ref.key, 0)
        e = self._entries.get(ref.key)
        if e is not None and is_version(e, ref):
            self.touch(ref.name, ref.namespace)
            return await self._with_copy(e, ref, generation)
        key = (ref.key, ref.sha256 or ref.source, generation)
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._download(ref, generation, next(self._asked)))
            self._inflight[key] = fut
            fut.add_done_callback(lambda f, key=key: self._download_done(key, f))
        # shield: a client that gives up does not cancel a download others wait for.
        staged = await asyncio.shield(fut)
        # A request that joined a download asked for without its dtype gets the copy now.
        e = self._entries.get(ref.key)
        if ref.dtype and e is not None and is_version(e, ref):
            return await self._with_copy(e, ref, generation)
        return staged

    async def _with_copy(self, e: _Entry, ref: AdapterRef, generation: int) -> StagedAdapter:
        """`e`, the staged version `ref` asks for, with its copy in `ref.dtype` (written now if
        it lacks one). The version may go while the copy is written: the answer is then what
        a download of it that ended then would be (Removed, Superseded), or, evicted, the
        version staged again; never the gone version, at a path that holds another or none."""
        if not ref.dtype or (self._blob_dir(e) / serving_weights_name(ref.dtype)).exists():
            return self._info(e)
        await self._add_serving_copy(e, ref)
        now = self._entries.get(ref.key)
        if now is e:
            return self._info(e)
        err = None
        if self._generation.get(ref.key, 0) != generation:
            err = StoreError("Removed", f"{ref.name} was removed (it left the plan) while its {ref.dtype} copy"
                             " was written")
        elif now is not None and not is_version(now, ref):
            err = StoreError("Superseded", f"{ref.name}: version {e.sha256[:12]} was replaced by version"
                             f" {now.sha256[:12]}, asked for after it, while its {ref.dtype} copy was written")
        if err is not None:
            # Counted as a download that ended so is (_download): the same failure series.
            self.metrics.failures.labels(err.reason).inc()
            raise err
        return await self.stage(ref)  # evicted meanwhile (or staged again): as asked anew

    def _download_done(self, key: tuple[Key, str, int], fut: asyncio.Future) -> None:
        self._inflight.pop(key, None)
        if not fut.cancelled():
            fut.exception()  # retrieved here: waiters that left early must not leave it unseen

    async def remove(self, name: str, namespace: str | None = None) -> bool:
        """Remove `name` from disk (an adapter deleted from the plan). True if it was there.
        A download of it in flight is void: it ends with StoreError("Removed") and leaves nothing."""
        key = (namespace, name)
        self._generation[key] = self._generation.get(key, 0) + 1
        self._release(0)  # a download of it waiting for room ends now (it is void)
        e = self._entries.pop(key, None)
        if e is None:
            return False
        await asyncio.to_thread(self._unlink_entry, e)
        self._update_gauges()
        return True

    async def _download(self, ref: AdapterRef, generation: int, asked: int) -> StagedAdapter:
        self.metrics.downloads_waiting.inc()
        try:
            await self._semaphore.acquire()
        finally:
            self.metrics.downloads_waiting.dec()
        self.downloads_started += 1
        self.metrics.downloads_in_flight.inc()
        t0 = time.monotonic()
        try:
            try:
                staged = await self._fetch_verify_place(ref, generation, asked)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise StoreError("DiskFull", f"{ref.name}: no space left on the disk under {self.root}"
                                 f" ({err.strerror}; {self.used_bytes} bytes staged, budget"
                                 f" {self.budget_bytes}: more than the disk has free?)") from None
        except StoreError as err:
            self.metrics.failures.labels(err.reason).inc()
            log.warning("staging %s failed: %s: %s", ref.name, err.reason, err)
            raise
        except Exception as err:  # a disk fault (or a bug): still a clean, reported failure
            self.metrics.failures.labels("DiskError").inc()
            log.exception("staging %s failed", ref.name)
            raise StoreError("DiskError", f"{type(err).__name__}: {err}") from err
        finally:
            self.metrics.downloads_in_flight.dec()
            self._semaphore.release()
        seconds = time.monotonic() - t0
        self.metrics.download_seconds.observe(seconds)
        log.info("staged %s (%d bytes) in %.2f s", ref.name, staged.bytes, seconds)
        return staged

    def _check_current(self, ref: AdapterRef, generation: int) -> None:
        """Raise Removed if `ref` was removed since a download of it started (`generation`)."""
        if self._generation.get(ref.key, 0) != generation:
            raise StoreError("Removed", f"{ref.name} was removed (it left the plan) while it downloaded")

    async def _fetch_verify_place(self, ref: AdapterRef, generation: int, asked: int) -> StagedAdapter:
        self._check_current(ref, generation)  # removed while it waited for a download slot
        try:
            source = open_source(ref.source, self._session, Stall(self.stall_seconds, self.stall_bytes))
        except SourceError as e:
            raise StoreError(e.reason, str(e)) from None
        tmp = Path(await asyncio.to_thread(_mkdtemp, self._tmp_dir, ref.name[:64]))  # (a name: 253 max)
        reserved = 0
        config_bytes = 0
        me = next(self._started)

        async def grow(nbytes: int, up_front: bool = False) -> None:
            """The weights have `nbytes` on disk so far (or in all, `up_front`): keep the budget
            ahead of them. A size the source did not announce is reserved as the bytes come,
            evicting as they grow; where the room is then held by a download that started
            earlier, it waits for that one to end rather than fail, so that two which cannot
            both fit do not both fail (the earliest never waits: one always goes on)."""
            nonlocal reserved
            # Removed meanwhile: void, it must neither evict for room nor hold a slot any longer.
            self._check_current(ref, generation)
            while config_bytes + nbytes > reserved:
                released = self._released
                try:
                    reserved += self._reserve(ref, config_bytes + nbytes - reserved, config_bytes + nbytes)
                except StoreError:
                    if up_front or not any(d < me for d in self._holding):
                        raise
                    await released.wait()
                    self._check_current(ref, generation)
                else:
                    self._holding[me] = reserved

        try:
            try:
                async with source.open(CONFIG_FILE) as fetch:
                    config_bytes, _ = await self._write(
                        fetch, tmp / CONFIG_FILE, limit=MAX_CONFIG_BYTES, too_big="InvalidAdapter")
                async with source.open(WEIGHTS_FILE) as fetch:
                    length_known = fetch.size is not None
                    if fetch.size is not None:  # all of it up front: fail early, before any byte
                        await grow(fetch.size, up_front=True)
                    nbytes, digest = await self._write(
                        fetch, tmp / WEIGHTS_FILE, limit=self.budget_bytes, too_big="BudgetExceeded",
                        grow=grow)
            except SourceError as e:
                raise StoreError(e.reason, str(e)) from None
            await grow(nbytes)  # (an empty file wrote no chunk)
            total = nbytes + config_bytes
            try:
                await asyncio.to_thread(check_adapter_dir, tmp)
                not_whole = None
            except InvalidAdapter as e:
                not_whole = e
            # A body that announced no length and ends where its own header says it does not (a
            # connection dropped mid-body, read to its close: no HTTP error) was cut in transit,
            # not a bad adapter: Truncated, retried with backoff, not DigestMismatch or
            # InvalidAdapter, which the warmer gives up on until the plan changes.
            if not_whole is not None and not length_known and await asyncio.to_thread(
                    _cut_short, tmp / WEIGHTS_FILE):
                raise StoreError("Truncated", f"{ref.name}: {WEIGHTS_FILE} ended after {nbytes} bytes, short of"
                                 f" what its header describes, and the source announced no length (the"
                                 f" connection dropped mid-body?): {not_whole}")
            if ref.sha256 is not None and digest != ref.sha256:
                raise StoreError(
                    "DigestMismatch",
                    f"{ref.name}: sha256 of {WEIGHTS_FILE} is {digest}, the adapter declares {ref.sha256}",
                )
            if not_whole is not None:
                raise StoreError("InvalidAdapter", f"{ref.name}: {not_whole}")
            if ref.dtype:
                extra = await self._write_serving_copy(tmp, ref)
                reserved += extra
                self._holding[me] = reserved
                total += extra
            # The cache is a host path every serving pod on the node mounts: no source's secrets.
            meta = {"name": ref.name, "sha256": digest, "source": redact(ref.source),
                    "sourceSha256": source_digest(ref.source)}
            await asyncio.to_thread(_write_synced, tmp / META_FILE, json.dumps(meta).encode())
            blob = f"{digest[:16]}-{uuid.uuid4().hex[:8]}"
            store_dir = namespace_dir(self.root, ref.namespace) / ".store"
            await asyncio.to_thread(self._store_blob, tmp, store_dir, blob)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            self._release(reserved, me)
            raise
        if self._generation.get(ref.key, 0) != generation:  # removed while the directory moved
            await asyncio.to_thread(shutil.rmtree, store_dir / blob, True)
            self._release(reserved, me)
            raise StoreError("Removed", f"{ref.name} was removed (it left the plan) while it downloaded")
        self._release(reserved, me)
        old = self._entries.get(ref.key)
        if old is not None and old.asked > asked:  # the later request wins, whichever ends first
            await asyncio.to_thread(shutil.rmtree, store_dir / blob, True)
            raise StoreError("Superseded", f"{ref.name}: version {digest[:12]} was dropped: version"
                             f" {old.sha256[:12]}, asked for after it, was staged first")
        # The name's symlink and its entry change together, with no await between them: two
        # versions of one name staged at once must not leave the link on one and the entry on
        # the other (whose cleanup then deletes the linked directory).
        entry = _Entry(ref.namespace, ref.name, digest, ref.source, blob, total, self._clock(),
                       source_digest(ref.source), asked)
        try:
            self._link(ref.namespace, ref.name, blob)
        except OSError:  # (a full disk): the version directory must not stay, unlinked and uncounted
            await asyncio.to_thread(shutil.rmtree, store_dir / blob, True)
            raise
        self._entries[ref.key] = entry
        try:
            await asyncio.to_thread(fsync_dir, namespace_dir(self.root, ref.namespace))
        finally:  # (a disk error there too: the old version is in no entry, and must not stay on disk)
            if old is not None:  # the previous version: its symlink points here no more
                await asyncio.to_thread(shutil.rmtree, self._blob_dir(old), True)
            self._update_gauges()
        return self._info(entry)

    async def _write(self, fetch: Fetch, path: Path, limit: int, too_big: str,
                     grow: Callable[[int], Awaitable[None]] | None = None) -> tuple[int, str]:
        """Stream `fetch` into `path`; return (bytes, sha256 hex). Refuse more than `limit`.
        `grow(bytes so far)` runs before each chunk is written (it reserves budget for them,
        or raises)."""
        h = hashlib.sha256()
        n = 0
        with path.open("wb") as f:
            async for chunk in fetch.chunks:
                n += len(chunk)
                if n > limit:
                    raise StoreError(too_big, f"{path.name}: more than {limit} bytes")
                if grow is not None:
                    await grow(n)
                h.update(chunk)
                f.write(chunk)
            f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
        if fetch.size is not None and n != fetch.size:
            raise StoreError("Truncated", f"{path.name}: got {n} bytes, the source announced {fetch.size}")
        self.metrics.download_bytes.inc(n)
        return n, h.hexdigest()

    def _reserve(self, ref: AdapterRef, nbytes: int, total: int | None = None) -> int:
        """Promise `nbytes` more of the budget to a download (`total` with what it holds
        already), evicting to make room."""
        total = nbytes if total is None else total
        need = self.used_bytes + self._reserved + nbytes - self.budget_bytes
        if need > 0:
            pinned = ref.key in self._pinned
            # The name's current version stays until the new one replaces it.
            order = sorted(
                (e for e in self._entries.values()
                 if e.key != ref.key and (pinned or e.key not in self._pinned)),
                key=lambda e: (e.key in self._pinned, e.last_used),
            )
            victims, freed = [], 0
            for e in order:
                if freed >= need:
                    break
                victims.append(e)
                freed += e.nbytes
            if freed < need:
                raise StoreError(
                    "BudgetExceeded",
                    f"{ref.name}: {total} bytes do not fit the {self.budget_bytes}-byte budget"
                    f" ({self.used_bytes} staged, {self._reserved - (total - nbytes)} reserved by other"
                    " downloads in flight,"
                    f" {freed} evictable{'' if pinned else ' without evicting pinned adapters'})",
                )
            for e in victims:
                self._evict(e)
        self._reserved += nbytes
        return nbytes

    def _release(self, nbytes: int, download: int | None = None) -> None:
        """Give back bytes reserved (once they are staged or deleted); wake those waiting."""
        self._reserved -= nbytes
        if download is not None:
            self._holding.pop(download, None)
        self._released.set()
        self._released = asyncio.Event()

    def _evict(self, e: _Entry) -> None:
        log.info("evicting %s (%d bytes, last used %.0f) to make room", _label(e), e.nbytes, e.last_used)
        del self._entries[e.key]
        self._unlink_entry(e)
        self.metrics.evictions.inc()
        self._update_gauges()
        if self.on_evict is not None:
            self.on_evict(e.key)

    # -- disk ---------------------------------------------------------------------------------

    def _open(self) -> None:
        """Create the layout; clear leftovers of a crash; read back what is staged, at the top
        and in each namespace's folder."""
        for d in (self.root, self.root / ".store", self._tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in self._tmp_dir.iterdir():
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        # A plan record (warmer.Warmer._record) cut short between its temporary file and the
        # rename: nothing else would ever remove it. The records themselves stay.
        for leftover in self.root.glob(PLAN_RECORD_TMP):
            if leftover.is_file() and not leftover.is_symlink():
                leftover.unlink()
        self._open_dir(None)
        namespaces = self.root / NAMESPACES_DIR
        for d in sorted(namespaces.iterdir()) if namespaces.is_dir() else ():
            if d.is_dir() and not d.is_symlink() and is_namespace(d.name):
                self._open_dir(d.name)
            else:
                log.warning("ignoring %s: not a namespace's folder the agent made", d)
        if self._entries:
            log.info("found %d staged adapters (%d bytes) in %s", len(self._entries), self.used_bytes, self.root)
        if self.used_bytes > self.budget_bytes:  # a smaller budget than the last run's
            log.warning("%d staged bytes are over the %d-byte budget: evicting the least recently used",
                        self.used_bytes, self.budget_bytes)
            for e in sorted(self._entries.values(), key=lambda e: e.last_used):  # (no pins known yet)
                if self.used_bytes <= self.budget_bytes:
                    break
                self._evict(e)
        self._update_gauges()

    def _open_dir(self, namespace: str | None) -> None:
        """Read back the adapters of one folder (the top, or a namespace's)."""
        home = namespace_dir(self.root, namespace)
        store_dir = home / ".store"
        store_dir.mkdir(parents=True, exist_ok=True)
        used_blobs = set()
        for link in home.iterdir():
            if link.name.startswith("."):
                if link.is_symlink():  # a symlink swap cut short
                    link.unlink()
                continue
            if not link.is_symlink():
                log.warning("ignoring %s: not a symlink the agent made", link)
                continue
            target = Path(os.readlink(link))
            blob_dir = store_dir / target.name
            try:
                meta = json.loads((blob_dir / META_FILE).read_text())
                check_adapter_dir(blob_dir)  # both files there and whole, as when staged
                mtime = blob_dir.stat().st_mtime
                # A serving copy cut short by a crash, under its temporary name, or since.
                leftovers = [f for f in blob_dir.iterdir() if f.name.startswith(".") and f.name != META_FILE]
                for dtype in SERVING_DTYPES:
                    copy = blob_dir / serving_weights_name(dtype)
                    if copy.exists():
                        try:
                            read_safetensors_header(copy)
                        except InvalidAdapter as e:
                            log.warning("removing %s: %s", copy, e)
                            leftovers.append(copy)
                for f in leftovers:
                    f.unlink()
                if leftovers:
                    os.utime(blob_dir, (mtime, mtime))  # the last use, not this clean-up
                nbytes = sum(f.stat().st_size for f in blob_dir.iterdir() if f.name != META_FILE)
            except (OSError, ValueError) as e:  # InvalidAdapter too
                log.warning("removing %s: its version directory is missing or incomplete (%s)", link, e)
                link.unlink()
                continue
            if (not isinstance(meta, dict) or meta.get("name") != link.name
                    or not isinstance(meta.get("sha256"), str) or not isinstance(meta.get("source"), str)):
                log.warning("removing %s: its version's %s does not describe it", link, META_FILE)
                link.unlink()
                continue
            used_blobs.add(target.name)
            # A version staged before sources were kept redacted has the whole source instead.
            kept = meta.get("sourceSha256")
            self._entries[(namespace, link.name)] = _Entry(
                namespace, link.name, meta["sha256"], meta["source"], target.name, nbytes, mtime,
                kept if isinstance(kept, str) else source_digest(meta["source"]))
        for blob in store_dir.iterdir():
            if blob.name not in used_blobs:
                shutil.rmtree(blob, ignore_errors=True)

    def _blob_dir(self, e: _Entry) -> Path:
        return namespace_dir(self.root, e.namespace) / ".store" / e.blob

    def _store_blob(self, tmp: Path, store_dir: Path, blob: str) -> None:
        """Move a verified download into `store_dir` (its namespace's .store) under its
        version's directory name (durably)."""
        fsync_dir(tmp)
        new = not store_dir.is_dir()
        store_dir.mkdir(parents=True, exist_ok=True)
        if new:  # a namespace's first adapter: its folders made durable too
            fsync_dir(store_dir.parent)
            fsync_dir(store_dir.parent.parent)
        os.rename(tmp, store_dir / blob)
        try:
            fsync_dir(store_dir)
        except BaseException:  # out of .tmp (which the caller clears), in no entry: not left there
            shutil.rmtree(store_dir / blob, ignore_errors=True)
            raise

    def _link(self, namespace: str | None, name: str, blob: str) -> None:
        """Point the name's symlink at `blob`: a new link renamed over the old, so a reader sees
        one version or the other. Two quick syscalls, run on the event loop (see the caller)."""
        home = namespace_dir(self.root, namespace)
        # The name's first 64 characters only: a name may take 253 of a file name's 255 bytes.
        link_tmp = home / f".{name[:64]}.{uuid.uuid4().hex[:8]}.link"
        os.symlink(os.path.join(".store", blob), link_tmp)
        try:
            os.replace(link_tmp, home / name)
        except OSError:
            link_tmp.unlink(missing_ok=True)
            raise

    async def _write_serving_copy(self, directory: Path, ref: AdapterRef) -> int:
        """Write the weights' F32 tensors in `ref.dtype` beside them in `directory` and reserve
        its bytes; returns them (0 when there is nothing to convert). A copy that cannot be
        written, or does not fit the budget's free bytes (it never evicts an adapter), is left
        out, not the adapter: a server then converts as it reads (slower, the same bits). Its
        size comes from the header, so one without room is never written."""
        try:
            size = await asyncio.to_thread(serving_copy_size, directory, ref.dtype)
        except (OSError, ValueError, MemoryError) as err:
            log.warning("adapter %s: no %s copy of its weights (%s)", ref.name, ref.dtype, err)
            return 0
        if size is None:
            return 0
        if self.used_bytes + self._reserved + size > self.budget_bytes:
            log.info("adapter %s: no room in the budget for its %s copy (%d bytes)", ref.name, ref.dtype, size)
            return 0
        self._reserved += size
        try:
            copy = await asyncio.to_thread(write_serving_copy, directory, ref.dtype)
            written = copy.stat().st_size if copy is not None else 0
        except (OSError, ValueError, MemoryError) as err:
            self._release(size)
            log.warning("adapter %s: no %s copy of its weights (%s)", ref.name, ref.dtype, err)
            return 0
        self._release(size - written)  # (none, unless the file changed between the two reads)
        return written

    async def _add_serving_copy(self, e: _Entry, ref: AdapterRef) -> None:
        """The same for a version staged before without it: one writer, as a task of its own
        (a caller that goes away cancels neither it nor its accounting), which a request that
        comes while it writes waits for too, so that every one is answered with the copy there."""
        key = (e.blob, ref.dtype)
        task = self._copying.get(key)
        if task is None:
            task = self._copying[key] = asyncio.ensure_future(self._copy_into(e, ref))
            task.add_done_callback(lambda t, key=key: self._copying.pop(key, None))
        await asyncio.shield(task)

    async def _copy_into(self, e: _Entry, ref: AdapterRef) -> None:
        directory = self._blob_dir(e)
        extra = await self._write_serving_copy(directory, ref)
        self._release(extra)
        if self._entries.get(e.key) is not e:
            # The version went while its copy was written (evicted, removed, replaced): deleting
            # its folder lists the files, then deletes them and the folder, and a file the copy
            # made in between (its temporary, renamed into place) kept the folder there, in no
            # entry. The writer is done now: delete what is left, the folder too.
            await asyncio.to_thread(shutil.rmtree, directory, True)
            return
        if extra:
            e.nbytes += extra
            self._update_gauges()
            log.info("adapter %s: wrote its %s copy", e.name, ref.dtype)

    def _unlink_entry(self, e: _Entry) -> None:
        home = namespace_dir(self.root, e.namespace)
        link = home / e.name
        with contextlib.suppress(OSError):
            if link.is_symlink() and Path(os.readlink(link)).name == e.blob:
                link.unlink()
                fsync_dir(home)
        shutil.rmtree(self._blob_dir(e), ignore_errors=True)

    def _info(self, e: _Entry) -> StagedAdapter:
        return StagedAdapter(e.name, e.sha256, e.source, str(namespace_dir(self.root, e.namespace) / e.name), e.nbytes,
                             e.key in self._pinned, e.last_used, e.source_digest, e.namespace)

    def _update_gauges(self) -> None:
        self.metrics.disk_bytes.set(self.used_bytes)
        self.metrics.staged_adapters.set(len(self._entries))
        self.metrics.pinned_adapters.set(sum(1 for k in self._entries if k in self._pinned))


def _label(e: _Entry) -> str:
    """How logs name an adapter: `name`, or `namespace/name`."""
    return e.name if e.namespace is None else f"{e.namespace}/{e.name}"


def _cut_short(path: Path) -> bool:
    """Whether the safetensors file at `path` is shorter than its own header says it is: its
    8-byte length prefix cut, its header cut, or its last tensor's bytes cut. (A file of a
    wrong shape otherwise, or not safetensors at all, is not "cut short".)"""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                return True
            n = int.from_bytes(head, "little")
            if n > (100 << 20):  # not a header length: not a safetensors file
                return False
            if 8 + n > size:
                return True
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(header, dict):
        return False
    ends = [info.get("data_offsets", [0, 0])[-1] for k, info in header.items()
            if k != "__metadata__" and isinstance(info, dict) and isinstance(info.get("data_offsets"), list)
            and info.get("data_offsets")]
    ends = [e for e in ends if isinstance(e, int) and not isinstance(e, bool)]
    return bool(ends) and 8 + n + max(ends) > size


def _mkdtemp(parent: Path, name: str) -> str:
    parent.mkdir(parents=True, exist_ok=True)
    # The name's head only: "<name>.<random>" of a 253-character name is past NAME_MAX (255).
    return tempfile.mkdtemp(prefix=f"{name[:64]}.", dir=parent)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


