"""Gzipped plans (the operator's form over 900 kB) are inflated with a bound, and a broken
gzip stream is a PlanFileError like any other bad plan, never a zlib.error or a gigabyte."""

from __future__ import annotations

import gzip
import json

import pytest

from loraplex.server.plan_file import MAX_PLAN_BYTES, PlanFileError, decode_plan


def test_a_gzipped_plan_decodes():
    plan = {"baseModel": "b", "adapters": [{"name": f"a{i}", "source": "/x"} for i in range(3000)]}
    assert decode_plan(gzip.compress(json.dumps(plan).encode())) == plan


def test_a_deflate_bomb_is_refused():
    bomb = gzip.compress(b"{" + b" " * (MAX_PLAN_BYTES + 10) + b"}", compresslevel=9)
    assert len(bomb) < 1 << 20  # fits a ConfigMap
    with pytest.raises(PlanFileError, match="inflates past"):
        decode_plan(bomb)


@pytest.mark.parametrize("damage", ["cut", "corrupt"])
def test_a_broken_gzip_stream_is_a_plan_file_error(damage):
    raw = gzip.compress(json.dumps({"adapters": []}).encode())
    raw = raw[: len(raw) // 2] if damage == "cut" else raw[:12] + bytes(b ^ 0xFF for b in raw[12:20]) + raw[20:]
    with pytest.raises(PlanFileError):
        decode_plan(raw)
