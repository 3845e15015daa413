"""The cold-load benchmark's CPU smoke run: it completes and its JSON has every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cold_load_bench_quick_on_cpu(tmp_path):
    out = tmp_path / "cold.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "cold_load_bench.py"), "--shape", "tiny", "--quick",
                        "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["h2d_bandwidth_GBps"] > 0 and doc["floor_ms"] > 0 and doc["slot_bytes"] >= doc["adapter_bytes"] > 0
    assert doc["disk_read_GBps"] > 0 and doc["disk_floor_ms"] > doc["floor_ms"]
    for tier in ("host", "disk_page_cache_warm", "disk_page_cache_dropped"):
        load = doc["cold_load"][tier]
        assert load["n"] == 3 and 0 < load["min_ms"] <= load["median_ms"] <= load["max_ms"]
    decode = doc["decode"]
    for phase in ("none", "loads"):
        assert decode[phase]["steps"] == 8 and 0 < decode[phase]["p50_ms"] <= decode[phase]["p99_ms"]
    assert decode["loads_started"] > 0 and decode["loads_in_flight_mean"] > 0
    stages = doc["disk_load_breakdown"]
    for stage in ("read_adapter", "alloc", "fill", "read", "copy_to_slot", "loader_path"):
        assert stages[stage]["n"] == 3 and 0 < stages[stage]["min_ms"] <= stages[stage]["median_ms"]
    assert set(stages["split"]) == {"dispatch", "run", "complete"}
    assert doc["disk_load_bytes_match"] is True
    assert stages["read_threads"] >= 1 and stages["chunk_bytes"] > 0 and stages["flat_pinned"] is False
    assert set(doc["checks"]) == {"host_load_vs_floor", "decode_p99_with_loads", "disk_warm_load_vs_floor"}
    assert doc["checks"]["disk_warm_load_vs_floor"]["value"] == doc["cold_load"]["disk_page_cache_warm"]["vs_floor"]
    assert "cold load from host" in r.stderr and "stage: read the file" in r.stderr
