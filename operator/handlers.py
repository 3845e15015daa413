"""kopf handlers: wire BaseModel / LoRAAdapter events to the planner.

    LoRAAdapter  create / update / resume / delete (finalizer)  -> reconcile its base
    LoRAAdapter  any event (node agents patch status.nodes)     -> reconcile if Staged / Ready move
    LoRAAdapter  deleted (gone), its base's plan still holds it -> reconcile (deleted before its finalizer)
                 or its spec was invalid                       -> reconcile (its base's rejectedCount)
    BaseModel    create / update / resume                      -> Deployment + Service, reconcile
    BaseModel    delete (finalizer)                            -> its plan's mirror deleted
    BaseModel    deleted                                        -> its adapters go Pending
    BaseModel    daemon                                         -> reconcile when a warm-up window opens or ends;
                                                                   every RESYNC_SECONDS also repair its workloads
    Deployment   readiness (ours, by label)                    -> reconcile its base; deleted: recreated

    startup      with a mirror namespace, then every RESYNC_SECONDS -> mirrors of BaseModels gone deleted

The indices hold every BaseModel and LoRAAdapter as small parsed records, so a handler
never lists objects (the mirror sweep lists the mirrors, and the BaseModels they name).
Run with `kopf run -m loraplex.operator` or `loraplex-operator`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from loraplex.operator import kube, liveness, status as statuses, workloads
from loraplex.operator.cli import mirror_namespace_from_env
from loraplex.operator.packing import pack
from loraplex.operator.reconciler import AdapterRecord, BaseRecord, Planner, utcnow
from loraplex.operator.specs import GROUP, VERSION, AdapterSpec, BaseModelSpec, SpecError

logger = logging.getLogger(__name__)

BASEMODELS = (GROUP, VERSION, "basemodels")
ADAPTERS = (GROUP, VERSION, "loraadapters")
OURS = {"app.kubernetes.io/managed-by": workloads.MANAGED_BY}
FINALIZER = "loraplex.io/operator"
ANNOTATIONS_PREFIX = "operator.loraplex.io"
# Longest a BaseModel's daemon sleeps between plans when no warm-up window is due (seconds);
# each run also re-reads the ConfigMap, so a plan deleted by hand comes back, and puts back
# its Deployment and Service (deleted, edited, or held up by a name conflict or a refusal).
RESYNC_SECONDS = 300.0


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # A handler's failure (an invalid spec, a write refused) as a Warning event on its object,
    # where `kubectl describe` shows it; its successes are not worth an event each. kopf 1.45
    # posts no log message as an event unless told to (`loggers`), older kopf posts INFO too.
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATIONS_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATIONS_PREFIX, key="last-handled-configuration")
    if "plan_mirror_namespace" not in memo:  # `kopf run -m loraplex.operator`: not through cli.main
        try:
            memo.plan_mirror_namespace = mirror_namespace_from_env()
        except ValueError as exc:
            raise kopf.PermanentError(str(exc)) from exc
    if "planner" not in memo:
        memo.planner = Planner(kube.KubeClient(kube.login(settings), relogin=lambda: kube.login(settings)),
                               mirror_namespace=memo.get("plan_mirror_namespace"))
    if memo.planner.mirror_namespace is not None and "mirror_sweep" not in memo:
        memo.mirror_sweep = asyncio.get_running_loop().create_task(
            _sweep_mirrors(memo.planner, float(memo.get("mirror_sweep_seconds") or RESYNC_SECONDS)),
            name="plan mirror sweep")


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """The operator's image has no Kubernetes client library: service account, else kubeconfig."""
    return kube.login(settings)


@kopf.on.startup()
async def serve_liveness(memo: kopf.Memo, **_: Any) -> None:
    """The liveness endpoint on every address of both families, when the command line asks
    for one with an empty host (cli.liveness_endpoints; kopf's own binds one address)."""
    if memo.get("liveness") and "liveness_runner" not in memo:
        memo.liveness_runner = await liveness.serve(memo.liveness)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    if "mirror_sweep" in memo:
        memo.mirror_sweep.cancel()
        await asyncio.gather(memo.mirror_sweep, return_exceptions=True)
    if "planner" in memo:
        await memo.planner.client.close()
    if "liveness_runner" in memo:
        await memo.liveness_runner.cleanup()


# Indices: (namespace, base name) -> records. kopf fills them before any handler runs.

