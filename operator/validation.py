"""Does an adapter fit its base? Rejected with a reason, never half-served.

An adapter is planned only when it names this base, its rank fits the base's buffers and
every module it targets is one the base serves. Anything else gets a verdict the operator
writes to the adapter's `Accepted` condition:

    validate(adapter, base) -> Verdict("Accepted", "Accepted", "rank 16 <= 64, ...")
    validate(rank_128, base) -> Verdict("Rejected", "RankTooLarge", "rank 128 > maxLoraRank 64")
    validate(named_a_b, base) -> Verdict("Rejected", "InvalidName", "adapter name 'a,b' contains ','...")

Rank and target modules come from the spec, or from the adapter's adapter_config.json when
the operator can read it (file:// sources and mounted paths; see `read_adapter_config`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import urllib.parse
from typing import Any

from loraplex.operator.specs import ALL_TARGET_MODULES, AdapterSpec, BaseModelSpec, module_names
from loraplex.server.adapter_format import peft_targets
from loraplex.server.adapter_names import InvalidAdapterName, check_adapter_name

# adapter_config.json is a few hundred bytes; anything this big is not one.
_MAX_CONFIG_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Verdict:
    """phase: Accepted (planned), Rejected (never, until its spec changes) or Pending (not yet)."""

    phase: str
    reason: str
    message: str

    @property
    def accepted(self) -> bool:
        return self.phase == "Accepted"


def validate(adapter: AdapterSpec, base: BaseModelSpec | None) -> Verdict:
    """The verdict on one adapter against the base it names (None: no such BaseModel)."""
    try:  # every Kubernetes object name fits; the check keeps the plan to names servers take
        check_adapter_name(adapter.name)
    except InvalidAdapterName as exc:
        return Verdict("Rejected", "InvalidName", str(exc))
    if base is None:
        return Verdict("Pending", "BaseModelNotFound",
                       f"BaseModel {adapter.base_model!r} does not exist in namespace {adapter.namespace!r}")
    if adapter.base_model != base.name or adapter.namespace != base.namespace:
        return Verdict("Rejected", "WrongBaseModel",
                       f"adapter is for base {adapter.namespace}/{adapter.base_model},"
                       f" not {base.namespace}/{base.name}")
    if adapter.name == served_name(base):
        return Verdict("Rejected", "InvalidName",
                       f"{adapter.name!r} is the name {base.name}'s servers serve the base model under"
                       f" (a request for it runs on the base): rename the adapter")
    if adapter.rank is None or adapter.target_modules is None:
        return Verdict("Pending", "MetadataUnknown",
                       "rank and target modules unknown: set spec.rank and spec.targetModules"
                       " (read from adapter_config.json only for file:// sources)")
    if adapter.rank > base.max_lora_rank:
        return Verdict("Rejected", "RankTooLarge",
                       f"rank {adapter.rank} > maxLoraRank {base.max_lora_rank} of {base.name}")
    extra = sorted(set(adapter.target_modules) - set(base.target_modules))
    if extra:
        return Verdict("Rejected", "TargetModulesNotAllowed",
                       f"target modules {extra} are not served by {base.name}"
                       f" (allowed: {sorted(base.target_modules)})")
    return Verdict("Accepted", "Accepted",
                   f"rank {adapter.rank} <= {base.max_lora_rank},"
                   f" modules {list(adapter.target_modules)} allowed")


def served_name(base: BaseModelSpec) -> str:
    """The model name the base's servers answer to: serving.servedModelName, else their
    --model folder's name (as the server names a base without --served-model-name)."""
    from loraplex.operator.workloads import model_path  # (workloads imports this module)

    return base.serving.served_model_name or pathlib.PurePosixPath(model_path(base)).name


# Layers the projections of an adapter_config.json are looked for in (the base's count is not
# known here): more than any Llama-family model has (Llama 3.1 405B: 126), so that a regex or
# layers_to_transform naming late layers still finds their projections.
_CONFIG_LAYERS = 256


def config_target_modules(config: dict) -> tuple[str, ...]:
    """The projections an adapter_config.json puts LoRA on, as the servers read it (and peft):
    target_modules a list of names, a regex (a string) or "all-linear", none meaning peft's
    default (q_proj, v_proj), then layers_to_transform / layers_pattern and exclude_modules
    (server/adapter_format.peft_targets, which imports no torch). ValueError (AdapterError)
    for a config the servers refuse."""
    return module_names({proj for _, proj in peft_targets(config, _CONFIG_LAYERS)})


def parse_adapter_config(text: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(rank, target modules) from the text of a PEFT adapter_config.json. The rank is the
    largest of any module's: `r`, or a rank_pattern's above it ({"down_proj": 64} with r 16 is
    rank 64), which the servers' buffers must hold (they refuse a module over --max-lora-rank)."""
    config = json.loads(text)
    if not isinstance(config, dict):
        raise ValueError("adapter_config.json is not a JSON object")
    rank = config.get("r")
    patterns = config.get("rank_pattern")
    ranks = [v for v in patterns.values() if isinstance(v, int) and not isinstance(v, bool)] \
        if isinstance(patterns, dict) else []
    largest = max([int(rank), *ranks]) if rank is not None else None
    if largest is not None and largest < 1:  # as the schema bounds spec.rank
        raise ValueError(f"adapter_config.json gives rank {largest}; a LoRA rank is at least 1")
    return largest, config_target_modules(config)


def local_path(source: str) -> pathlib.Path | None:
    """The directory of a file:// or absolute-path source; None for remote sources."""
    if source.startswith("/"):
        return pathlib.Path(source)
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme == "file":
        return pathlib.Path(urllib.parse.unquote(parsed.path))
    return None


def read_adapter_config(source: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(rank, target modules) of a local adapter; (None, None) when it cannot be read here."""
    path = local_path(source)
    if path is None:
        return None, None
    config = path / "adapter_config.json"
    try:
        with config.open("rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError:
        return None, None
    if len(data) > _MAX_CONFIG_BYTES:
        return None, None
    try:
        return parse_adapter_config(data.decode("utf-8"))
    except (ValueError, TypeError, OverflowError):  # OverflowError: an "r" JSON reads as infinity (1e400)
        return None, None
