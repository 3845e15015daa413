"""The schemas a forced tool_choice holds a reply to (server/api/tools.py): tools whose
parameters refer within themselves ($defs, "#"), checked by jsonschema and over HTTP."""

from __future__ import annotations

import json

import jsonschema
import pytest

from loraplex.server.api.schemas import ChatCompletionRequest
from loraplex.server.api.tools import required_schema
from loraplex.server.structured import available

from .conftest import serve_tiny_llama

needs_xgrammar = pytest.mark.skipif(not available(), reason="xgrammar is not installed")

# Pydantic's shape of a model with a nested model and an enum: references into $defs.
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "$defs": {"City": {"enum": ["Paris", "Oslo"]},
                                "Stay": {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"},
                                                                          "nights": {"enum": [1, 2]}},
                                         "required": ["city", "nights"], "additionalProperties": False}},
    "properties": {"stay": {"$ref": "#/$defs/Stay"}}, "required": ["stay"], "additionalProperties": False}}}
# A recursive one ("#": the parameters themselves), with a property named like a keyword.
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"const": {"enum": ["x"]},
                                     "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["const", "child"], "additionalProperties": False}}}


def tools_of(*tools) -> list:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=list(tools)).tools


@pytest.mark.parametrize("tools", [[BOOK], [BOOK, TREE]])
def test_a_required_schema_keeps_the_tools_references(tools):
    schema = required_schema(tools_of(*tools), one=False)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "book", "parameters": {"stay": {"city": "Oslo", "nights": 2}}}]
    if len(tools) == 2:
        good.append({"name": "tree", "parameters": {"const": "x", "child": {"const": "x", "child": None}}})
    jsonschema.validate(good, schema)
    bad = [{"name": "book", "parameters": {"stay": {"city": "Rome", "nights": 2}}}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    if len(tools) == 2:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "tree", "parameters": {"const": "x", "child": {"child": None}}}], schema)
    # The tools' own schemas are left as they were.
    assert tools_of(*tools)[0].function.parameters["properties"]["stay"] == {"$ref": "#/$defs/Stay"}


@needs_xgrammar
def test_required_calls_of_tools_with_defs_over_http(hf_llama, llama_adapters):
    import httpx

    with serve_tiny_llama(hf_llama, llama_adapters) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "book Oslo"}], "temperature": 0,
            "max_tokens": 200, "tools": [BOOK, TREE], "tool_choice": "required"})
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        for call in calls:
            tool = {"book": BOOK, "tree": TREE}[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_tools_schemas_are_bounded_as_any_structured_output(tool_choice):
    from loraplex.server.structured import MAX_SPEC_CHARS

    # The same schema as a response_format is refused at once; as tools it went to the grammar
    # compiler (a 1.4M-character enum took a minute there), whatever the size.
    values = [f"value-{i:06d}" for i in range(MAX_SPEC_CHARS // 14)]
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]}}}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[pick],
                                 tool_choice=tool_choice)
    why, param = body.refusal()
    assert param == "tools" and str(MAX_SPEC_CHARS) in why, why
    as_format = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": pick["function"]["parameters"]}})
    assert as_format.refusal()[1] == "response_format"
    # With tool_choice none (or auto) nothing is compiled: the tools only reach the template.
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[pick],
                                 tool_choice="none").refusal() is None
