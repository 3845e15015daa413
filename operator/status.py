"""Status the operator writes, by the Kubernetes API conventions.

Conditions `Accepted`, `Staged`, `Ready` (status "True"/"False"/"Unknown", a CamelCase
reason, a message, observedGeneration, lastTransitionTime), plus summary fields for
`kubectl get`. Everything here is a pure function of the plan and of what node agents and
Deployments report, so the same inputs give the same status and nothing is re-patched:
`lastTransitionTime` only moves when a condition's status flips.

Node agents own `status.nodes.<node>` of an adapter ({"phase": "Staged", "message": "",
"bytes": 41943040}); the operator reads it and never writes it.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from loraplex.operator import packing
from loraplex.operator.plan import Plan
from loraplex.operator.specs import AdapterSpec, format_time
from loraplex.operator.validation import Verdict, served_name, validate
from loraplex.operator.workloads import SERVER_PORT

CONDITION_TYPES = ("Accepted", "Staged", "Ready")


def condition(kind: str, status: bool | None, reason: str, message: str,
              generation: int) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "Unknown" if status is None else ("True" if status else "False"),
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def merge_conditions(old: Sequence[Mapping[str, Any]] | None, new: Sequence[Mapping[str, Any]],
                     now: datetime.datetime) -> list[dict[str, Any]]:
    """`new` with lastTransitionTime carried over from `old` where the status did not flip."""
    previous = {c.get("type"): c for c in old or ()}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        if before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime"):
            since = before["lastTransitionTime"]
        else:
            since = format_time(now)
        merged.append({**cond, "lastTransitionTime": since})
    return merged


def staging_summary(nodes: Mapping[str, Mapping[str, Any]] | None) -> tuple[bool | None, str, str]:
    """(staged, reason, message) from the node agents' reports under status.nodes."""
    nodes = nodes or {}
    staged = sorted(n for n, s in nodes.items() if (s or {}).get("phase") == "Staged")
    failed = sorted(n for n, s in nodes.items() if (s or {}).get("phase") == "Failed")
    if staged:
        message = f"staged on {len(staged)}/{len(nodes)} nodes"
        if failed:
            message += f"; failed on {', '.join(failed)}: {nodes[failed[0]].get('message', '')}"
        return True, "Staged", message
    if failed:
        first = failed[0]
        return False, "StagingFailed", f"failed on {', '.join(failed)}: {nodes[first].get('message', '')}"
    if nodes:
        return False, "Staging", f"staging on {len(nodes)} nodes"
    return None, "NotStaged", "no node agent has reported this adapter yet"


def adapter_size(plan: Plan | None, adapter: AdapterSpec,
                 nodes: Mapping[str, Mapping[str, Any]] | None) -> int | None:
    """Bytes on disk as node agents report them, else computed from the base's shape."""
    reported = [int(s["bytes"]) for s in (nodes or {}).values() if (s or {}).get("bytes")]
    if reported:
        return max(reported)
    if plan is None or plan.base.architecture is None or adapter.rank is None or not adapter.target_modules:
        return None
    try:
        size = packing.adapter_bytes(plan.base.architecture, adapter.target_modules,
                                   adapter.rank, plan.base.dtype_bytes)
    except ValueError:
        return None
    # The base's shape is checked for the modules it serves at maxLoraRank (packing.out_of_range):
    # an adapter of others, or of a larger rank (Rejected), can pass what the status holds.
    return size if size <= packing.INT64_MAX else None


@dataclasses.dataclass(frozen=True)
class Unwritten:
    """A plan that could not be written (`reason` PlanTooLarge or NameConflict, `message` why),
    and what the servers and node agents follow instead: the last plan written, its adapters
    and pinned set (empty when there is none of ours)."""

    reason: str
    message: str
    adapters: frozenset[str] = frozenset()
    pinned: frozenset[str] = frozenset()


def adapter_status(adapter: AdapterSpec, verdict: Verdict, plan: Plan | None,
                   current: Mapping[str, Any] | None, base_ready: bool,
                   now: datetime.datetime, unwritten: Unwritten | None = None) -> dict[str, Any]:
    """The operator's part of an adapter's status (everything but `nodes`). With `unwritten`,
    the plan was not written: an accepted adapter is pinned as the last plan written pins it,
    and one that plan lacks is Pending (PlanNotWritten), as no server or agent knows of it."""
    current = current or {}
    nodes = current.get("nodes")
    pinned = plan.is_pinned(adapter.name) if plan is not None and verdict.accepted else False
    behind = unwritten is not None and verdict.accepted
    if behind:
        assert unwritten is not None
        pinned = adapter.name in unwritten.pinned
        left_out = adapter.name not in unwritten.adapters
    gen = adapter.generation
    staged, staged_reason, staged_message = staging_summary(nodes)
    if not verdict.accepted:
        phase = verdict.phase
        ready = condition("Ready", False, verdict.reason, "not accepted for this base", gen)
    elif behind and left_out:
        phase = "Pending"
        ready = condition("Ready", False, "PlanNotWritten", "not in the plan the servers follow", gen)
    elif staged and base_ready:
        phase = "Ready"
        ready = condition("Ready", True, "Ready", "in the plan, staged, and servers are ready", gen)
    else:
        phase = "Staged" if staged else "Accepted"
        waiting = "servers not ready" if staged else "not staged on any node yet"
        ready = condition("Ready", False, "Waiting", waiting, gen)
    if pinned:
        accepted_message = verdict.message + "; pinned"
    elif plan is not None and adapter.name in plan.pinning.overflow:
        accepted_message = verdict.message + "; pinPolicy Always but the pinned share is full"
    else:
        accepted_message = verdict.message
    accepted = condition("Accepted", verdict.accepted if verdict.phase != "Pending" else None,
                         verdict.reason, accepted_message, gen)
    if behind:
        assert unwritten is not None
        why = f"the plan is not written ({unwritten.reason}: {unwritten.message}); the servers follow the last one written"
        accepted = condition("Accepted", False, "PlanNotWritten", f"{verdict.message}; but {why}, without it", gen) \
            if left_out else {**accepted, "message": f"{accepted_message}; {why}"}
    conditions = [
        accepted,
        condition("Staged", staged, staged_reason, staged_message, gen),
        ready,
    ]
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "phase": phase,
        "pinned": pinned,
        # A rank read from adapter_config.json has no schema's bounds: one past what the status
        # holds is Rejected (RankTooLarge names it) and written as unknown.
        "rank": adapter.rank if adapter.rank is None or adapter.rank <= packing.INT64_MAX else None,
        "sizeBytes": adapter_size(plan, adapter, nodes),
        "targetModules": list(adapter.target_modules) if adapter.target_modules else None,
        "conditions": merge_conditions(current.get("conditions"), conditions, now),
    }
    return status


