"""One base and its adapters in, the plan out: the file servers and node agents follow.

    plan = build_plan(base, adapters, now)
    plan.to_json()  ->  the `plan.json` key of the ConfigMap `<base>-plan`:

    {"adapters": [{"name": "a", "pinned": true, "priority": 100, "rank": 16,
                   "sha256": "...", "source": "s3://...", "targetModules": [...], "tenant": "t"}],
     "baseModel": "llama-3-8b", "dtype": "bfloat16", "maxLoraRank": 64,
     "pinned": ["a"], "prefetch": [{"end": "...", "name": "c", "start": "..."}], "slots": 250}

Adapters and pinned names sorted by name, keys sorted, no timestamps: the same inputs give
byte-identical JSON, so a re-run or a restart rewrites nothing. Only accepted adapters are
in the plan; the verdicts on the others go to their status.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterable
from typing import Any

from loraplex.operator import packing, pinning
from loraplex.operator.specs import AdapterSpec, BaseModelSpec
from loraplex.operator.validation import Verdict, validate


@dataclasses.dataclass(frozen=True)
class Plan:
    base: BaseModelSpec
    packing: packing.Packing
    pinning: pinning.Pinning
    adapters: tuple[AdapterSpec, ...]  # accepted, sorted by name
    verdicts: dict[str, Verdict]  # every adapter given, by name
    prefetch: tuple[pinning.PrefetchEntry, ...]
    max_rank_in_use: int | None
    hint: str | None  # e.g. the slots an unused maxLoraRank costs

    @property
    def slots(self) -> int:
        return self.packing.slots

    def is_pinned(self, name: str) -> bool:
        return name in self._pinned_set

    @property
    def _pinned_set(self) -> frozenset[str]:
        return frozenset(self.pinning.pinned)

    def as_json(self) -> dict[str, Any]:
        pinned = self._pinned_set
        return {
            "baseModel": self.base.name,
            "dtype": self.base.dtype,
            "maxLoraRank": self.base.max_lora_rank,
            "slots": self.packing.slots,
            "pinned": list(self.pinning.pinned),
            "adapters": [
                {
                    "name": a.name,
                    "source": a.source,
                    "sha256": a.sha256,
                    "tenant": a.tenant,
                    "priority": a.priority,
                    "pinned": a.name in pinned,
                    "rank": a.rank,
                    "targetModules": list(a.target_modules or ()),
                }
                for a in self.adapters
            ],
            "prefetch": [entry.as_json() for entry in self.prefetch],
        }

    def to_json(self) -> str:
        """Compact (a ConfigMap holds 1 MiB: ~3,700 adapters plain, ~20,000 gzipped)."""
        return json.dumps(self.as_json(), sort_keys=True, separators=(",", ":")) + "\n"


def build_plan(base: BaseModelSpec, adapters: Iterable[AdapterSpec],
               now: datetime.datetime) -> Plan:
    """Validate, pack, pin and schedule prefetches for `base`. Pure: no clock, no I/O.

    Adapters being deleted are left out (their finalizer waits for a plan without them).
    Adapters of another base get a `WrongBaseModel` verdict and stay out of the plan.
    """
    live = [a for a in adapters if not a.deleting]
    verdicts = {a.name: validate(a, base) for a in live}
    accepted = sorted((a for a in live if verdicts[a.name].accepted), key=lambda a: a.name)

    packed = packing.pack(base)
    pins = pinning.choose_pinned(accepted, packed.slots, base.pinned_percent)
    lead = datetime.timedelta(seconds=base.warmup_lead_seconds)
    entries = pinning.prefetch(accepted, now, lead)

    max_rank = max((a.rank for a in accepted if a.rank is not None), default=None)
    return Plan(
        base=base,
        packing=packed,
        pinning=pins,
        adapters=tuple(accepted),
        verdicts=verdicts,
        prefetch=tuple(entries),
        max_rank_in_use=max_rank,
        hint=_rank_hint(base, packed, max_rank),
    )


def _rank_hint(base: BaseModelSpec, packed: packing.Packing, max_rank: int | None) -> str | None:
    """A common sizing mistake: buffers for rank 64 while every adapter is rank 16 or less."""
    if max_rank is None or max_rank >= base.max_lora_rank or packed.reason != "Packed":
        return None
    smaller = packing.pack(base, rank=max_rank)
    if smaller.slots <= packed.slots:
        return None
    return (f"adapters use rank <= {max_rank} but slots are sized for maxLoraRank"
            f" {base.max_lora_rank}: maxLoraRank {max_rank} would give {smaller.slots}"
            f" slots instead of {packed.slots}")


def next_wakeup(plan: Plan, now: datetime.datetime) -> datetime.datetime | None:
    """When the prefetch list of this plan changes next (a warm-up window opens or ends)."""
    lead = datetime.timedelta(seconds=plan.base.warmup_lead_seconds)
    return pinning.next_change(plan.adapters, now, lead)
