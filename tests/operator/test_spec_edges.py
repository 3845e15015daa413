"""Edge values the CRD schemas accept, through the operator's parsing: a value the API
server takes is parsed exactly or refused with a SpecError (a condition with a reason),
never an exception that kopf would retry for ever."""

from __future__ import annotations

import datetime

import pytest

from loraplex.operator.packing import pack
from loraplex.operator.plan import build_plan, next_wakeup
from loraplex.operator.specs import AdapterSpec, BaseModelSpec, SpecError, parse_quantity

from .test_manifests import validator


@pytest.mark.parametrize(("text", "value"), [
    ("1234567890123456789", 1234567890123456789),  # beyond a float's 53 bits: exact
    ("1.5Gi", 3 * 2**29),
    ("0.1", 0),
    ("80Gi", 80 * 2**30),
    ("9007199254740993", 9007199254740993),
    ("1.0000000000000001G", 1_000_000_000),
])
def test_quantities_are_exact(text, value):
    assert parse_quantity(text) == value


def test_a_huge_quantity_the_schema_takes_is_refused_with_a_reason_not_crashed_on():
    """The schema's quantity pattern has no length limit; 400 digits overflowed a float
    (OverflowError: kopf retried the BaseModel's handler for ever, its index entry failed)."""
    spec = {"source": "/models/b", "maxLoraRank": 8, "memory": {"gpuMemory": "9" * 400, "baseWeights": "16G",
                                                                "adapterBytes": "40M"}}
    body = {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "b"}, "spec": spec}
    assert validator("BaseModel").is_valid(body)
    with pytest.raises(SpecError, match="too large"):
        BaseModelSpec.from_body(body)
    spec["memory"]["gpuMemory"] = str(2**63 - 1)  # the largest int64 still parses, and packs
    assert pack(BaseModelSpec.from_body(body)).slots > 0


NOW = datetime.datetime(2026, 12, 1, 8, 0, tzinfo=datetime.timezone.utc)


def _adapter(name: str, **spec) -> dict:
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"baseModel": "b", "source": "/adapters/" + name, "rank": 8, "targetModules": ["q_proj"], **spec}}


def _base(**spec) -> dict:
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "b", "namespace": "ml"},
            "spec": {"source": "/models/b", "maxLoraRank": 16, "memory": {"slots": 10}, **spec}}


def test_a_warmup_at_the_start_of_the_calendar_does_not_break_the_pools_plan():
    """The schema takes any date-time; `start - lead` before year 1 overflowed, and as the
    whole pool is planned at once, one such adapter failed every plan of its base."""
    early = _adapter("early", warmup={"start": "0001-01-01T00:05:00Z", "end": "2026-12-24T00:00:00Z"})
    assert validator("LoRAAdapter").is_valid(early)
    adapters = [AdapterSpec.from_body(early), AdapterSpec.from_body(_adapter("other"))]
    plan = build_plan(BaseModelSpec.from_body(_base()), adapters, NOW)
    assert [a.name for a in plan.adapters] == ["early", "other"]
    assert [e.name for e in plan.prefetch] == ["early"]  # its window is open
    assert next_wakeup(plan, NOW) == datetime.datetime(2026, 12, 24, tzinfo=datetime.timezone.utc)


def test_a_time_out_of_pythons_range_is_refused_with_a_reason():
    odd = _adapter("odd", warmup={"start": "0001-01-01T00:00:00+01:00", "end": "2026-12-24T00:00:00Z"})
    assert validator("LoRAAdapter").is_valid(odd)
    with pytest.raises(SpecError, match="out of range"):
        AdapterSpec.from_body(odd)


def test_the_warmup_lead_the_schema_takes_is_one_the_operator_plans_with():
    assert not validator("BaseModel").is_valid(_base(warmupLeadSeconds=2**62))  # a timedelta overflows
    year = 365 * 24 * 3600
    assert validator("BaseModel").is_valid(_base(warmupLeadSeconds=year))
    base = BaseModelSpec.from_body(_base(warmupLeadSeconds=year))
    build_plan(base, [AdapterSpec.from_body(_adapter("a", warmup={"start": "2027-12-01T08:00:00Z",
                                                                 "end": "2027-12-02T08:00:00Z"}))], NOW)
    with pytest.raises(SpecError, match="warmupLeadSeconds"):
        BaseModelSpec.from_body(_base(warmupLeadSeconds=2**62))


def test_a_warmup_in_lower_case_rfc_3339_is_read():
    """RFC 3339 lets "T" and "Z" be lower case, and the API server's date-time format takes
    them so: parsed as Python's ISO form alone, such an adapter was Rejected (InvalidSpec)."""
    lower = _adapter("lower", warmup={"start": "2026-12-01t08:00:00z", "end": "2026-12-02t08:00:00.5+01:00"})
    assert validator("LoRAAdapter").is_valid(lower)
    warmup = AdapterSpec.from_body(lower).warmup
    assert warmup is not None
    assert (warmup.start, warmup.end) == (NOW, NOW + datetime.timedelta(hours=23, milliseconds=500))