def base_status(plan: Plan, current: Mapping[str, Any] | None, ready_replicas: int,
                plan_config_map: str, now: datetime.datetime, plan_error: str | None = None,
                plan_error_reason: str = "PlanTooLarge",
                workload_error: tuple[str, str] | None = None, invalid_adapters: int = 0) -> dict[str, Any]:
    """The BaseModel's status: packing outcome, pinned set, counts, conditions.

    `plan_error`: why the plan could not be written (`plan_error_reason`: PlanTooLarge for a
    ConfigMap, NameConflict when another owner's ConfigMap has its name), if so.
    `workload_error`: (reason, message) when its Deployment or Service could not be written
    (NameConflict, WorkloadInvalid), if so.
    `invalid_adapters`: adapters naming this base whose spec is invalid (Rejected, InvalidSpec:
    they are in no plan's verdicts), counted with the rejected ones.
    """
    current = current or {}
    base = plan.base
    gen = base.generation
    packed = plan.packing
    accepted_message = packed.message + (f"; hint: {plan.hint}" if plan.hint else "")
    # The replicas that make it Ready: its own count, the autoscaler's minimum, or one where
    # another controller sets the count (`replicas: null`).
    scaling = base.serving.autoscaling
    if scaling is not None:
        replicas = scaling.min_replicas
        wanted = f"{replicas} (autoscaled {scaling.min_replicas}-{scaling.max_replicas})"
    elif base.serving.replicas is None:
        replicas, wanted = 1, "1 (the count is another controller's)"
    else:
        replicas = base.serving.replicas
        wanted = str(replicas)
    if workload_error:
        ready = condition("Ready", False, workload_error[0], workload_error[1], gen)
    elif replicas == 0:
        ready = condition("Ready", False, "ScaledToZero", "serving.replicas is 0", gen)
    elif ready_replicas >= replicas:
        ready = condition("Ready", True, "ReplicasReady", f"{ready_replicas}/{wanted} replicas ready", gen)
    else:
        ready = condition("Ready", False, "ReplicasNotReady", f"{ready_replicas}/{wanted} replicas ready", gen)
    conditions = [
        condition("Accepted", packed.slots > 0, packed.reason, accepted_message, gen),
        condition("Staged", False, plan_error_reason, plan_error, gen) if plan_error else
        condition("Staged", True, "PlanWritten",
                  f"{len(plan.adapters)} adapters ({len(plan.pinning.pinned)} pinned) in ConfigMap"
                  f" {plan_config_map}", gen),
        ready,
    ]
    rejected = sum(1 for v in plan.verdicts.values() if v.phase == "Rejected") + invalid_adapters
    # The plan not written (too large, or its name taken) is Failed, as the CRD documents: the
    # servers and node agents follow an older plan, if any, not this one.
    failed = packed.slots == 0 or workload_error or plan_error
    phase = "Failed" if failed else ("Ready" if ready["status"] == "True" else "Planned")
    return {
        "observedGeneration": gen,
        "phase": phase,
        "slots": packed.slots,
        "slotBytes": packed.slot_bytes,
        "adapterRoomBytes": packed.room_bytes,
        "pinned": list(plan.pinning.pinned),
        "pinnedCount": len(plan.pinning.pinned),
        "adapterCount": len(plan.adapters),
        "rejectedCount": rejected,
        "maxRankInUse": plan.max_rank_in_use,
        "readyReplicas": ready_replicas,
        "planConfigMap": plan_config_map,
        # What a client sends: the base's `model` name and the Service's in-cluster address
        # (OpenAI clients take url + "/v1" as their base URL).
        "servedModelName": served_name(base),
        "url": f"http://{base.name}.{base.namespace}.svc:{SERVER_PORT}",
        "conditions": merge_conditions(current.get("conditions"), conditions, now),
    }


def orphan_status(adapter: AdapterSpec, current: Mapping[str, Any] | None,
                  now: datetime.datetime, base_error: str | None = None) -> dict[str, Any]:
    """Status of an adapter whose BaseModel does not exist (yet, or any more), or whose
    BaseModel's spec is invalid (`base_error`)."""
    verdict = validate(adapter, None)
    if base_error is not None:
        verdict = Verdict("Pending", "BaseModelInvalid", f"BaseModel {adapter.base_model!r} is invalid: {base_error}")
    return adapter_status(adapter, verdict, None, current, False, now)


def differs(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """Whether patching `desired` into `current` would change anything."""
    current = current or {}
    return any(current.get(key) != value for key, value in desired.items())
