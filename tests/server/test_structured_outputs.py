"""Structured outputs (server/structured.py): the fields that ask for one, and requests over
HTTP whose outputs must match a choice, a regex, a JSON schema or any JSON object, on the
base and on adapters. The vocabulary and the sampler's mask: test_structured_mask.py."""

from __future__ import annotations

import json
import re

import pytest

from loraplex.server.api.schemas import CompletionRequest, SpecRefused
from loraplex.server.structured import GrammarSpec, available

from .conftest import serve_tiny_llama

# The grammar engine is an optional dependency (the test extras install it).
needs_xgrammar = pytest.mark.skipif(not available(), reason="xgrammar is not installed")


# -- which field asks for what ---------------------------------------------------------------


def spec_of(**fields) -> GrammarSpec | None:
    return CompletionRequest(model="m", prompt="x", **fields).grammar_spec()


def test_each_field_names_its_grammar():
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"enum": [1, 2]}}}
    assert spec_of() is None and spec_of(response_format={"type": "text"}) is None
    assert spec_of(response_format={"type": "json_object"}) == GrammarSpec("json_object", "", "response_format")
    got = spec_of(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    # The schema's key order is the order its properties are written in: kept.
    assert got.kind == "json" and json.loads(got.value) == schema and list(json.loads(got.value)["properties"]) == ["b", "a"]
    assert spec_of(structured_outputs={"json": json.dumps(schema)}).value == json.dumps(schema)
    assert spec_of(structured_outputs={"regex": "a+", "disable_any_whitespace": True}) == \
        GrammarSpec("regex", "a+", "structured_outputs")
    assert spec_of(structured_outputs={"choice": ["x", "y"]}).choices() == ["x", "y"]
    assert spec_of(structured_outputs={"grammar": 'root ::= "a"'}).kind == "grammar"
    assert spec_of(structured_outputs={"json_object": True}).kind == "json_object"
    assert spec_of(structured_outputs={"json_object": False}) is None
    assert spec_of(guided_choice=["a"]).param == "guided_choice"
    assert spec_of(guided_regex="[0-9]").kind == "regex" and spec_of(guided_json=schema).kind == "json"
    assert spec_of(guided_grammar='root ::= "a"').kind == "grammar"


@pytest.mark.parametrize(("fields", "param", "words"), [
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "only one"),
    (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "only one"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "one of"),
    (dict(structured_outputs={"whitespace_pattern": " "}), "structured_outputs", "not supported"),
    (dict(structured_outputs={"json_object": "yes"}), "structured_outputs", "true or false"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "n"}}), "response_format", "schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}), "response_format", "object"),
    (dict(response_format={"type": "grammar"}), "response_format", "not supported"),
    (dict(guided_json="{not json"), "guided_json", "not JSON"),
    (dict(guided_choice=[]), "guided_choice", "non-empty"),
    (dict(guided_choice=["a", ""]), "guided_choice", "non-empty"),
    (dict(guided_regex=""), "guided_regex", "non-empty"),
])
def test_malformed_or_doubled_asks_are_refused_naming_the_field(fields, param, words):
    body = CompletionRequest(model="m", prompt="x", **fields)
    with pytest.raises(SpecRefused) as e:
        body.grammar_spec()
    assert e.value.param == param and words in e.value.why
    assert body.refusal() == (e.value.why, param)


@needs_xgrammar
def test_a_grammar_in_use_stays_compiled_while_others_come_and_go(hf_llama):
    """The cache keeps the grammars used last: a spec every other request asks for is not
    compiled again each time COMPILED_CACHE others have come (it was evicted first-in, first-out)."""
    from loraplex.server.structured import COMPILED_CACHE, Grammars
    from loraplex.server.tokenizer import Tokenizer

    tok = Tokenizer(hf_llama)
    grammars = Grammars(tok, tok.vocab_size, (tok.eos_token_id,))
    hot = GrammarSpec("json", json.dumps(SCHEMA), "response_format")
    compiled = grammars.compile(hot)
    for i in range(2 * COMPILED_CACHE):
        grammars.compile(GrammarSpec("regex", f"x{i}[a-z]", "guided_regex"))
        assert grammars.compile(hot) is compiled, i


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters) as server:
        yield server


def complete(served, **body):
    import httpx

    return httpx.post(served.url + "/v1/completions", timeout=60,
                      json={"model": "tiny-llama", "prompt": "The fox", "temperature": 0, **body})


