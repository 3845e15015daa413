"""Status by the API conventions: conditions, phases, no churn on re-runs."""

import datetime

import pytest

from loraplex.operator.plan import build_plan
from loraplex.operator.specs import AdapterSpec, BaseModelSpec, Memory, Serving
from loraplex.operator.status import adapter_status, base_status, differs, merge_conditions, staging_summary
from loraplex.operator.validation import served_name, validate
from loraplex.operator.workloads import service

UTC = datetime.timezone.utc
T1 = datetime.datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
T2 = T1 + datetime.timedelta(minutes=5)
BASE = BaseModelSpec(name="b", namespace="ml", source="/m", max_lora_rank=16, memory=Memory(slots=4),
                     serving=Serving(replicas=2), generation=3)
A = AdapterSpec(name="a", namespace="ml", base_model="b", source="s3://a", priority=5, rank=8,
                target_modules=("q_proj",), generation=2)


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def test_transition_time_moves_only_on_a_flip():
    first = merge_conditions(None, [{"type": "Ready", "status": "False", "reason": "Waiting"}], T1)
    same = merge_conditions(first, [{"type": "Ready", "status": "False", "reason": "StillWaiting"}], T2)
    flipped = merge_conditions(same, [{"type": "Ready", "status": "True", "reason": "Ready"}], T2)
    assert first[0]["lastTransitionTime"] == same[0]["lastTransitionTime"] == "2026-12-01T08:00:00Z"
    assert flipped[0]["lastTransitionTime"] == "2026-12-01T08:05:00Z"


def test_staging_summary():
    assert staging_summary(None)[0] is None
    assert staging_summary({"n1": {"phase": "Staging"}})[:2] == (False, "Staging")
    assert staging_summary({"n1": {"phase": "Failed", "message": "sha256 mismatch"}}) == \
        (False, "StagingFailed", "failed on n1: sha256 mismatch")
    staged = staging_summary({"n1": {"phase": "Staged"}, "n2": {"phase": "Failed", "message": "disk full"}})
    assert staged[:2] == (True, "Staged") and "1/2 nodes" in staged[2] and "disk full" in staged[2]


def test_adapter_goes_accepted_staged_ready():
    plan = build_plan(BASE, [A], T1)
    verdict = plan.verdicts["a"]
    accepted = adapter_status(A, verdict, plan, None, False, T1)
    assert accepted["phase"] == "Accepted" and accepted["pinned"] is True and accepted["observedGeneration"] == 2
    assert conds(accepted)["Accepted"]["status"] == "True" and conds(accepted)["Staged"]["status"] == "Unknown"
    nodes = {"n1": {"phase": "Staged", "bytes": 1234}}
    staged = adapter_status(A, verdict, plan, {**accepted, "nodes": nodes}, False, T2)
    assert staged["phase"] == "Staged" and staged["sizeBytes"] == 1234
    ready = adapter_status(A, verdict, plan, {**staged, "nodes": nodes}, True, T2)
    assert ready["phase"] == "Ready" and conds(ready)["Ready"]["status"] == "True"
    # The Accepted condition did not flip, so its time stayed.
    assert conds(ready)["Accepted"]["lastTransitionTime"] == "2026-12-01T08:00:00Z"
    # A re-run with the same inputs changes nothing.
    assert not differs({**ready, "nodes": nodes}, adapter_status(A, verdict, plan, {**ready, "nodes": nodes}, True, T2))


def test_rejected_adapter_status_says_why():
    big = AdapterSpec(name="big", namespace="ml", base_model="b", source="s3://x", rank=64, target_modules=("q_proj",))
    status = adapter_status(big, validate(big, BASE), build_plan(BASE, [big], T1), None, True, T1)
    assert status["phase"] == "Rejected" and status["pinned"] is False
    assert conds(status)["Accepted"]["reason"] == "RankTooLarge"
    assert conds(status)["Ready"]["status"] == "False"


def test_base_status_summary():
    plan = build_plan(BASE, [A], T1)
    status = base_status(plan, None, 1, "b-plan", T1)
    assert (status["slots"], status["pinned"], status["pinnedCount"], status["adapterCount"]) == (4, ["a"], 1, 1)
    assert status["phase"] == "Planned" and conds(status)["Ready"]["reason"] == "ReplicasNotReady"
    assert status["observedGeneration"] == 3 and status["planConfigMap"] == "b-plan"
    # What a client sends the base as, and where: the Service the operator writes for it.
    assert status["servedModelName"] == served_name(BASE)
    svc = service(BASE)
    assert status["url"] == f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:" \
        f"{svc['spec']['ports'][0]['port']}"
    ready = base_status(plan, status, 2, "b-plan", T2)
    assert ready["phase"] == "Ready" and conds(ready)["Ready"]["status"] == "True"


def test_differs_ignores_absent_none():
    assert not differs({"a": 1}, {"a": 1, "b": None})
    assert differs({"a": 1}, {"a": 2})


def test_a_plan_that_does_not_fit_is_reported():
    plan = build_plan(BASE, [A], T1)
    status = base_status(plan, None, 2, "b-plan", T1, plan_error="the plan is 3.1 MB (1.2 MB gzipped)")
    assert conds(status)["Staged"]["status"] == "False" and conds(status)["Staged"]["reason"] == "PlanTooLarge"
    # Its servers follow the last plan that fit, not this one: not Ready, whatever the replicas
    # say (the CRD: Failed when "its plan or workloads cannot be written").
    assert status["phase"] == "Failed"


def _record(name: str, deleting: bool, **spec):
    from loraplex.operator.reconciler import AdapterRecord

    meta = {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": 1,
            **({"deletionTimestamp": "2026-12-01T08:00:00Z", "finalizers": ["loraplex.io/operator"]} if deleting else {})}
    return AdapterRecord.from_body({"metadata": meta, "spec": {"baseModel": "b", "source": f"s3://{name}", "rank": 8,
                                                               "targetModules": ["q_proj"], **spec}})


# (spec, counted as): accepted (and pinned: 4 slots), rejected for the base, or of an invalid spec.
BACKWARDS = {"warmup": {"start": "2026-12-02T00:00:00Z", "end": "2026-12-01T00:00:00Z"}}
KINDS = {"accepted": {}, "rejected": {"rank": 64}, "invalid": BACKWARDS}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_adapter_being_deleted_counts_in_no_count_of_its_base(kind):
    """An adapter being deleted (its finalizer waits for a plan without it) is in no plan or
    verdict, so in no count of its base: adapterCount, pinnedCount, rejectedCount alike. One of
    an invalid spec, in no verdict at all, was counted in rejectedCount until it was gone."""
    from loraplex.operator.reconciler import invalid_adapters

    def counts(records):
        plan = build_plan(BASE, [r.spec for r in records if r.spec is not None], T1)
        status = base_status(plan, None, 2, "b-plan", T1, invalid_adapters=invalid_adapters(records))
        return status["adapterCount"], status["pinnedCount"], status["rejectedCount"]

    live = _record("x", False, **KINDS[kind])
    assert (live.spec is None) == (kind == "invalid")
    assert counts([live]) == {"accepted": (1, 1, 0), "rejected": (0, 0, 1), "invalid": (0, 0, 1)}[kind]
    assert counts([_record("x", True, **KINDS[kind])]) == (0, 0, 0)
    others = [_record(k, False, **spec) for k, spec in KINDS.items()]  # one of each, live, beside it
    assert counts([*others, _record("x", True, **KINDS[kind])]) == counts(others) == (1, 1, 2)