@kopf.index(*BASEMODELS)
def basemodels(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[tuple[str, str], BaseRecord]:
    return {(namespace, name): BaseRecord.from_body(body)}


@kopf.index(*ADAPTERS)
def adapters_by_base(body: kopf.Body, namespace: str, **_: Any) -> dict[tuple[str, str], AdapterRecord]:
    record = AdapterRecord.from_body(body)
    return {(namespace, record.base_model): record}


# LoRAAdapter

@kopf.on.create(*ADAPTERS)
@kopf.on.update(*ADAPTERS)
@kopf.on.resume(*ADAPTERS)
async def adapter_changed(body: kopf.Body, old: Any, namespace: str, memo: kopf.Memo, patch: kopf.Patch,
                          basemodels: kopf.Index, adapters_by_base: kopf.Index, **_: Any) -> None:
    planner: Planner = memo.planner
    previous = ((old or {}).get("spec") or {}).get("baseModel")
    try:
        spec = AdapterSpec.from_body(body)
    except SpecError as exc:
        planner.forget_status(body.get("metadata", {}).get("uid", ""))
        patch.status.update({**_invalid_status(body, str(exc), phase="Rejected"), "pinned": False})
        # A planned adapter edited into an invalid spec leaves its base's plan now (the
        # index no longer holds its spec), not at the next resync.
        for base in {str(b) for b in ((body.get("spec") or {}).get("baseModel"), previous) if b}:
            await planner.reconcile((namespace, base), basemodels, adapters_by_base)
        raise kopf.PermanentError(f"invalid LoRAAdapter spec: {exc}") from exc
    await planner.reconcile((namespace, spec.base_model), basemodels, adapters_by_base)
    if previous and previous != spec.base_model:
        await planner.reconcile((namespace, previous), basemodels, adapters_by_base)


@kopf.on.delete(*ADAPTERS)
async def adapter_deleted(body: kopf.Body, namespace: str, memo: kopf.Memo,
                          basemodels: kopf.Index, adapters_by_base: kopf.Index, **_: Any) -> None:
    """The finalizer: release the adapter only once a plan without it is written, so servers
    unpin it and node agents unstage it."""
    base = (body.get("spec") or {}).get("baseModel")
    if base:
        await memo.planner.reconcile((namespace, base), basemodels, adapters_by_base)


@kopf.on.event(*ADAPTERS)
async def adapter_staging(event: kopf.RawEvent, body: kopf.Body, namespace: str, memo: kopf.Memo,
                          basemodels: kopf.Index, adapters_by_base: kopf.Index, **_: Any) -> None:
    """Node agents merge-patch status.nodes.<node>: re-plan when that moves Staged / Ready.

    The planner stays the one writer of the operator's part of adapter statuses, so a
    staging event and a priority change never race to write different `pinned` values.

    DELETED: re-plan if its base's plan still holds it. One deleted through the finalizer
    left the plan in `adapter_deleted`; but kopf indexes an adapter from its first event and
    puts the finalizer on only after that, so one deleted in between is planned (by any other
    reconcile of its base) and goes at once, with no handler: nothing else would drop it.
    """
    planner: Planner = memo.planner
    if event.get("type") == "DELETED":
        name = body.get("metadata", {}).get("name")
        base = (body.get("spec") or {}).get("baseModel")
        plan = planner.plan_of((namespace, str(base))) if base else None
        invalid = AdapterRecord.from_body(body).spec is None  # counted in its base's rejectedCount
        if plan is not None and (name in plan.verdicts or invalid):  # the index no longer holds it
            await planner.reconcile_or_retry((namespace, str(base)), basemodels, adapters_by_base)
        return
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    record = AdapterRecord.from_body(body)
    key = (namespace, record.base_model)
    plan = planner.plan_of(key)
    if plan is None or record.spec is None or record.spec.name not in plan.verdicts:
        return  # not planned yet: the reconcile that plans it writes its whole status
    ready = planner.state(key).ready_replicas > 0
    desired = statuses.adapter_status(record.spec, plan.verdicts[record.spec.name], plan,
                                      record.status, ready, utcnow(), planner.state(key).unwritten)
    if statuses.differs(record.status, desired):
        await planner.reconcile_or_retry(key, basemodels, adapters_by_base)


# BaseModel

@kopf.on.create(*BASEMODELS)
@kopf.on.update(*BASEMODELS)
@kopf.on.resume(*BASEMODELS)
async def basemodel_changed(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, patch: kopf.Patch,
                            logger: logging.Logger, basemodels: kopf.Index, adapters_by_base: kopf.Index,
                            **_: Any) -> None:
    try:
        base = BaseModelSpec.from_body(body)
    except SpecError as exc:
        patch.status.update(_invalid_status(body, str(exc), phase="Failed"))
        await memo.planner.reconcile((namespace, name), basemodels, adapters_by_base)  # -> BaseModelInvalid
        raise kopf.PermanentError(f"invalid BaseModel spec: {exc}") from exc
    planner: Planner = memo.planner
    try:
        problem = await _ensure_workloads(planner.client, base, body, logger)
    except kube.KubeError as exc:
        raise kopf.TemporaryError(f"writing the serving workloads: {exc}", delay=5) from exc
    planner.state((namespace, name)).workload_error = problem
    planner.forget_written((namespace, name))
    await planner.reconcile((namespace, name), basemodels, adapters_by_base)
    if problem is not None:
        # The status says why. Not a delayed retry: that would hold the next spec change back
        # for its delay; the daemon's resync tries again for what is lifted elsewhere (the
        # other owner's object deleted, an admission policy changed).
        raise kopf.PermanentError(problem[1])


@kopf.on.delete(*BASEMODELS)
async def basemodel_deleted(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer: its plan's mirror goes with it (an owner reference cannot name an owner in
    another namespace, so the garbage collector would not delete it); its other objects are
    the garbage collector's."""
    try:
        await memo.planner.delete_mirror((namespace, name))
    except kube.KubeError as exc:
        raise kopf.TemporaryError(f"deleting the mirror of its plan: {exc}", delay=5) from exc


@kopf.on.event(*BASEMODELS)
async def basemodel_gone(event: kopf.RawEvent, namespace: str, name: str, memo: kopf.Memo,
                         basemodels: kopf.Index, adapters_by_base: kopf.Index, **_: Any) -> None:
    """Its adapters go back to Pending (BaseModelNotFound); owned objects are garbage-collected."""
    if event.get("type") == "DELETED":
        await memo.planner.reconcile_or_retry((namespace, name), basemodels, adapters_by_base)


@kopf.daemon(*BASEMODELS, cancellation_timeout=5.0)
async def follow_warmup_windows(namespace: str, name: str, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                                basemodels: kopf.Index, adapters_by_base: kopf.Index, **_: Any) -> None:
    """Re-plan when a warm-up window opens (minus its lead) or ends, and every RESYNC_SECONDS."""
    planner: Planner = memo.planner
    key = (namespace, name)
    state = planner.state(key)
    resync = planner.clock() + datetime.timedelta(seconds=RESYNC_SECONDS)
    while not stopped:
        due = resync if state.wakeup is None else min(resync, state.wakeup)
        delay = max(0.0, (due - planner.clock()).total_seconds())
        state.wake.clear()
        if await _sleep(delay, state.wake, stopped):
            continue  # woken: stopping, or the wake-up time moved and we sleep until the new one
        if resync <= planner.clock():  # the resync (not only a warm-up window's wake-up)
            resync = planner.clock() + datetime.timedelta(seconds=RESYNC_SECONDS)
            planner.forget_written(key)
            await _repair_workloads(planner, key, basemodels)
        await planner.reconcile(key, basemodels, adapters_by_base)


async def _ensure_workloads(client: kube.KubeClient, base: BaseModelSpec, owner: Mapping[str, Any],
                            log: logging.Logger) -> tuple[str, str] | None:
    """Create the serving Deployment and Service of `base`, or put back what differs.

    Returns (reason, message) for the base's status when one could not be written for a
    reason a retry cannot lift: NameConflict (another owner's object has the name, left
    alone: `kube.NotOwned`) or WorkloadInvalid (the API server refused it, e.g. for what
    spec.serving put in it); None when both are written. Other errors raise KubeError.
    """
    autoscaler = workloads.autoscaler(base)
    children = [workloads.deployment(base, pack(base).slots), workloads.service(base),
                *([autoscaler] if autoscaler is not None else [])]
    kopf.adopt(children, owner=owner)  # type: ignore[arg-type]
    problems: list[tuple[str, str]] = []
    if autoscaler is None:
        await _remove_autoscaler(client, base, children[0], log)
    for child in children:
        where = f"{child['kind']} {base.namespace}/{child['metadata']['name']}"
        try:
            outcome = await client.ensure(child)
        except kube.NotOwned as exc:
            problems.append(("NameConflict", exc.message))
            continue
        except kube.KubeError as exc:
            if exc.status not in (400, 422):
                raise
            problems.append(("WorkloadInvalid", f"{where} refused by the API server: {exc.message}"))
            continue
        if outcome != "unchanged":
            log.info("%s %s", where, outcome)
    if not problems:
        return None
    reason = "WorkloadInvalid" if any(r == "WorkloadInvalid" for r, _ in problems) else "NameConflict"
    return reason, "; ".join(message for _, message in problems)


async def _remove_autoscaler(client: kube.KubeClient, base: BaseModelSpec, deployment: Mapping[str, Any],
                             log: logging.Logger) -> None:
    """Delete the HorizontalPodAutoscaler of `base` that serving.autoscaling made, now that it
    has none (the Deployment's replica count is the operator's again); one of another owner's
    under that name is left alone."""
    path = kube.AUTOSCALERS.path(base.namespace, base.name)
    try:
        existing = await client.get(path)
    except kube.KubeError as exc:
        if exc.status == 403:  # a ClusterRole from before serving.autoscaling: it could not have made one
            return
        raise
    if existing is None or workloads.foreign_owner(existing, deployment) is not None:
        return
    if await client.delete(path):
        log.info("HorizontalPodAutoscaler %s/%s deleted (no serving.autoscaling)", base.namespace, base.name)


async def _repair_workloads(planner: Planner, key: tuple[str, str], basemodels: kopf.Index) -> None:
    """Recreate or repair the workloads of a live BaseModel (one deleted or edited by hand).
    Not for a base being deleted: its objects are the garbage collector's to remove."""
    record: BaseRecord | None = next(iter(basemodels.get(key, ())), None)
    if record is None or record.spec is None or record.deleting:
        return
    try:
        problem = await _ensure_workloads(planner.client, record.spec, record.owner(), logger)
    except kube.KubeError as exc:
        logger.warning("repairing the serving workloads of %s/%s: %s (retried at the next resync)",
                       key[0], key[1], exc)
        return
    state = planner.state(key)
    if problem != state.workload_error:
        state.workload_error = problem
        planner.forget_written(key)  # the base's status changes with it


async def _sweep_mirrors(planner: Planner, every: float) -> None:
    """Planner.sweep_mirrors at start and then every `every` seconds, for as long as the
    operator runs; a failed sweep is logged and the next one tries again."""
    while True:
        try:
            await planner.sweep_mirrors()
        except kube.KubeError as exc:
            logger.warning("sweeping the plan mirrors in %s: %s (tried again in %.0fs)",
                           planner.mirror_namespace, exc, every)
        except Exception:
            logger.exception("sweeping the plan mirrors in %s failed (tried again in %.0fs)",
                             planner.mirror_namespace, every)
        await asyncio.sleep(every)


async def _sleep(delay: float, wake: asyncio.Event, stopped: kopf.DaemonStopped) -> bool:
    """Sleep `delay` seconds; True if `wake` or `stopped` ended it early."""
    async def stopping() -> None:
        await stopped.wait()

    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopping())}
    try:
        done, _ = await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return bool(done)