def chat(served, **body):
    import httpx

    return httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "Answer in JSON."}], "temperature": 0,
        **body})


CHOICES = ["yes please", "no", "maybe later, after lunch"]


@needs_xgrammar
@pytest.mark.parametrize("model", ["tiny-llama", "qv-r8", "all-r16"])
def test_a_choice_is_one_of_the_choices_on_the_base_and_adapters(served, model):
    r = complete(served, model=model, max_tokens=40, structured_outputs={"choice": CHOICES})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] in CHOICES and choice["finish_reason"] == "stop", choice
    # Sampled, each of n choices is one too; the older guided_choice asks the same.
    r = complete(served, model=model, max_tokens=40, n=4, temperature=1.0, seed=3, guided_choice=CHOICES)
    assert r.status_code == 200, r.text
    assert all(c["text"] in CHOICES and c["finish_reason"] == "stop" for c in r.json()["choices"]), r.json()


@needs_xgrammar
def test_a_regex_matches_the_whole_output_streamed_and_not(served):
    pattern = r"[0-9]{3}-[a-z]{2}( ok)?"
    r = complete(served, max_tokens=30, structured_outputs={"regex": pattern})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert re.fullmatch(pattern, text), text
    import httpx

    with httpx.stream("POST", served.url + "/v1/completions", timeout=60, json={
            "model": "qv-r8", "prompt": "The fox", "max_tokens": 30, "stream": True, "guided_regex": pattern}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert re.fullmatch(pattern, streamed) and events[-1]["choices"][0]["finish_reason"] == "stop", events


SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "sure": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "source": {"type": "object", "properties": {"kind": {"const": "review"}}, "required": ["kind"],
                   "additionalProperties": False},
    },
    "required": ["sentiment", "sure", "tags", "source"],
    "additionalProperties": False,
}


@needs_xgrammar
@pytest.mark.parametrize("model", ["tiny-llama", "patterns"])
def test_a_chat_reply_under_a_json_schema_parses_and_validates(served, model):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}
    r = chat(served, model=model, max_tokens=120, response_format=fmt)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, SCHEMA)
    # The properties come in the schema's order.
    assert list(value) == list(SCHEMA["properties"])


