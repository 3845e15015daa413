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


INT64_MAX = 2**63 - 1
# Llama-3-8B's shape; the test's absurd values are each one field of it, or of the engine, blown up.
ARCH = {"hiddenSize": 4096, "intermediateSize": 14336, "numLayers": 32, "numAttentionHeads": 32,
        "numKeyValueHeads": 8, "vocabSize": 128256}
PACKED = {"gpuMemory": "80G", "overhead": "8G"}


def _integers(value):
    """Every integer in a status, however deep."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _integers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _integers(item)


@pytest.mark.parametrize(("spec", "what"), [
    ({"architecture": {**ARCH, "hiddenSize": 2**62}}, "one adapter slot at maxLoraRank 16"),
    ({"architecture": {**ARCH, "numLayers": 2**58}}, "one adapter slot"),
    ({"memory": {"slots": 10}, "architecture": {**ARCH, "numLayers": 2**58}}, "one adapter slot"),  # slotBytes written
    ({"architecture": {**ARCH, "vocabSize": 2**62}}, "the base weights"),
    ({"serving": {"engine": {"maxNumSeqs": 2**31, "maxModelLen": 2**40}}}, "the KV cache"),
    ({"architecture": None, "memory": {**PACKED, "adapterBytes": "40M", "baseWeights": str(2**62),
                                       "kvCacheReserve": str(2**62)}}, "base weights + KV cache + overhead"),
])
def test_a_spec_whose_packing_figures_pass_int64_is_refused_with_a_reason(spec, what):
    """The schema's integers have no maximum: a huge hiddenSize (or maxNumSeqs x maxModelLen)
    put a status integer (slotBytes, adapterRoomBytes) past int64, the API server refused the
    status write, and the operator retried it for ever. Refused as an invalid spec instead."""
    fields = {"architecture": ARCH, "memory": PACKED, **spec}
    body = _base(**{k: v for k, v in fields.items() if v is not None})
    assert validator("BaseModel").is_valid(body)
    with pytest.raises(SpecError, match="2\\^63-1") as refused:
        BaseModelSpec.from_body(body)
    assert what in str(refused.value)


def test_the_largest_packing_figures_that_parse_fit_the_status():
    """At the edge: what the base needs beside its adapters at 2^63-1 bytes parses, and every
    integer of its status fits int64 (adapterRoomBytes negative: NoRoom); one byte more is refused."""
    from loraplex.operator.status import base_status

    memory = {"gpuMemory": "80G", "adapterBytes": "40M", "baseWeights": str(2**62), "overhead": str(2**62 - 1)}
    base = BaseModelSpec.from_body(_base(memory=memory))
    status = base_status(build_plan(base, [], NOW), None, 0, "b-plan", NOW)
    assert status["adapterRoomBytes"] == 80 * 10**9 - INT64_MAX and status["slots"] == 0
    assert all(-INT64_MAX - 1 <= n <= INT64_MAX for n in _integers(status))
    with pytest.raises(SpecError, match="2\\^63-1"):
        BaseModelSpec.from_body(_base(memory={**memory, "overhead": str(2**62)}))
    # A large real base (Llama-3.1-405B's shape, rank 256, 1024 rows of 128k tokens) is no edge.
    big = {"hiddenSize": 16384, "intermediateSize": 53248, "numLayers": 126, "numAttentionHeads": 128,
           "numKeyValueHeads": 8, "vocabSize": 128256}
    BaseModelSpec.from_body(_base(architecture=big, maxLoraRank=256, memory={"gpuMemory": "141G"},
                                  serving={"engine": {"maxNumSeqs": 1024, "maxModelLen": 131072}}))


def test_an_adapters_size_past_int64_is_not_written():
    """An adapter's sizeBytes is computed from its rank and modules on the base's shape, which
    is checked for the modules the base serves alone: one of other modules (down_proj, on a
    base of attention modules whose intermediateSize is absurd) is Rejected, and its size,
    past int64, left unknown rather than written (the API server would refuse the status)."""
    from loraplex.operator.status import adapter_status

    arch = {k: v for k, v in ARCH.items() if k != "vocabSize"} | {"intermediateSize": 2**60}
    base = BaseModelSpec.from_body(_base(architecture=arch, memory={**PACKED, "baseWeights": "16G"}))
    mlp = AdapterSpec.from_body(_adapter("mlp", targetModules=["down_proj"]))
    attention = AdapterSpec.from_body(_adapter("attention"))
    plan = build_plan(base, [mlp, attention], NOW)
    status = adapter_status(mlp, plan.verdicts["mlp"], plan, None, False, NOW)
    assert status["phase"] == "Rejected" and status["sizeBytes"] is None
    assert all(-INT64_MAX - 1 <= n <= INT64_MAX for n in _integers(status))
    # rank 8, q_proj (4096 in, 4096 out), 32 layers, bfloat16
    assert adapter_status(attention, plan.verdicts["attention"], plan, None, False, NOW)["sizeBytes"] == \
        8 * 8192 * 32 * 2


def test_a_rank_from_adapter_config_json_past_int64_is_rejected_not_written(tmp_path):
    """A file:// adapter's rank comes from its adapter_config.json, where no schema bounds it:
    a rank past int64 is Rejected (RankTooLarge, the message naming it) with no rank written
    (the status would be refused for ever); one that JSON reads as infinity (1e400) is
    unreadable (MetadataUnknown), not an OverflowError out of the adapter's index entry, and so
    is one below 1, as the schema bounds spec.rank (it was Accepted, its rank written)."""
    from loraplex.operator.reconciler import AdapterRecord
    from loraplex.operator.status import adapter_status

    base = BaseModelSpec.from_body(_base())
    for r, reason, message in (("100000000000000000000000000000", "RankTooLarge",
                                "rank 100000000000000000000000000000 > maxLoraRank 16"),
                               ("1e400", "MetadataUnknown", "rank and target modules unknown"),
                               ("-100000000000000000000000000000", "MetadataUnknown", "rank and target modules unknown")):
        (tmp_path / "adapter_config.json").write_text(f'{{"r": {r}, "target_modules": ["q_proj"]}}')
        body = _adapter("local", source=f"file://{tmp_path}")
        del body["spec"]["rank"]
        record = AdapterRecord.from_body(body)
        assert record.spec is not None
        plan = build_plan(base, [record.spec], NOW)
        status = adapter_status(record.spec, plan.verdicts["local"], plan, None, False, NOW)
        accepted = {c["type"]: c for c in status["conditions"]}["Accepted"]
        assert accepted["reason"] == reason and message in accepted["message"], r
        assert status["rank"] is None, r
        assert all(-INT64_MAX - 1 <= n <= INT64_MAX for n in _integers(status)), r