# Serving Deployments

@kopf.on.event("apps", "v1", "deployments", labels=OURS)
async def deployment_readiness(event: kopf.RawEvent, body: kopf.Body, namespace: str, memo: kopf.Memo,
                               basemodels: kopf.Index, adapters_by_base: kopf.Index, **_: Any) -> None:
    base = body.get("metadata", {}).get("labels", {}).get(workloads.BASE_LABEL)
    if not base:
        return
    deleted = event.get("type") == "DELETED"
    ready = 0 if deleted else int((body.get("status") or {}).get("readyReplicas") or 0)
    planner: Planner = memo.planner
    if deleted:  # by hand, or its base is going: recreated in the first case only
        await _repair_workloads(planner, (namespace, base), basemodels)
    if planner.set_ready_replicas((namespace, base), ready):
        await planner.reconcile_or_retry((namespace, base), basemodels, adapters_by_base)


def _invalid_status(body: kopf.Body, message: str, phase: str) -> dict[str, Any]:
    """Accepted and Ready False / InvalidSpec; the other conditions (Staged) kept as they were."""
    generation = int(body.get("metadata", {}).get("generation") or 0)
    old = list((body.get("status") or {}).get("conditions") or ())
    kept = [c for c in old if c.get("type") not in ("Accepted", "Ready")]
    conds = [statuses.condition("Accepted", False, "InvalidSpec", message, generation), *kept,
             statuses.condition("Ready", False, "InvalidSpec", message, generation)]
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "observedGeneration": generation,
        "phase": phase,
        "conditions": statuses.merge_conditions(old, conds, now),
    }
