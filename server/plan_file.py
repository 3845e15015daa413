"""The operator's plan file (`plan.json` in the ConfigMap `<base>-plan`), read with the
standard library only: the server, the node agent and the operator's own tests share it.

A ConfigMap holds at most 1 MiB, so the operator writes a large plan gzipped (under
`binaryData`, same key; the mounted file then holds the gzip bytes). Readers tell the two
encodings apart by gzip's magic bytes, never by the file name.
"""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLAN_KEY = "plan.json"
GZIP_MAGIC = b"\x1f\x8b"


class PlanFileError(ValueError):
    """The plan's bytes are not a plan: the message says why."""


def decode_plan(raw: bytes | str) -> dict[str, Any]:
    """A plan's JSON object from its file bytes, gzipped or not."""
    if isinstance(raw, str):
        raw = raw.encode()
    try:
        if raw[:2] == GZIP_MAGIC:
            raw = gzip.decompress(raw)
        plan = json.loads(raw)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanFileError(f"not a plan: {e}") from None
    if not isinstance(plan, dict):
        raise PlanFileError("not a plan: the JSON is not an object")
    return plan


def read_plan_file(path: str | Path) -> dict[str, Any]:
    """The plan in a mounted file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PlanFileError(f"{path}: {e}") from None
    return decode_plan(raw)


def config_map_plan_bytes(config_map: Mapping[str, Any], key: str = PLAN_KEY) -> bytes | None:
    """The plan file's bytes as a ConfigMap holds them (`data`, or base64 `binaryData`)."""
    if key in (config_map.get("data") or {}):
        return config_map["data"][key].encode()
    if key in (config_map.get("binaryData") or {}):
        return base64.b64decode(config_map["binaryData"][key])
    return None
