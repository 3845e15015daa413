"""Structured outputs in the engine itself (no HTTP): a mixed batch of rows held to
grammars, free rows and adapters, on the CPU and on CUDA (decode replayed as CUDA graphs,
with the decode look-ahead), each output matching its own grammar."""

from __future__ import annotations

import json
import re

import pytest
import torch

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings
from loraplex.server.structured import GrammarSpec, available

pytestmark = pytest.mark.skipif(not available(), reason="xgrammar is not installed")

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
CHOICES = ["alpha beta", "gamma", "delta epsilon zeta"]
REGEX = r"[0-9]{2,4}-[a-z]{3}"


def engine_on(device: str, hf_llama, llama_adapters) -> LLMEngine:
    settings = ServerSettings(model=str(hf_llama), device=device, dtype="float32", max_num_seqs=8,
                              max_model_len=192, max_loras=4, max_lora_rank=16,
                              lora_modules=[f"{n}={p}" for n, p in llama_adapters.items()])
    engine = LLMEngine.from_settings(settings)
    assert engine.look_ahead == (device == "cuda")  # on CUDA the look-ahead runs, and graphs replay
    return engine


@pytest.mark.parametrize("device", DEVICES)
def test_a_mixed_batch_keeps_each_row_to_its_own_grammar(device, hf_llama, llama_adapters):
    engine = engine_on(device, hf_llama, llama_adapters)
    tok = engine.tokenizer
    grammars = {
        "json": engine.grammars.compile(GrammarSpec("json", json.dumps(SCHEMA), "test")),
        "choice": engine.grammars.compile(GrammarSpec("choice", json.dumps(CHOICES), "test")),
        "regex": engine.grammars.compile(GrammarSpec("regex", REGEX, "test")),
    }
    prompt = tok.encode("The quick brown fox")
    rows = [("json", None), ("choice", "qv-r8"), ("regex", "all-r16"), (None, None), ("json", "patterns"),
            ("choice", None), (None, "qv-r8"), ("regex", None)]
    reqs = []
    for i, (kind, adapter) in enumerate(rows):
        params = SamplingParams(max_tokens=80, temperature=0.7 if i % 2 else 0.0, seed=i, ignore_eos=kind is None,
                                grammar=grammars[kind] if kind else None)
        reqs.append(engine.make_request(prompt, params, adapter))
        engine.add_request(reqs[-1])
    for _ in range(200):
        if all(r.finished for r in reqs):
            break
        engine.step()
    assert all(r.finished for r in reqs)
    for (kind, adapter), req in zip(rows, reqs):
        text = req.detok.text
        if kind is None:
            assert req.finish_reason == "length" and len(req.output_ids) == 80
            continue
        assert req.finish_reason == "stop", (kind, adapter, req.finish_reason, req.error, text)
        if kind == "json":
            value = json.loads(text)
            assert set(value) == {"ok", "n", "tag"} and value["n"] in (1, 22, 333), text
        elif kind == "choice":
            assert text in CHOICES, text
        else:
            assert re.fullmatch(REGEX, text), text
    if device == "cuda":
        assert engine.decoder.num_graphs > 0 and engine.look_ahead_hits > 0