@needs_xgrammar
def test_json_object_starts_an_object_whatever_the_model_prefers(served):
    tok = served.engine.tokenizer
    close = tok.encode("}", add_special_tokens=False)
    assert len(close) == 1
    # A +100 bias on "}" makes it the model's pick everywhere; the grammar still opens an
    # object first, then lets "}" close it, then only a stop token.
    body = dict(max_tokens=20, logit_bias={str(close[0]): 100}, response_format={"type": "json_object"})
    r = complete(served, **body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (json.loads(choice["text"]), choice["finish_reason"]) == ({}, "stop")
    assert r.json()["usage"]["completion_tokens"] == 3  # "{", "}", EOS
    # Without the grammar the same request writes "}" at once.
    free = complete(served, max_tokens=3, logit_bias={str(close[0]): 100}).json()["choices"][0]["text"]
    assert free.startswith("}")


@needs_xgrammar
def test_the_grammar_ends_the_output_even_with_ignore_eos_and_before_min_tokens(served):
    for extra in (dict(ignore_eos=True), dict(min_tokens=30)):
        r = complete(served, max_tokens=60, structured_outputs={"choice": ["no"]}, **extra)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("no", "stop"), (extra, choice)
        assert r.json()["usage"]["completion_tokens"] <= 3


@needs_xgrammar
def test_min_tokens_holds_where_the_grammar_may_go_on(served):
    """min_tokens yields only where the grammar allows nothing but a stop token: after "7",
    "[0-9]+" is matched whole but "78" continues it, so EOS stays banned until min_tokens, as
    without a grammar. (min_tokens yielded at every whole match: EOS, +100 here, came second.)"""
    eos = served.engine.tokenizer.eos_token_id
    for extra in (dict(), dict(ignore_eos=True, stop_token_ids=[eos])):
        r = complete(served, max_tokens=20, min_tokens=4, logit_bias={str(eos): 100}, guided_regex="[0-9]+", **extra)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert re.fullmatch("[0-9]+", choice["text"]) and choice["finish_reason"] == "stop", (extra, choice)
        assert r.json()["usage"]["completion_tokens"] == 5, (extra, r.json())  # 4 digits' tokens, then EOS


@needs_xgrammar
def test_the_grammar_wins_over_masks_that_leave_it_nothing(served):
    tok = served.engine.tokenizer
    other = tok.encode("zzz", add_special_tokens=False)
    # allowed_token_ids holds no token of either choice: the grammar's tokens are sampled.
    r = complete(served, max_tokens=30, allowed_token_ids=other, structured_outputs={"choice": CHOICES})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in CHOICES


@needs_xgrammar
def test_bad_specs_are_400s_and_the_server_goes_on(served):
    cases = [
        (dict(structured_outputs={"regex": "[a-"}), "structured_outputs"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objx"}}}), "response_format"),
        (dict(guided_grammar="root ::= "), "guided_grammar"),
        (dict(guided_json={"type": "object"}, guided_regex="a"), "guided_regex"),
    ]
    for body, param in cases:
        r = complete(served, max_tokens=4, **body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert "/project/" not in err["message"] and ".cc:" not in err["message"], err  # no engine source paths
        r = chat(served, max_tokens=4, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = complete(served, max_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@needs_xgrammar
@pytest.mark.parametrize("grammar", ["root ::= item\nitem ::= root", 'root ::= root "a"'])
def test_a_grammar_that_matches_nothing_is_a_400(served, grammar):
    """Rules that only ever call themselves compile, but allow no first token: the request
    sampled a token its grammar refused, and ended in a 500 (adapter_load_failed)."""
    for body, param in ((dict(guided_grammar=grammar), "guided_grammar"),
                        (dict(structured_outputs={"grammar": grammar}), "structured_outputs")):
        for r in (complete(served, max_tokens=4, **body), chat(served, max_tokens=4, **body)):
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and "matches no output" in err["message"], err


@needs_xgrammar
def test_a_grammar_that_dead_ends_mid_output_is_the_clients_error_not_an_adapter_failure(served):
    """After "ok" this grammar allows no token (tail only calls itself): no compile-time check
    sees that, and the request cannot go on. It is the spec's fault, not the adapter's."""
    grammar = 'root ::= "ok" tail\ntail ::= tail'
    r = complete(served, max_tokens=8, guided_grammar=grammar)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "grammar_dead_end", r.text
    import httpx

    with httpx.stream("POST", served.url + "/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "The fox", "max_tokens": 8, "stream": True,
            "guided_grammar": grammar}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "grammar_dead_end", events


@needs_xgrammar
@pytest.mark.parametrize("schema", [{"anyOf": []}, {"oneOf": []}])
def test_a_json_schema_that_matches_only_the_empty_output_is_a_400(served, schema):
    """xgrammar compiles an empty anyOf or oneOf to a grammar of the empty output: the answer
    was "" with finish_reason "stop", which no JSON parser reads. (An empty output stays
    allowed where a regex or a grammar asks for it.)"""
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for r in (complete(served, max_tokens=8, response_format=fmt), chat(served, max_tokens=8, response_format=fmt)):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and "no JSON value" in err["message"], err
    r = complete(served, max_tokens=8, guided_regex="(ab)?")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("", "ab"), r.text


@needs_xgrammar
def test_stop_token_ids_outside_the_vocabulary_change_nothing_under_a_grammar(served):
    """Such ids are never sampled, with a grammar as without one (the sampler drops them);
    the grammar engine refused them as stop tokens: a 503 that showed its C++ source line."""
    vocab = served.engine.cfg.vocab_size
    plain = complete(served, max_tokens=10, guided_regex="[0-9]{3}")
    assert plain.status_code == 200, plain.text
    r = complete(served, max_tokens=10, guided_regex="[0-9]{3}", stop_token_ids=[vocab, 10**6, -1])
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain.json()["choices"]
    assert re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"])


def test_without_the_grammar_engine_a_structured_request_is_a_400_and_others_are_served(served, monkeypatch):
    import loraplex.server.api.deps as deps

    monkeypatch.setattr(deps, "structured_outputs_available", lambda: False)
    r = complete(served, max_tokens=4, response_format={"type": "json_object"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("structured_outputs_unavailable", "response_format")
    assert "xgrammar" in err["message"]
    assert complete(served, max_tokens=4).status_code == 200
