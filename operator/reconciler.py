"""Recompute one base's plan and write what changed: the plan ConfigMap and statuses.

Every event that can move a plan (an adapter created, changed or deleted; a BaseModel
changed; a Deployment's readiness; a warm-up window opening) asks for the same thing:
`Planner.reconcile((namespace, base))`. Requests for one base are coalesced: a run reads
the kopf indices as they are when it starts, so every request made before that moment is
served by it, and 10,000 adapters resumed at start-up cost one plan, not 10,000.

A run writes only what differs: the ConfigMap when the plan's JSON changed (and its mirror,
with a mirror namespace), an adapter's status when its pinning or verdict changed, the
BaseModel's status when its summary did.
The fan-out goes through `KubeClient`, not each handler's `patch`: one run writes the
status of many objects, most of which are not the object the handler runs for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import kopf

from loraplex.operator import kube, status as statuses, workloads
from loraplex.operator.plan import Plan, build_plan, next_wakeup
from loraplex.operator.specs import API_VERSION, AdapterSpec, BaseModelSpec, SpecError
from loraplex.operator.validation import read_adapter_config
from loraplex.server.plan_file import (PLAN_BASE_ANNOTATION, PLAN_MIRROR_LABEL, PLAN_NAMESPACE_ANNOTATION,
                                       PLAN_OF_ANNOTATION)

logger = logging.getLogger(__name__)

BaseKey = tuple[str, str]  # (namespace, BaseModel name)
# A reconcile that failed where kopf does not retry (an event handler) is run again from the
# background after this many seconds, doubling up to RETRY_MAX_SECONDS until it succeeds.
RETRY_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0


@dataclasses.dataclass(frozen=True)
class BaseRecord:
    """A BaseModel as the index holds it: the parsed spec (None if invalid) and its status."""

    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str]
    spec: BaseModelSpec | None
    error: str | None
    status: Mapping[str, Any]
    deleting: bool = False  # deletionTimestamp set: its owned objects are being collected

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> BaseRecord:
        meta = body.get("metadata") or {}
        try:
            spec, error = BaseModelSpec.from_body(body), None
        except SpecError as exc:
            spec, error = None, str(exc)
        return cls(str(meta.get("namespace") or "default"), str(meta.get("name")), str(meta.get("uid") or ""),
                   dict(meta.get("labels") or {}), spec, error, dict(body.get("status") or {}),
                   bool(meta.get("deletionTimestamp")))

    def owner(self) -> dict[str, Any]:
        """A body for `kopf.adopt`: enough to write an owner reference."""
        return {"apiVersion": API_VERSION, "kind": "BaseModel",
                "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid,
                             "labels": dict(self.labels)}}


@dataclasses.dataclass(frozen=True)
class AdapterRecord:
    namespace: str
    name: str
    uid: str
    base_model: str
    spec: AdapterSpec | None
    error: str | None
    status: Mapping[str, Any]
    deleting: bool = False  # deletionTimestamp set (as spec.deleting, which an invalid spec has none of)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> AdapterRecord:
        meta = body.get("metadata") or {}
        try:
            spec: AdapterSpec | None = AdapterSpec.from_body(body)
            error = None
            assert spec is not None
            if spec.rank is None or spec.target_modules is None:
                spec = spec.with_metadata(*read_adapter_config(spec.source))
        except SpecError as exc:
            spec, error = None, str(exc)
        return cls(str(meta.get("namespace") or "default"), str(meta.get("name")), str(meta.get("uid") or ""),
                   str((body.get("spec") or {}).get("baseModel") or ""), spec, error,
                   dict(body.get("status") or {}), bool(meta.get("deletionTimestamp")))

    def with_local_metadata(self) -> AdapterRecord:
        """This record with rank and modules read again from a local adapter_config.json, if
        they are still unknown: the index read it at the object's last event, and a file that
        was not there yet (copied after the object was applied) would otherwise keep the
        adapter Pending (MetadataUnknown) until its object next changes."""
        spec = self.spec
        if spec is None or (spec.rank is not None and spec.target_modules is not None):
            return self
        found = spec.with_metadata(*read_adapter_config(spec.source))
        return self if found == spec else dataclasses.replace(self, spec=found)


@dataclasses.dataclass
class _BaseState:
    """Per-base coalescing and what the last run computed."""

    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    requested: int = 0
    done: int = 0
    runs: int = 0  # how many times the plan was computed (for logs and tests)
    plan: Plan | None = None
    written_json: str | None = None  # the plan JSON known to be in the ConfigMap
    mirrored_json: str | None = None  # the plan JSON known to be in its mirror (with a mirror namespace)
    # Statuses this process wrote, by object uid: the index may not have seen them yet.
    written_status: dict[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    # The last status this process wrote to each object, kept when `forget_written` drops the
    # above: while the index lags behind, the conditions' times and the Warning events go by it.
    last_status: dict[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    ready_replicas: int = 0
    wakeup: datetime.datetime | None = None
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    retry: asyncio.Task[None] | None = None  # a background re-run after a failed one
    workload_error: tuple[str, str] | None = None  # (reason, message): its Deployment / Service not written
    unwritten: statuses.Unwritten | None = None  # the last run's plan was not written: what is followed instead
    failed_writes: list[str] = dataclasses.field(default_factory=list)  # statuses the last run could not write


Indices = Mapping[Any, Iterable[Any]]  # kopf.Index: key -> store of values
Clock = Callable[[], datetime.datetime]


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class Planner:
    """Coalesced reconciles per base; state survives only in memory (a restart recomputes).

    `mirror_namespace`: where each plan is also written as a mirror (workloads.plan_mirror)
    for the node agents to find by label; None writes none."""

    def __init__(self, client: kube.KubeClient, clock: Clock = utcnow, mirror_namespace: str | None = None) -> None:
        self.client = client
        self.clock = clock
        self.mirror_namespace = mirror_namespace
        self._states: dict[BaseKey, _BaseState] = {}

    def state(self, key: BaseKey) -> _BaseState:
        if key not in self._states:
            self._states[key] = _BaseState()
        return self._states[key]

    def plan_of(self, key: BaseKey) -> Plan | None:
        return self._states[key].plan if key in self._states else None

    def set_ready_replicas(self, key: BaseKey, ready: int) -> bool:
        """Record a Deployment's readiness; True if it changed (so the caller reconciles)."""
        state = self.state(key)
        changed = state.ready_replicas != ready
        state.ready_replicas = ready
        return changed

    def forget_written(self, key: BaseKey) -> None:
        """Drop what we know we wrote, so the next run compares with the API's state again."""
        state = self.state(key)
        state.written_json = None
        state.mirrored_json = None
        state.written_status.clear()

    def forget_status(self, uid: str) -> None:
        """Another writer (an invalid-spec handler) set this object's status."""
        for state in self._states.values():
            state.written_status.pop(uid, None)
            state.last_status.pop(uid, None)

    async def reconcile(self, key: BaseKey, basemodels: Indices, adapters: Indices) -> Plan | None:
        """Bring the plan of `key` and every status it decides up to date with the indices."""
        state = self.state(key)
        state.requested += 1
        ticket = state.requested
        async with state.lock:
            if state.done >= ticket:
                return state.plan  # a run that started after our request covered it
            target = state.requested
            state.runs += 1
            try:
                state.failed_writes = await self._run(key, state, basemodels, adapters)
            except kube.KubeError as exc:
                raise kopf.TemporaryError(f"writing the plan of {key[0]}/{key[1]}: {exc}", delay=5) from exc
            state.done = target
        if state.failed_writes:
            # The plan is written: the statuses that were not are written again from the
            # background, so that one object refusing them holds up no handler (a finalizer).
            self._retry_later(key, basemodels, adapters, "; ".join(state.failed_writes))
        return state.plan

    async def reconcile_or_retry(self, key: BaseKey, basemodels: Indices, adapters: Indices) -> None:
        """`reconcile` for callers kopf does not retry (event handlers): when it fails, it is run
        again from the background until it succeeds, so a transient API error does not leave
        statuses stale until some later event (after a BaseModel is gone, none comes)."""
        try:
            await self.reconcile(key, basemodels, adapters)
        except kopf.TemporaryError as exc:
            self._retry_later(key, basemodels, adapters, str(exc))

    def _retry_later(self, key: BaseKey, basemodels: Indices, adapters: Indices, why: str) -> None:
        state = self.state(key)
        if state.retry is None or state.retry.done():
            logger.warning("%s; trying again in %.0fs", why, RETRY_SECONDS)
            state.retry = asyncio.get_running_loop().create_task(
                self._retry(key, basemodels, adapters), name=f"reconcile {key[0]}/{key[1]} again")

    async def _retry(self, key: BaseKey, basemodels: Indices, adapters: Indices) -> None:
        """Run the reconcile of `key` until it and every write it makes succeed (backing off)."""
        delay = RETRY_SECONDS
        while True:
            await asyncio.sleep(delay)
            try:
                await self.reconcile(key, basemodels, adapters)
                if not self.state(key).failed_writes:
                    return
                why = "; ".join(self.state(key).failed_writes)
            except kopf.TemporaryError as exc:
                why = str(exc)
            except Exception:
                logger.exception("reconciling %s/%s failed; not retried", *key)
                return
            delay = min(delay * 2, RETRY_MAX_SECONDS)
            logger.warning("%s; trying again in %.0fs", why, delay)

    async def _run(self, key: BaseKey, state: _BaseState, basemodels: Indices, adapters: Indices) -> list[str]:
        """One run; raises KubeError if the plan could not be written, returns the status
        writes that failed (each object's own, so one refusing its status stops no other)."""
        namespace, name = key
        failed: list[str] = []
        now = self.clock()
        base_records: list[BaseRecord] = list(basemodels.get(key, ()))
        adapter_records: list[AdapterRecord] = [r.with_local_metadata() for r in adapters.get(key, ())
                                                if r.spec is not None]
        base = base_records[0] if base_records else None

        if base is None or base.spec is None:
            state.plan = None
            for record in adapter_records:
                assert record.spec is not None
                if record.spec.deleting:
                    continue
                desired = statuses.orphan_status(record.spec, _known_status(state, record.uid, record.status), now,
                                                 base.error if base is not None else None)
                await self._patch_adapter(state, record, desired, failed)
            return failed

        started = now
        plan = build_plan(base.spec, [r.spec for r in adapter_records if r.spec is not None], now)
        logger.debug("planned %s/%s: %d adapters in %.3fs", namespace, name, len(plan.adapters),
                     (self.clock() - started).total_seconds())
        state.plan = plan  # before the writes: events they cause must see this plan
        plan_error, plan_error_reason = await self._write_config_map(base, plan, state, failed)
        state.unwritten = None if plan_error is None else \
            await self._followed_plan(base, state, plan_error_reason, plan_error)

        for record in adapter_records:
            assert record.spec is not None
            if record.spec.deleting:
                continue
            verdict = plan.verdicts[record.spec.name]
            desired = statuses.adapter_status(record.spec, verdict, plan,
                                              _known_status(state, record.uid, record.status),
                                              state.ready_replicas > 0, now, state.unwritten)
            await self._patch_adapter(state, record, desired, failed)

        cm_name = workloads.plan_config_map_name(name)
        known = _known_status(state, base.uid, base.status)
        desired_base = statuses.base_status(plan, known, state.ready_replicas, cm_name, now, plan_error,
                                            plan_error_reason, state.workload_error,
                                            invalid_adapters(adapters.get(key, ())))
        if statuses.differs(base.status, desired_base) and state.written_status.get(base.uid) != desired_base:
            try:
                await self.client.patch_status(kube.BASE_MODELS, namespace, name, desired_base)
                _warn_on_failure(base.owner(), known, desired_base, "Failed")
                state.written_status[base.uid] = state.last_status[base.uid] = desired_base
            except kube.KubeError as exc:
                failed.append(f"status of BaseModel {namespace}/{name}: {exc}")

        wakeup = next_wakeup(plan, now)
        if wakeup != state.wakeup:
            state.wakeup = wakeup
            state.wake.set()
        return failed

    async def _write_config_map(self, base: BaseRecord, plan: Plan, state: _BaseState,
                                failed: list[str]) -> tuple[str | None, str]:
        """Write the plan if it changed, and its mirror (a failure of which is added to
        `failed`, to be tried again); returns why the plan could not be written, if so, and a reason."""
        assert base.spec is not None
        text = plan.to_json()
        mirror = self.mirror_namespace is not None and not base.deleting  # (a BaseModel going: its mirror goes)
        if state.written_json == text and (not mirror or state.mirrored_json == text):
            return None, ""
        try:
            desired = workloads.plan_config_map(base.spec, text)
        except workloads.PlanTooLarge as exc:
            logger.error("plan %s/%s not written: %s", base.namespace, base.name, exc)
            return str(exc), "PlanTooLarge"  # the ConfigMap keeps the last plan that fit; the status says why
        mirrored = workloads.plan_mirror(desired, base.name, self.mirror_namespace) if mirror else None
        if state.written_json != text:
            kopf.adopt(desired, owner=base.owner())  # type: ignore[arg-type]
            try:
                outcome = await self.client.ensure(desired)
            except kube.NotOwned as exc:
                logger.error("plan %s/%s not written: %s", base.namespace, base.name, exc)
                return str(exc), "NameConflict"  # tried again at every run until the name is free
            if outcome != "unchanged":
                logger.info("plan %s/%s %s: %d adapters, %d pinned, %d slots", base.namespace,
                            desired["metadata"]["name"], outcome, len(plan.adapters),
                            len(plan.pinning.pinned), plan.slots)
            state.written_json = text
        if mirrored is not None and state.mirrored_json != text:
            where = f"{mirrored['metadata']['namespace']}/{mirrored['metadata']['name']}"
            try:
                outcome = await self.client.ensure(mirrored)
            except kube.NotOwned as exc:
                # Another object has its name: left alone, tried again at the next resync.
                logger.error("the mirror %s of plan %s/%s not written: %s", where, base.namespace, base.name, exc)
                state.mirrored_json = text
                return None, ""
            except kube.KubeError as exc:
                failed.append(f"the plan's mirror {where}: {exc}")
                return None, ""
            if outcome != "unchanged":
                logger.info("plan mirror %s %s", where, outcome)
            state.mirrored_json = text
        return None, ""

    async def _followed_plan(self, base: BaseRecord, state: _BaseState, reason: str,
                             message: str) -> statuses.Unwritten:
        """The plan could not be written: the servers and agents follow the one in its ConfigMap,
        the last this process wrote or, after a restart, as read back (none of ours: NameConflict)."""
        followed: Mapping[str, Any] = {}
        if reason == "NameConflict":
            pass  # the servers mount another owner's ConfigMap: no plan of ours
        elif state.written_json is not None:
            followed = json.loads(state.written_json)
        else:
            try:
                found = await self.client.get(kube.CONFIG_MAPS.path(base.namespace,
                                                                    workloads.plan_config_map_name(base.name)))
                followed = workloads.read_plan(found) if found else {}
            except (kube.KubeError, KeyError, ValueError) as exc:
                logger.warning("the plan ConfigMap of %s/%s could not be read: %s", base.namespace, base.name, exc)
        return statuses.Unwritten(reason, message, frozenset(a["name"] for a in followed.get("adapters") or ()),
                                  frozenset(followed.get("pinned") or ()))

    async def delete_mirror(self, key: BaseKey) -> bool:
        """Delete the mirror of `key`'s plan (its BaseModel is being deleted); True if there was
        one. An object under its name that is not that plan's mirror is left alone."""
        if self.mirror_namespace is None:
            return False
        self.state(key).mirrored_json = None
        path = kube.CONFIG_MAPS.path(self.mirror_namespace, workloads.plan_mirror_name(*key))
        existing = await self.client.get(path)
        source = f"{key[0]}/{workloads.plan_config_map_name(key[1])}"
        if existing is None or ((existing.get("metadata") or {}).get("annotations") or {}).get(
                PLAN_OF_ANNOTATION) != source:
            return False
        deleted = await self.client.delete(path)
        if deleted:
            logger.info("plan mirror %s/%s deleted with its BaseModel %s/%s", self.mirror_namespace,
                        workloads.plan_mirror_name(*key), *key)
        return deleted

    async def sweep_mirrors(self) -> list[str]:
        """Delete the mirrors in the mirror namespace whose BaseModel is gone (or going), or
        that are not under the name the operator writes for their plan; returns their names.

        A BaseModel's deletion deletes its mirror (its finalizer waits for it), so what this
        finds is what that missed: a finalizer removed by hand, a mirror namespace changed
        back and forth, a mirror of an older naming. Whether a BaseModel exists is asked of
        the API (a list per source namespace), not of this process's indices, which need
        not hold the namespaces of every mirror (an operator serving some namespaces)."""
        if self.mirror_namespace is None:
            return []
        mirrors = await self.client.list_objects(kube.CONFIG_MAPS, self.mirror_namespace,
                                                 f"{PLAN_MIRROR_LABEL}=true")
        by_namespace: dict[str, list[tuple[str, str]]] = {}  # source namespace -> [(base, mirror name)]
        for cm in mirrors:
            meta = cm.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            namespace, base = annotations.get(PLAN_NAMESPACE_ANNOTATION), annotations.get(PLAN_BASE_ANNOTATION)
            if (meta.get("labels") or {}).get("app.kubernetes.io/managed-by") != workloads.MANAGED_BY \
                    or not namespace or not base:
                continue  # not one the operator wrote
            by_namespace.setdefault(str(namespace), []).append((str(base), str(meta.get("name"))))
        deleted: list[str] = []
        for namespace, entries in sorted(by_namespace.items()):
            live = {str((b.get("metadata") or {}).get("name"))
                    for b in await self.client.list_objects(kube.BASE_MODELS, namespace)
                    if not (b.get("metadata") or {}).get("deletionTimestamp")}
            for base, name in entries:
                if base in live and name == workloads.plan_mirror_name(namespace, base):
                    continue
                if await self.client.delete(kube.CONFIG_MAPS.path(self.mirror_namespace, name)):
                    logger.info("plan mirror %s/%s deleted: %s", self.mirror_namespace, name,
                                f"its BaseModel {namespace}/{base} is gone" if base not in live
                                else "not the name of its plan's mirror")
                    deleted.append(name)
                if (namespace, base) in self._states:  # written again by the next run, if it is live
                    self._states[(namespace, base)].mirrored_json = None
        return deleted

    async def _patch_adapter(self, state: _BaseState, record: AdapterRecord, desired: Mapping[str, Any],
                             failed: list[str]) -> None:
        if statuses.differs(record.status, desired) and state.written_status.get(record.uid) != desired:
            try:
                await self.client.patch_status(kube.ADAPTERS, record.namespace, record.name, desired)
            except kube.KubeError as exc:
                failed.append(f"status of LoRAAdapter {record.namespace}/{record.name}: {exc}")
                return
            ref = {"apiVersion": API_VERSION, "kind": "LoRAAdapter",
                   "metadata": {"name": record.name, "namespace": record.namespace, "uid": record.uid}}
            _warn_on_failure(ref, _known_status(state, record.uid, record.status), desired, "Rejected")
            state.written_status[record.uid] = state.last_status[record.uid] = desired


