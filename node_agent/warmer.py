"""Follow the operator's plan: stage its adapters on this node and warm this node's servers.

The plan file is the `plan.json` key of the ConfigMap `<base>-plan`, mounted read-only:

    {"baseModel": "llama-3-8b", "maxLoraRank": 64, "slots": 250, "pinned": ["a", "b"],
     "adapters": [{"name": "a", "source": "https://…/a/", "sha256": "…", "tenant": "t",
                   "priority": 100, "pinned": true}, …],
     "prefetch": [{"name": "c", "start": "2026-05-01T08:00:00Z", "end": "2026-05-02T08:00:00Z"}]}

The warmer polls the plan's identity every `poll_seconds` (a mounted file: inode, size and
mtime, since a ConfigMap changes by a symlink swap; through the API: the resourceVersion)
and re-reads it when that changes. On each plan (and after a backoff while a staging failure
may pass) it reconciles: the store's pinned set; pinned adapters staged first, then the
prefetch entries (the operator lists a warm-up window `warmupLeadSeconds` before its start,
and until its end: staged and prefetched from then on, so the campaign's first requests
find it on the node and in the servers); adapters that left the
plan removed from disk (at the first plan after a start, those that left it while the agent
was down: the plan's adapter names are kept in `<cache>/.plan-adapters.json`, one such file
a plan, `.plan-adapters.<namespace>.<name>.json`, where an agent follows several or found
the plan by label). A bad plan is logged and the previous plan kept. A plan no longer
followed (found by label, and gone) is retired: its adapters leave it as dropped ones do.

Servers: when a server pod of the plan's base on this node turns ready, the warmer asks it
to load the pinned set and the prefetch entries from local disk:

    POST http://<pod>:8000/v1/adapters/{name}/prefetch?wait=false
    POST http://<pod>:8000/v1/adapters/{name}/pin              (pinned adapters only)
    POST http://<pod>:8000/v1/adapters/{name}/unpin            (pinned by an earlier plan, not
                                                                by this one: a server keeps an
                                                                API pin until told otherwise)

The server finds `{name}` in its adapter directory, which is this agent's cache directory
mounted read-only (the operator's Deployment mounts the same host path). Servers are called
side by side; a server that does not answer a call (refused, or no answer within
`server_timeout_seconds`) has the rest of its warm-up skipped and is tried again at the next
server check, so a server that is down or hung holds up neither the others nor the plan loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from loraplex.node_agent.kube import StatusReporter
from loraplex.node_agent.metrics import Metrics
from loraplex.node_agent.server_keys import ServerKeys
from loraplex.node_agent.sources import redact
from loraplex.node_agent.store import AdapterRef, AdapterStore, StagedAdapter, StoreError, is_version
from loraplex.server.adapter_format import SERVING_DTYPES
from loraplex.server.api_keys import WatchedFile
from loraplex.server.plan_file import PlanFileError, decode_plan, read_plan_file

log = logging.getLogger(__name__)


class PlanError(ValueError):
    """The plan file cannot be used; the message says which part."""


@dataclass(frozen=True)
class PlanAdapter:
    ref: AdapterRef
    tenant: str | None
    priority: int
    pinned: bool


@dataclass(frozen=True)
class PrefetchWindow:
    name: str
    start: datetime.datetime
    end: datetime.datetime

    def is_due(self, now: datetime.datetime) -> bool:
        """Whether to stage and prefetch it now: it is in the plan's prefetch list, which the
        operator enters it `warmupLeadSeconds` before its start (so that the campaign's first
        requests find it on the node and in the servers), and has not ended."""
        return now < self.end


@dataclass(frozen=True)
class Plan:
    base_model: str
    slots: int
    pinned: tuple[str, ...]
    adapters: dict[str, PlanAdapter]
    prefetch: tuple[PrefetchWindow, ...] = ()

    def due_prefetch(self, now: datetime.datetime) -> list[str]:
        return [w.name for w in self.prefetch if w.is_due(now) and w.name in self.adapters]


def parse_plan(data: object, namespace: str | None = None) -> Plan:
    """A Plan from the decoded plan.json; PlanError says what does not fit. `namespace`: the
    plan's (its LoRAAdapters'), which its adapters are staged under."""
    if not isinstance(data, dict):
        raise PlanError("plan is not a JSON object")
    try:
        adapters = {}
        dtype = data.get("dtype")  # the base's: a copy of F32 adapters in it is staged too
        if dtype is not None and dtype not in SERVING_DTYPES:
            raise PlanError(f"dtype {dtype!r} is not one of {sorted(SERVING_DTYPES)}")
        for a in data.get("adapters") or []:
            ref = AdapterRef(_string(a["name"], "an adapter's name"), _string(a["source"], "an adapter's source"),
                             a.get("sha256"), dtype, namespace)
            adapters[ref.name] = PlanAdapter(ref, a.get("tenant"), int(a.get("priority", 0)), bool(a.get("pinned")))
        pinned = tuple(data.get("pinned") or [n for n, a in adapters.items() if a.pinned])
        unknown = [n for n in pinned if n not in adapters]
        if unknown:
            raise PlanError(f"pinned adapters {unknown} are not in the plan's adapters")
        windows = tuple(
            PrefetchWindow(_string(w["name"], "a prefetch window's name"), _parse_time(w["start"]),
                           _parse_time(w["end"]))
            for w in data.get("prefetch") or []
        )
        return Plan(str(data["baseModel"]), int(data.get("slots", 0)), pinned, adapters, windows)
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from None


def _same_version(planned: AdapterRef, asked: AdapterRef) -> bool:
    """`asked` names the version the plan has for its name (see Warmer.stage_refusal)."""
    if planned.sha256 is not None:
        return asked.sha256 == planned.sha256
    return (asked.source.partition("?")[0] == planned.source.partition("?")[0]
            and asked.sha256 in (None, planned.sha256))


def read_plan(path: Path, namespace: str | None = None) -> Plan:
    try:
        return parse_plan(read_plan_file(path), namespace)
    except PlanFileError as e:
        raise PlanError(str(e)) from None


class PlanSource(Protocol):
    """Where the plan comes from: a mounted file (PlanFile) or the API (kube.PlanConfigMap)."""

    async def read(self, known: object) -> tuple[object, bytes | None]:
        """(identity, file bytes, gzipped or not): bytes None when the identity equals
        `known` (unchanged) or the plan is missing (identity None)."""


class PlanFile:
    """The plan as a mounted ConfigMap file. A ConfigMap changes by a symlink swap, so the
    identity is the resolved file's (inode, size, mtime)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    async def read(self, known: object) -> tuple[object, str | None]:
        try:
            st = os.stat(self.path)  # follows the symlinks
        except OSError:
            return None, None
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        if identity == known:
            return identity, None
        try:
            return identity, self.path.read_bytes()
        except OSError as e:
            raise PlanError(f"{self.path}: {e}") from None


