"""The CRDs against what the rest of loraplex does with a value they accept: a spec the API
server takes must be one the operator, the node agents and the servers can act on, and the
examples must be such specs. jsonschema stands in for the API server's validation (see
test_manifests.py for what it does not cover)."""

from __future__ import annotations

import copy

import pytest

from loraplex.node_agent.sources import SourceError, open_source
from loraplex.operator.specs import OPERATOR_ENV

from .test_manifests import EXAMPLES, validator

ADAPTER = {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "a"},
           "spec": {"baseModel": "llama-3-8b", "source": "https://artifacts.example/a"}}


def fetchable(source: str) -> bool:
    """Whether a node agent can open `source` (it downloads every adapter a plan names)."""
    try:
        open_source(source, session=object())  # type: ignore[arg-type]  # never used to open
    except SourceError:
        return False
    return True


@pytest.mark.parametrize("source", [
    "https://artifacts.example/adapters/a", "http://10.0.0.5:9000/adapters/a?token=t",
    "file:///mnt/adapters/a", "/mnt/adapters/a",
    "s3://adapters/a", "gs://adapters/a", "ftp://host/a", "hdfs://nn/a", "adapters/a",
])
def test_the_schema_takes_the_sources_a_node_agent_can_fetch_and_no_others(source):
    """An adapter whose source no node agent can open would be planned and pinned, then fail
    to stage on every node (Unsupported) and its pinned loads retry for ever."""
    doc = copy.deepcopy(ADAPTER)
    doc["spec"]["source"] = source
    assert validator("LoRAAdapter").is_valid(doc) == fetchable(source)


def test_every_example_adapter_can_be_fetched():
    sources = [doc["spec"]["source"] for doc in EXAMPLES if doc["kind"] == "LoRAAdapter"]
    assert sources and [s for s in sources if not fetchable(s)] == []


@pytest.mark.parametrize("name", [*sorted(OPERATOR_ENV), "HF_HOME", "NODE_IP_EXTRA"])
def test_the_schema_refuses_the_server_variables_the_operator_sets(name):
    """serving.env may not set NODE_IP or TRITON_CACHE_DIR (the Deployment's node-agent URL and
    kernel cache): the API server refuses such a BaseModel when it is applied, so a GitOps
    sync fails there, rather than the operator taking it and marking it InvalidSpec."""
    doc = {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "b"},
           "spec": {"source": "/models/b", "maxLoraRank": 8,
                    "serving": {"env": [{"name": "LOG", "value": "1"}, {"name": name, "value": "x"}]}}}
    assert validator("BaseModel").is_valid(doc) == (name not in OPERATOR_ENV)