def invalid_adapters(records: Iterable[AdapterRecord]) -> int:
    """How many of a base's adapters have an invalid spec (Rejected by their own handler, in no
    plan's verdicts: the base's rejectedCount adds them), not counting those being deleted: an
    adapter being deleted counts in no count of its base, as `build_plan` leaves it out."""
    return sum(1 for r in records if r.spec is None and not r.deleting)


def _known_status(state: _BaseState, uid: str, indexed: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's status as this process knows it: the index's, under what this process last
    wrote to it. The index lags behind our own writes (an adapter's index entry is not updated
    while its own handler waits for the run that wrote it), so a run computing conditions from
    the index alone would stamp a new lastTransitionTime on a condition whose status it wrote a
    moment ago, and write it again. The node agents' `nodes` are not ours: the index's are kept.
    A status the index holds for a later generation than ours (an invalid-spec handler's) is newer."""
    written = state.last_status.get(uid)
    if written is None or int(indexed.get("observedGeneration") or 0) > int(written.get("observedGeneration") or 0):
        return indexed
    return {**indexed, **written}


def _warn_on_failure(ref: Mapping[str, Any], before: Mapping[str, Any] | None, after: Mapping[str, Any],
                     phase: str) -> None:
    """A Warning event when an object's status goes into `phase` (an adapter Rejected, a base
    Failed), so `kubectl describe` and `kubectl get events` say why it does nothing: its spec
    is valid, so no handler fails and kopf posts nothing. Once per transition, not per write."""
    if after.get("phase") != phase or (before or {}).get("phase") == phase:
        return
    why = next((c for c in after.get("conditions") or () if c.get("status") == "False"), None)
    if why is None:
        return
    try:
        kopf.event(dict(ref), type="Warning", reason=str(why.get("reason") or phase),
                   message=f"{why.get('type')}: {why.get('message') or ''}")
    except LookupError:  # not inside a running operator (the planner driven directly, in tests)
        pass
