"""The plan file: the operator's ConfigMap, plain or gzipped, read back the same by every reader."""

from __future__ import annotations

import gzip
import json

import pytest

from loraplex.operator.specs import BaseModelSpec
from loraplex.operator.workloads import plan_config_map
from loraplex.server.plan_file import PlanFileError, config_map_plan_bytes, decode_plan, read_plan_file


def small_plan(n: int) -> dict:
    return {"baseModel": "b", "slots": 8, "pinned": ["a0"],
            "adapters": [{"name": f"a{i}", "source": f"file:///x/a{i}", "sha256": "0" * 64, "pinned": i == 0}
                         for i in range(n)], "prefetch": []}


@pytest.mark.parametrize("n", [3, 20_000])  # 20,000 adapters do not fit a ConfigMap unzipped
def test_config_map_and_mounted_file_read_back_the_plan(n, tmp_path):
    plan = small_plan(n)
    base = BaseModelSpec.from_body({"metadata": {"name": "b", "namespace": "ns"},
                                    "spec": {"source": "file:///models/b", "maxLoraRank": 16, "slots": 8}})
    config_map = plan_config_map(base, json.dumps(plan, separators=(",", ":")))
    raw = config_map_plan_bytes(config_map)
    assert (raw[:2] == b"\x1f\x8b") == (n > 1000)
    assert decode_plan(raw) == plan
    mounted = tmp_path / "plan.json"  # what the kubelet writes for either encoding
    mounted.write_bytes(raw)
    assert read_plan_file(mounted) == plan


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"{not json", gzip.compress(b"{not json")[:10]])
def test_bad_bytes_are_refused_with_a_reason(raw):
    with pytest.raises(PlanFileError, match="not a plan"):
        decode_plan(raw)


def test_missing_file_is_a_plan_error(tmp_path):
    with pytest.raises(PlanFileError):
        read_plan_file(tmp_path / "absent.json")