def _string(value: object, what: str) -> str:
    """`value` if it is a string: a name of another type would fail later, where a dict
    lookup or a URL quote meets it, out of the plan parser's reach."""
    if not isinstance(value, str):
        raise PlanError(f"{what} must be a string, got {value!r}")
    return value


def _parse_time(s: str) -> datetime.datetime:
    if not isinstance(s, str):
        raise ValueError(f"time {s!r} is not an ISO 8601 string")
    t = datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))
    if t.tzinfo is None:
        raise ValueError(f"time {s!r} has no UTC offset")
    return t


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


# -- servers on this node ---------------------------------------------------------------------


class ServerDiscovery(Protocol):
    async def servers(self, base_model: str) -> dict[str, tuple[str, bool]]:
        """{server id: (base URL, ready)} for the base's servers on this node."""


class StaticServers:
    """Fixed server URLs (a server on the host network, a test); ready = GET /readyz is 200."""

    def __init__(self, urls: list[str], session: aiohttp.ClientSession) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self._session = session

    async def servers(self, base_model: str) -> dict[str, tuple[str, bool]]:
        ready = await asyncio.gather(*(self._ready(url) for url in self.urls))  # side by side
        return {url: (url, r) for url, r in zip(self.urls, ready)}

    async def _ready(self, url: str) -> bool:
        try:
            async with self._session.get(f"{url}/readyz", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False


# -- the warmer -------------------------------------------------------------------------------


@dataclass
class WarmResult:
    name: str
    action: str
    ok: bool
    detail: str = ""
    unreachable: bool = False  # no answer at all (refused, reset, timed out), not an error status

    def as_json(self) -> dict:
        return {"name": self.name, "action": self.action, "ok": self.ok, "detail": self.detail}


# Staging failures worth retrying without a new plan (with backoff). Superseded: another
# version of the name, asked for by someone else, was staged over the plan's; the plan wins.
RETRYABLE = frozenset({"NotFound", "Truncated", "Unreachable", "Stalled", "HTTPError", "DiskError",
                       "DiskFull", "Superseded"})


# Failures of the adapter itself (its files, its digest, its source URI), not of the node.
BAD_ADAPTER = frozenset({"DigestMismatch", "InvalidAdapter", "InvalidRequest", "Unsupported"})


@dataclass
class _Watch:
    identity: object = None
    missing: bool = False  # logged once per absence
    read_error: str | None = None  # the last error reading the plan, logged once while it lasts
    plan: Plan | None = None
    errors: dict[str, str] = field(default_factory=dict)  # adapter -> "Reason: message"
    reasons: dict[str, str] = field(default_factory=dict)  # adapter -> Reason
    failed_for_good: dict[str, AdapterRef] = field(default_factory=dict)  # not RETRYABLE


class Warmer:
    def __init__(
        self,
        store: AdapterStore,
        plan: PlanSource | Path | None,
        session: aiohttp.ClientSession,
        *,
        discovery: ServerDiscovery | None = None,
        reporter: StatusReporter | None = None,
        metrics: Metrics | None = None,
        namespace: str | None = None,
        record_file: str | None = None,
        now: Callable[[], datetime.datetime] = utcnow,
        poll_seconds: float = 1.0,
        server_poll_seconds: float = 2.0,
        server_timeout_seconds: float = 10.0,
        retry_seconds: float = 10.0,
        max_retry_seconds: float = 300.0,
        server_api_key: str | WatchedFile | ServerKeys | None = None,
    ) -> None:
        self.store = store
        # The servers' admin keys (one for all, as given or as its file holds it now, or one per
        # namespace or BaseModel: server_keys.py), on the calls to them only (the session also
        # fetches sources).
        self._server_keys = server_api_key if isinstance(server_api_key, ServerKeys) else ServerKeys(server_api_key)
        self.plan_source: PlanSource | None = PlanFile(plan) if isinstance(plan, (str, Path)) else plan
        self._session = session
        self.discovery = discovery
        self.reporter = reporter
        # The plan's namespace (its LoRAAdapters'): its adapters are staged in the cache's
        # folder for it, which the operator mounts into that namespace's servers alone.
        self.namespace = namespace
        self.record_file = record_file or self.PLAN_ADAPTERS_FILE  # its plan's adapters, under the cache
        # Whether another plan this agent follows lists a name of this namespace (set by the
        # agent): an adapter that moved there (another BaseModel) is that plan's to keep.
        self.listed_elsewhere: Callable[[str], bool] = lambda name: False
        store.on_evict = self._evicted
        self.metrics = metrics or store.metrics
        self._now = now
        self.poll_seconds = poll_seconds
        self.server_poll_seconds = server_poll_seconds
        self.server_timeout_seconds = server_timeout_seconds
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self._watch = _Watch()
        self._ready: dict[str, str] = {}  # server id -> URL, servers already warmed
        self._wake = asyncio.Event()
        self.reconciles = 0
        self._recorded: dict | None = None  # the plan's adapters and pins as last written to disk
        self._unpin: set[str] = set()  # pinned by an earlier plan (or run), not by this one

    @property
    def plan(self) -> Plan | None:
        return self._watch.plan

    @property
    def errors(self) -> dict[str, str]:
        return dict(self._watch.errors)

    @property
    def retryable(self) -> list[str]:
        """Plan adapters whose last staging failed for a reason that may pass (a network
        error, a source not uploaded yet); a wrong digest or a bad file waits for a new plan."""
        return sorted(n for n, reason in self._watch.reasons.items() if reason in RETRYABLE)

    def wake(self) -> None:
        """Check the plan now instead of at the next poll."""
        self._wake.set()

    # -- plan ---------------------------------------------------------------------------------

    async def stage_refusal(self, ref: AdapterRef) -> StoreError | None:
        """Why a client's stage request for `ref` must not be served, or None (see `_plans_version`)."""
        try:
            await self._plans_version(ref)
        except StoreError as e:
            return e
        return None

    async def _plans_version(self, ref: AdapterRef) -> AdapterRef | None:
        """The plan's own entry for a client's stage request of `ref`, or None for a name the
        plan does not list; StoreError NotThePlansVersion when `ref` asks for another version.

        The node's servers load a plan adapter by its name from this node's disk, so a request
        for a name the plan lists must ask for the plan's version: its digest, or, where the
        plan gives none, its source (query string aside: a rotated token names the same
        object). Otherwise any pod that reaches the agent's port could put other weights
        under a tenant's adapter name, for every server of the pool on this node. A server may
        have read a newer plan than this agent has, so a mismatch reads the plan again (and
        wakes the plan loop to take it) before refusing. Names the plan does not list (another
        base's servers on this node, or no plan at all) are staged as asked."""
        plan = self.plan
        if plan is None or ref.namespace != self.namespace:
            return None
        if ref.name in plan.adapters and _same_version(plan.adapters[ref.name].ref, ref):
            return plan.adapters[ref.name].ref
        newer = await self._read_plan_now()
        if newer is not None:
            self.wake()
            if ref.name not in newer.adapters:
                return None
            if _same_version(newer.adapters[ref.name].ref, ref):
                return newer.adapters[ref.name].ref
            plan = newer
        elif ref.name not in plan.adapters:
            return None
        wanted = plan.adapters[ref.name].ref
        what = f"sha256 {wanted.sha256}" if wanted.sha256 is not None else f"source {redact(wanted.source)}"
        raise StoreError("NotThePlansVersion", f"{ref.name} is in the plan of {plan.base_model} with {what}: "
                         "this node stages that version of it alone")

    async def stage_on_request(self, ref: AdapterRef) -> StagedAdapter:
        """Stage `ref` for a client (a server whose request found it missing): refused as
        `_plans_version` says, and for a plan adapter reported on its status.nodes as the plan's
        own stagings are (most adapters of a pool are staged so, on their first request, not
        ahead: without the report their LoRAAdapter said "not staged on any node" for good).

        A plan adapter with a digest is fetched from the plan's source, not the client's: the
        digest covers its weights alone, and a client's source could serve them beside another
        adapter_config.json (another lora_alpha, other target modules) under a tenant's name."""
        planned = await self._plans_version(ref)
        if planned is not None and planned.sha256 is not None:
            ref = dataclasses.replace(ref, source=planned.source)
        if planned is not None:  # listed by the plan this agent holds, or by the one just read
            return await self._stage(ref)
        staged = await self.store.stage(ref)
        # The plan loop may have taken a plan that lists it while it downloaded: that plan's
        # reconcile found nothing of it on disk to report, so it is reported here.
        plan = self.plan
        if (self.reporter is not None and plan is not None and ref.namespace == self.namespace
                and ref.name in plan.adapters and is_version(staged, plan.adapters[ref.name].ref)):
            self.reporter.staged(ref.name, staged.bytes)
        return staged

    async def lists_now(self, name: str) -> bool:
        """Whether this warmer's plan, read again now, lists `name` (the plan loop woken to
        take it); False without a plan source or a plan that reads."""
        newer = await self._read_plan_now()
        if newer is None or name not in newer.adapters:
            return False
        self.wake()
        return True

    async def _read_plan_now(self) -> Plan | None:
        """The plan as its source holds it now, if it reads and parses; the watch is left as it
        is (the plan loop takes a new plan, and reconciles for it, on its next poll)."""
        if self.plan_source is None:
            return None
        try:
            identity, raw = await self.plan_source.read(None)
            return parse_plan(decode_plan(raw), self.namespace) if identity is not None and raw is not None else None
        except (ValueError, PlanFileError, zlib.error, aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def check_plan(self) -> bool:
        """Re-read the plan if it changed; True if a new plan was taken. A missing or bad
        plan is logged and the last good one kept."""
        if self.plan_source is None:
            return False
        try:
            identity, raw = await self.plan_source.read(self._watch.identity)
        except (ValueError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            # ValueError: PlanError, and a ConfigMap whose binaryData is not base64 or whose
            # body is not JSON; each poll meets it again, so it is logged once.
            if str(e) != self._watch.read_error:
                log.error("cannot read the plan %s: %s", self.plan_source, e)
            self._watch.read_error = str(e)
            return False
        self._watch.read_error = None
        if identity is None:
            if not self._watch.missing:
                log.warning("plan %s is missing; keeping the last plan", self.plan_source)
            self._watch.identity, self._watch.missing = None, True
            return False
        self._watch.missing = False
        if raw is None:
            return False
        self._watch.identity = identity
        try:
            plan = parse_plan(decode_plan(raw), self.namespace)
        except (PlanError, PlanFileError, zlib.error) as e:  # zlib.error: a broken deflate stream
            log.error("ignoring plan %s: %s", self.plan_source, e)
            return False
        if plan == self._watch.plan:
            return False
        log.info("plan for %s: %d adapters, %d pinned, %d prefetch windows", plan.base_model,
                 len(plan.adapters), len(plan.pinned), len(plan.prefetch))
        self._watch.plan = plan
        return True

    async def reconcile(self, previous: Plan | None = None) -> None:
        """Bring the local disk in line with the plan: pins, staging, removals."""
        plan = self._watch.plan
        if plan is None:
            return
        self.reconciles += 1
        self.store.set_pinned(set(plan.pinned), self.namespace, owner=self.record_file)
        dropped: set[str] = set()
        was_pinned: set[str] = set()
        if previous is not None:
            # A new plan may unpin or drop adapters and so make room: try budget failures again.
            for name in [n for n, r in self._watch.reasons.items() if r == "BudgetExceeded"]:
                self._watch.failed_for_good.pop(name, None)
            dropped = set(previous.adapters) - set(plan.adapters)
            was_pinned = set(previous.pinned)
        elif self._recorded is None:  # this process's first plan: the one before is the last run's
            last = self._last_run()
            dropped = set(last["adapters"]) - set(plan.adapters)
            was_pinned = set(last["pinned"])
        # A server keeps the pins the warmer made through its API until it is told otherwise.
        self._unpin = (self._unpin | was_pinned) - set(plan.pinned)
        await self._drop(dropped)
        self._record({"adapters": sorted(plan.adapters), "pinned": sorted(plan.pinned)})
        if self.reporter is not None:  # what an earlier run (or a session) left on disk
            for name, a in plan.adapters.items():
                staged = self.store.get(name, self.namespace)
                if staged is not None and is_version(staged, a.ref):
                    self.reporter.staged(name, staged.bytes)
        await self._stage_all([plan.adapters[n].ref for n in plan.pinned])
        now = self._now()
        await self._stage_all([plan.adapters[n].ref for n in plan.due_prefetch(now)])
        # Servers already warm get the new pins and prefetches too (idempotent calls), side
        # by side: a server that hangs costs the plan loop one call timeout, not one per server.
        await asyncio.gather(*(self.warm_server(url) for url in list(self._ready.values())))

    async def _drop(self, names: set[str]) -> None:
        """Adapters that left the plan: removed from disk (their status entry for this node
        too, as one whose staging failed or was under way: nothing of it will be here), unless
        another followed plan of the namespace lists them; their errors forgotten."""
        for name in sorted(names):
            if self.listed_elsewhere(name):  # moved to another followed plan of the namespace: it stays
                continue
            removed = await self.store.remove(name, self.namespace)
            if removed:
                log.info("removed %s from local disk: it left the plan", name)
            if removed or (self.reporter is not None and self.reporter.reported(name)):
                self._report_removed(name)
            self._watch.errors.pop(name, None)
            self._watch.reasons.pop(name, None)
            self._watch.failed_for_good.pop(name, None)

    async def retire(self) -> None:
        """The plan is followed no more (its ConfigMap is gone: its BaseModel was deleted): each
        of its adapters leaves it as an adapter leaving a plan does (`_drop`), its pins are
        released and its record file removed. The caller has stopped its loops first."""
        plan = self._watch.plan
        names = set(plan.adapters) if plan is not None else set()
        if self._recorded is None:  # not reconciled in this process: what the last run recorded
            names |= set(self._last_run()["adapters"])
        self._watch = _Watch()
        self._unpin.clear()
        self.store.set_pinned(set(), self.namespace, owner=self.record_file)
        await self._drop(names)
        try:
            (self.store.root / self.record_file).unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot remove the record %s of a plan no longer followed: %s", self.record_file, e)
        self._recorded = None

    async def _stage_all(self, refs: list[AdapterRef]) -> None:
        # An adapter that failed for good (wrong digest, bad file) is tried again only when
        # the plan gives it a new source or digest.
        refs = [r for r in refs if self._watch.failed_for_good.get(r.name) != r]
        results = await asyncio.gather(*(self._stage(r) for r in refs), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, StoreError):
                raise res

    async def _stage(self, ref: AdapterRef) -> StagedAdapter:
        """Stage one plan adapter, keeping its error and its status.nodes entry up to date."""
        have = self.store.get(ref.name, ref.namespace)
        if self.reporter is not None and (have is None or not is_version(have, ref)):
            self.reporter.staging(ref.name)
        try:
            staged = await self.store.stage(ref)
        except StoreError as e:
            if e.reason == "Removed":  # it left the plan while it downloaded: nothing of it here
                plan = self._watch.plan
                if plan is None or ref.name not in plan.adapters:  # (back in it: that stage reports)
                    self._report_removed(ref.name)  # not Staging for good
                raise
            self._watch.errors[ref.name] = f"{e.reason}: {e}"
            self._watch.reasons[ref.name] = e.reason
            if e.reason not in RETRYABLE:
                self._watch.failed_for_good[ref.name] = ref
            if self.reporter is not None:
                self.reporter.failed(ref.name, e.reason, str(e))
            raise
        self._watch.errors.pop(ref.name, None)
        self._watch.reasons.pop(ref.name, None)
        self._watch.failed_for_good.pop(ref.name, None)
        if self.reporter is not None:
            self.reporter.staged(ref.name, staged.bytes)
        return staged

    # The plan's adapter names and pinned set, kept in the cache directory (a dot name: neither
    # the store nor a server takes it for an adapter), so that what the plan dropped or unpinned
    # while the agent was down is removed and unpinned after its next start as while it runs.
    PLAN_ADAPTERS_FILE = ".plan-adapters.json"

    def _last_run(self) -> dict[str, list[str]]:
        try:
            last = json.loads((self.store.root / self.record_file).read_text())
        except (OSError, ValueError):
            last = None
        if not isinstance(last, dict):
            last = {}
        return {k: [n for n in v if isinstance(n, str)] if isinstance(v := last.get(k), list) else []
                for k in ("adapters", "pinned")}

    def _record(self, state: dict) -> None:
        if state == self._recorded:
            return
        path = self.store.root / self.record_file
        tmp = path.with_name(f"{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot record the plan's adapters in %s: %s", path, e)
            with contextlib.suppress(OSError):  # a part of it, left for good: nothing else removes it
                tmp.unlink(missing_ok=True)
            return
        self._recorded = state

    def _evicted(self, key: tuple) -> None:
        namespace, name = key
        plan = self._watch.plan
        if plan is not None and namespace == self.namespace and name in plan.adapters:
            self._report_removed(name)

    def _report_removed(self, name: str) -> None:
        if self.reporter is not None:
            self.reporter.removed(name)

    async def run(self) -> None:
        """The plan loop: poll the plan; reconcile on a change (the operator writes a new plan
        when a warm-up window enters its prefetch list or leaves it), and after a backoff
        (retry_seconds, doubling up to max_retry_seconds) while a plan adapter's staging
        failed for a retryable reason."""
        loop = asyncio.get_running_loop()
        backoff = self.retry_seconds
        retry_at: float | None = None
        while True:
            previous = self._watch.plan
            changed = await self.check_plan()
            retry = retry_at is not None and loop.time() >= retry_at
            if changed or retry:
                if changed:
                    backoff = self.retry_seconds
                await self.reconcile(previous if changed else None)
                if self.retryable:
                    retry_at = loop.time() + backoff
                    log.info("retrying %s in %.0f s", ", ".join(self.retryable), backoff)
                    backoff = min(2 * backoff, self.max_retry_seconds)
                else:
                    retry_at, backoff = None, self.retry_seconds
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    # -- servers ------------------------------------------------------------------------------

    async def run_servers(self) -> None:
        """The server loop: warm each server of the plan's base once it turns ready."""
        while True:
            await self.check_servers()
            await asyncio.sleep(self.server_poll_seconds)

    async def check_servers(self) -> list[str]:
        """Warm servers that turned ready since the last check; return their URLs."""
        plan = self._watch.plan
        if plan is None or self.discovery is None:
            return []
        try:
            seen = await self.discovery.servers(plan.base_model)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.warning("cannot list the servers on this node: %s", e)
            return []
        for sid, (url, ready) in seen.items():
            if not ready:
                self._ready.pop(sid, None)  # warm it again when it comes back
        for sid in set(self._ready) - set(seen):
            del self._ready[sid]
        new = [(sid, url) for sid, (url, ready) in seen.items() if ready and sid not in self._ready]
        for _, url in new:
            log.info("server %s is ready: loading its pinned set", url)
        # Side by side: a server that hangs must not hold up the warm-up of the others.
        results = await asyncio.gather(*(self.warm_server(url) for _, url in new))
        warmed = []
        for (sid, url), res in zip(new, results):
            if any(r.unreachable for r in res):  # it did not answer: try again at the next check
                continue
            self._ready[sid] = url
            warmed.append(url)
        return warmed

    async def warm_server(self, url: str) -> list[WarmResult]:
        """Take back the pins an earlier plan made that this one does not, then ask the server
        at `url` to load (and pin) the pinned set, then the plan's prefetch entries, in that
        order. A call it does not answer at all (refused, timed out) ends the warm-up: the
        calls left are reported skipped, not made one timeout each."""
        plan = self._watch.plan
        if plan is None:
            return []
        calls: list[tuple[str, str]] = [(name, "unpin") for name in sorted(self._unpin)]
        results = []
        for name in plan.pinned:
            if self.store.get(name, self.namespace) is None:
                results.append(WarmResult(name, "prefetch", False, "not staged on this node"))
                continue
            calls += [(name, "prefetch"), (name, "pin")]
        for name in plan.due_prefetch(self._now()):
            if name not in plan.pinned and self.store.get(name, self.namespace) is not None:
                calls.append((name, "prefetch"))
        for i, (name, action) in enumerate(calls):
            result = await self.call_server(url, name, action)
            results.append(result)
            if result.unreachable:
                results += [WarmResult(n, a, False, f"skipped: the server did not answer ({result.detail})",
                                       unreachable=True) for n, a in calls[i + 1:]]
                break
        return results

    def _server_headers(self) -> dict[str, str]:
        plan = self.plan
        key = self._server_keys.key_for(self.namespace, plan.base_model if plan is not None else None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def call_server(self, url: str, name: str, action: str) -> WarmResult:
        """POST <url>/v1/adapters/<name>/<action> (prefetch without waiting for the load)."""
        path = f"/v1/adapters/{urllib.parse.quote(name)}/{action}"
        if action == "prefetch":
            path += "?wait=false"
        unreachable = unknown = False
        try:
            async with self._session.post(url.rstrip("/") + path, headers=self._server_headers(),
                                          timeout=aiohttp.ClientTimeout(total=self.server_timeout_seconds)) as r:
                # (an unpin of an adapter the server does not know has nothing to undo)
                ok = 200 <= r.status < 300 or (action == "unpin" and r.status == 404)
                detail = "" if ok else f"{r.status}: {(await r.text())[:200]}"
                unknown = r.status == 404
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, detail = False, f"{type(e).__name__}: {str(e) or f'no answer in {self.server_timeout_seconds:g} s'}"
            unreachable = not isinstance(e, aiohttp.ClientResponseError)
        self.metrics.server_calls.labels(action, "ok" if ok else "error").inc()
        if not ok and unknown:
            # A server that follows the plan file loads and pins the plan's adapters itself; it
            # may not have read the plan yet (the kubelet updates a mounted ConfigMap up to a
            # minute after the API has it, where this agent reads it).
            log.info("%s %s on %s: the server does not know it (yet): %s", action, name, url, detail)
        elif not ok:
            log.warning("%s %s on %s failed: %s", action, name, url, detail)
        return WarmResult(name, action, ok, detail, unreachable)

    # -- sessions -----------------------------------------------------------------------------

    async def start_session(self, name: str) -> tuple[StagedAdapter, list[WarmResult]]:
        """Stage `name` (from the plan) and prefetch it into this node's ready servers."""
        plan = self._watch.plan
        if plan is None or name not in plan.adapters:
            raise StoreError("UnknownAdapter", f"adapter {name!r} is not in this node's plan")
        ref = plan.adapters[name].ref
        reason = self._watch.reasons.get(name)
        if reason in BAD_ADAPTER and self._watch.failed_for_good.get(name) == ref:
            # The same source gives the same bytes: the failure stands until the plan changes
            # the adapter (a download per session start would only repeat it).
            raise StoreError(reason, self._watch.errors[name].removeprefix(f"{reason}: "))
        staged = await self._stage(ref)
        results = await asyncio.gather(*(self.call_server(url, name, "prefetch") for url in list(self._ready.values())))
        return staged, list(results)
