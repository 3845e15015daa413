"""Edge values the CRD schemas accept, through the operator's parsing: a value the API
server takes is parsed exactly or refused with a SpecError (a condition with a reason),
never an exception that kopf would retry for ever."""

from __future__ import annotations

import pytest

from loraplex.operator.packing import pack
from loraplex.operator.specs import BaseModelSpec, SpecError, parse_quantity

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
