"""Adapters the server cannot serve, over HTTP and at start: refused with a 400 naming the
reason (adapter_refused), or left out at start, while everything else is served."""

from __future__ import annotations

import json
import shutil

import httpx

from .conftest import make_peft_adapter, serve_tiny_llama


def _copy_with_config(src, dst, *, cfg: dict | None = None, raw: bytes | None = None):
    shutil.copytree(src, dst)
    if cfg is not None:
        old = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(old | cfg))
    if raw is not None:
        (dst / "adapter_config.json").write_bytes(raw)
    return dst


def test_adapters_that_cannot_be_served_are_refused_with_a_400_and_at_start(hf_llama, llama_adapters, tmp_path):
    good = make_peft_adapter(hf_llama, tmp_path / "good", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"])
    bad = {
        "config-a-list": _copy_with_config(good, tmp_path / "list", raw=b"[1, 2]"),
        "alpha-nan": _copy_with_config(good, tmp_path / "nan", raw=(good / "adapter_config.json").read_bytes()
                                       .replace(b'"lora_alpha": 8', b'"lora_alpha": NaN')),
        "alora": _copy_with_config(good, tmp_path / "alora", cfg={"alora_invocation_tokens": [5, 6]}),
        "pissa": _copy_with_config(good, tmp_path / "pissa", cfg={"init_lora_weights": "pissa"}),
        "bad-pattern": _copy_with_config(good, tmp_path / "pattern", cfg={"rank_pattern": {"(q_proj": 4}}),
    }
    assert b"NaN" in (bad["alpha-nan"] / "adapter_config.json").read_bytes()
    # At start: the refused ones are left out (the server starts and serves the rest).
    modules = [f"{n}={p}" for n, p in (llama_adapters | {"good": good, "config-a-list": bad["config-a-list"]}).items()]
    with serve_tiny_llama(hf_llama, {}, lora_modules=modules) as server, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        ids = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert "good" in ids and "config-a-list" not in ids
        for name, path in bad.items():
            r = c.post("/v1/load_lora_adapter", json={"lora_name": f"{name}-2", "lora_path": str(path)})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["code"] == "adapter_refused", (name, r.text)
        r = c.post("/v1/completions", json={"model": "good", "prompt": [1, 5, 6], "max_tokens": 2})
        assert r.status_code == 200, r.text
