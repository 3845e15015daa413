"""The operator's plan file (`plan.json` in the ConfigMap `<base>-plan`), read with the
standard library only: the server, the node agent and the operator's own tests share it.

A ConfigMap holds at most 1 MiB, so the operator writes a large plan gzipped (under
`binaryData`, same key; the mounted file then holds the gzip bytes). Readers tell the two
encodings apart by gzip's magic bytes, never by the file name.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLAN_KEY = "plan.json"
GZIP_MAGIC = b"\x1f\x8b"

# A plan mirror: the operator's copy of a BaseModel's plan ConfigMap in one namespace (the
# node agent's, `loraplex-operator --plan-mirror-namespace`), where an agent finds every plan
# with one label selector instead of being told each one's name. Its annotations name the
# plan it copies, whose namespace its adapters (LoRAAdapters, servers, cache folder) belong to:
#     labels:      loraplex.io/plan-mirror: "true"
#     annotations: loraplex.io/plan-of: ml/llama-3-8b-plan
#                  loraplex.io/plan-namespace: ml
#                  loraplex.io/base-model: llama-3-8b
PLAN_MIRROR_LABEL = "loraplex.io/plan-mirror"
PLAN_OF_ANNOTATION = "loraplex.io/plan-of"
PLAN_NAMESPACE_ANNOTATION = "loraplex.io/plan-namespace"
PLAN_BASE_ANNOTATION = "loraplex.io/base-model"


class PlanFileError(ValueError):
    """The plan's bytes are not a plan: the message says why."""


# The most a gzipped plan may inflate to. The operator gzips plans over 900 kB to fit a
# ConfigMap (1 MiB); JSON plans compress about 10:1, so a real one stays far below this, while
# a 1 MiB deflate bomb could inflate to a gigabyte in every server and node agent reading it.
MAX_PLAN_BYTES = 64 << 20


def _gunzip(raw: bytes) -> bytes:
    """gzip.decompress, refusing output past MAX_PLAN_BYTES (PlanFileError)."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # a gzip header and trailer
    out = inflate.decompress(raw, MAX_PLAN_BYTES + 1)
    if len(out) > MAX_PLAN_BYTES:
        raise PlanFileError(f"not a plan: it inflates past {MAX_PLAN_BYTES} bytes")
    if not inflate.eof:
        raise PlanFileError("not a plan: its gzip stream is cut short")
    return out


def decode_plan(raw: bytes | str) -> dict[str, Any]:
    """A plan's JSON object from its file bytes, gzipped or not."""
    if isinstance(raw, str):
        raw = raw.encode()
    try:
        if raw[:2] == GZIP_MAGIC:
            raw = _gunzip(raw)
        plan = json.loads(raw)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise PlanFileError(f"not a plan: {e}") from None
    if not isinstance(plan, dict):
        raise PlanFileError("not a plan: the JSON is not an object")
    return plan


def check_plan(plan: dict[str, Any]) -> None:
    """Raise PlanFileError unless the fields a server follows have their shape
    (operator/plan.py writes them): `adapters` a list of objects, each with a string `name` and
    `source`, `sha256` and `tenant` strings or null; `pinned` a list of names; `prefetch` a list of
    objects with a string `name`. Checked whole before any of it is applied, so a plan of the
    wrong shape changes nothing (a half-applied one registered some adapters, pinned none)."""

    def names_a_list(key: str) -> list:
        value = plan.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise PlanFileError(f"not a plan: {key} is {type(value).__name__}, not a list")
        return value

    for i, a in enumerate(names_a_list("adapters")):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not a["name"]:
            raise PlanFileError(f"not a plan: adapters[{i}] is not an object with a name: {a!r}"[:300])
        for key in ("source", "sha256", "tenant"):
            if a.get(key) is not None and not isinstance(a[key], str):
                raise PlanFileError(f"not a plan: adapters[{i}] ({a['name']}): {key} {a[key]!r} is not a string"[:300])
    for i, name in enumerate(names_a_list("pinned")):
        if not isinstance(name, str):
            raise PlanFileError(f"not a plan: pinned[{i}] {name!r} is not a name"[:300])
    for i, w in enumerate(names_a_list("prefetch")):
        if not isinstance(w, dict) or not isinstance(w.get("name"), str):
            raise PlanFileError(f"not a plan: prefetch[{i}] is not an object with a name: {w!r}"[:300])


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
