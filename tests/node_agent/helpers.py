"""Helpers shared by the node agent tests."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE


def make_adapter(directory: Path, *, rank: int = 4, hidden: int = 32, layers: int = 2, seed: int = 0) -> str:
    """A PEFT LoRA adapter on q_proj/v_proj; returns the sha256 of adapter_model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, hidden), dtype=np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((hidden, rank), dtype=np.float32)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": "tiny"}
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    return hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()


T0 = datetime.datetime(2026, 5, 1, 8, 0, tzinfo=datetime.timezone.utc)


def iso(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def plan_json(object_store, pinned=(), others=(), prefetch=(), base="tiny-llama") -> dict:
    adapters = [
        {"name": n, "source": object_store.source(n), "sha256": object_store.adapters[n].sha256,
         "tenant": "t", "priority": 100 if n in pinned else 10, "pinned": n in pinned}
        for n in [*pinned, *others]
    ]
    return {"baseModel": base, "maxLoraRank": 16, "slots": 8, "pinned": list(pinned),
            "adapters": adapters,
            "prefetch": [{"name": n, "start": iso(s), "end": iso(e)} for n, s, e in prefetch]}


def reporting_warmer(tmp_path: Path, session, kube_api, plan: dict):
    """A warmer of `plan` (mounted as a ConfigMap) for namespace ml on node-7, reporting to
    `kube_api`, its plan taken (not reconciled). Returns (cm, store, reporter, warmer)."""
    from loraplex.node_agent.kube import KubeAPI, StatusReporter
    from loraplex.node_agent.store import AdapterStore
    from loraplex.node_agent.warmer import Warmer

    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    reporter = StatusReporter(KubeAPI(kube_api.url, session), "ml", "node-7")
    return cm, store, reporter, Warmer(store, cm.path, session, reporter=reporter)


class ConfigMapDir:
    """A mounted ConfigMap as the kubelet writes it: plan.json -> ..data/plan.json, and
    ..data -> a timestamped directory, swapped by renaming a new symlink over ..data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)
        self.n = 0
        os.symlink("..data/plan.json", root / "plan.json")

    @property
    def path(self) -> Path:
        return self.root / "plan.json"

    def write(self, data: dict | str | bytes) -> None:
        self.n += 1
        d = self.root / f"..2026_05_01_{self.n}"
        d.mkdir()
        if isinstance(data, dict):
            data = json.dumps(data)
        (d / "plan.json").write_bytes(data if isinstance(data, bytes) else data.encode())
        os.symlink(d.name, self.root / "..data_tmp")
        os.replace(self.root / "..data_tmp", self.root / "..data")
