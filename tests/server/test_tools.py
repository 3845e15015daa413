"""Tool calling on chat completions (server/api/tools.py): the parsers that read calls out of
an "auto" reply, the streamed split of a reply into content and calls, the tools and earlier
calls as the chat template reads them, and requests over HTTP whose replies are held to the
tools' schemas (tool_choice "required" and a named tool)."""

from __future__ import annotations

import json

import pytest

from loraplex.server.api.schemas import ChatCompletionRequest
from loraplex.server.api.tools import ToolCall, ToolStream, parse_hermes, parse_llama3_json
from loraplex.server.settings import ServerSettings
from loraplex.server.structured import available

from .conftest import merged_calls, serve_tiny_llama

needs_xgrammar = pytest.mark.skipif(not available(), reason="xgrammar is not installed")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


# -- reading calls out of a reply ---------------------------------------------------------------


def test_hermes_reads_the_blocks_and_the_text_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}')  # the last one cut
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert calls == [ToolCall("get_weather", '{"city": "Paris", "unit": "C"}'), ToolCall("get_time", '{"zone": "UTC"}')]
    assert parse_hermes("no calls here") == ("no calls here", [])
    bad = 'x <tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parse_hermes(bad) == (bad, [])  # not JSON: the reply is the content, whole
    assert parse_hermes('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name


def test_llama3_json_reads_a_reply_that_is_calls():
    assert parse_llama3_json('{"name": "get_time", "parameters": {"zone": "CET"}}') == \
        (None, [ToolCall("get_time", '{"zone": "CET"}')])
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    assert parse_llama3_json(two) == (None, [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')])
    for text in ("The weather is fine.", '{"name": "a", "parameters": {} trailing', '{"no": "name"}'):
        assert parse_llama3_json(text) == (text, [])


def feed_all(split: ToolStream, text: str) -> str:
    return "".join(split.feed(c) for c in text)  # one character a delta: the hardest split


def test_a_streamed_hermes_reply_sends_its_text_and_holds_its_calls():
    text = 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    split = ToolStream("hermes")
    assert feed_all(split, text) == "Sure"  # the space before the call is no part of the content
    assert split.end() == ("", [ToolCall("get_time", '{"zone": "UTC"}')])
    # Text that only looked like the start of a tag goes out once it is not one.
    split = ToolStream("hermes")
    sent = feed_all(split, "a <tool> b <tool_ca")
    assert sent == "a <tool> b" and split.end() == (" <tool_ca", [])
    # A malformed call: what was held comes out as content at the end.
    split = ToolStream("hermes")
    sent = feed_all(split, "x <tool_call>{oops")
    assert sent + split.end()[0] == "x <tool_call>{oops" and split.end()[1] == []


def test_a_streamed_llama3_reply_is_held_only_when_it_starts_as_a_call():
    split = ToolStream("llama3_json")
    assert feed_all(split, "  Hello {there}") == "  Hello {there}" and split.end() == ("", [])
    call = ' {"name": "get_time", "parameters": {"zone": "UTC"}}'
    split = ToolStream("llama3_json")
    assert feed_all(split, call) == "" and split.end() == ("", [ToolCall("get_time", '{"zone": "UTC"}')])
    split = ToolStream("llama3_json")
    assert feed_all(split, "<|python_tag|>" + call) == ""
    split = ToolStream("llama3_json")
    assert feed_all(split, "<|pyth") == "" and feed_all(split, "on is fun") == "<|python is fun"


# -- the request's fields ---------------------------------------------------------------------


def chat_body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_choice_modes_and_refusals():
    assert chat_body().tool_mode() == "none"
    assert chat_body(tools=[WEATHER]).tool_mode() == "auto"
    assert chat_body(tools=[WEATHER], tool_choice="none").grammar_spec() is None
    named = chat_body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tool_mode() == "named"
    assert json.loads(named.grammar_spec().value) == TIME["function"]["parameters"]
    required = json.loads(chat_body(tools=[WEATHER, TIME], tool_choice="required",
                                    parallel_tool_calls=False).grammar_spec().value)
    assert required["type"] == "array" and required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    cases = [
        (chat_body(tool_choice="required"), "tool_choice", "needs tools"),
        (chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice", "not one of the tools"),
        (chat_body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "tool_choice", "cannot be combined"),
    ]
    for body, param, words in cases:
        why, got = body.refusal()
        assert got == param and words in why, (why, got)


def test_settings_need_a_known_parser_for_auto():
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerSettings(dummy_weights="tiny", enable_auto_tool_choice=True).validate()
    with pytest.raises(ValueError, match="--tool-call-parser 'xml'"):
        ServerSettings(dummy_weights="tiny", tool_call_parser="xml").validate()
    ServerSettings(dummy_weights="tiny", enable_auto_tool_choice=True, tool_call_parser="hermes").validate()


def test_the_template_sees_the_tools_and_earlier_calls_with_their_arguments_as_objects(tmp_path):
    from loraplex.server.demo import build_tokenizer
    from loraplex.server.tokenizer import Tokenizer

    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}call {{ c.function.name }} {{ c.function.arguments.city }}"
                "{% endfor %}{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{% endfor %}")
    build_tokenizer(tmp_path, vocab_size=400, chat_template=template)
    tok = Tokenizer(tmp_path)
    body = chat_body(tools=[WEATHER, TIME], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "-3"}])
    ids = tok.apply_chat_template(body.chat_messages(), **body.template_options())
    assert tok.decode(ids) == ("[tool get_weather][tool get_time]<user>weather?<assistant>call get_weather Oslo"
                               "<tool>-3 for call1")
    # Arguments sent as an object (vLLM takes them so) render the same.
    as_object = body.model_copy(deep=True)
    as_object.messages[1].tool_calls[0].function.arguments = {"city": "Oslo", "unit": "C"}
    assert tok.apply_chat_template(as_object.chat_messages(), **as_object.template_options()) == ids
    assert chat_body(messages=[{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": {"x": 1}}}]}]).chat_messages()[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


# -- over HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters) as server:
        yield server


def chat(url, **body):
    import httpx

    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "temperature": 0, "max_tokens": 120, **body})


def check_call(call: dict, tools: list[dict]) -> dict:
    import jsonschema

    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-"), call
    tool = next(t for t in tools if t["function"]["name"] == call["function"]["name"])
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@needs_xgrammar
@pytest.mark.parametrize("model", ["tiny-llama", "all-r16"])
def test_required_makes_calls_of_the_tools(served, model):
    r = chat(served.url, model=model, tools=[WEATHER, TIME], tool_choice="required")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and calls and choice["finish_reason"] == "tool_calls", choice
    for call in calls:
        check_call(call, [WEATHER, TIME])
    r = chat(served.url, model=model, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1, r.text


@needs_xgrammar
def test_a_named_tool_is_called_streamed_and_not(served):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(served.url, tools=[WEATHER, TIME], tool_choice=choice)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = check_call(call, [WEATHER])
    import httpx

    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60, json={
            "model": "qv-r8", "messages": [{"role": "user", "content": "Paris?"}], "temperature": 0,
            "max_tokens": 120, "stream": True, "tools": [WEATHER, TIME], "tool_choice": choice}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not any(d.get("content") for d in deltas)  # the call's JSON is never sent as text
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(pieces) > 2  # as OpenAI's: the id and name first, then the arguments as they come
    (streamed,) = merged_calls(pieces)
    assert streamed["index"] == 0 and streamed["function"]["name"] == "get_weather"
    assert set(json.loads(streamed["function"]["arguments"])) == set(args)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@needs_xgrammar
def test_a_conversation_with_earlier_calls_and_tool_answers_is_served(served):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "-3"}]
    r = chat(served.url, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"], r.text


def test_auto_needs_the_servers_parser(served):
    r = chat(served.url, tools=[WEATHER])  # tool_choice defaults to auto with tools
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = chat(served.url, tools=[{"type": "function", "function": {"name": "bad name!"}}], tool_choice="none")
    assert r.status_code == 400 and "tools" in r.json()["error"]["param"], r.text
    r = chat(served.url, tools=[WEATHER], tool_choice="none", max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_auto_with_a_parser_gives_text_replies_as_content(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters, enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        r = chat(s.url, tools=[WEATHER], max_tokens=8)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        # The random model writes no <tool_call>: its text is the content, streamed or not.
        assert choice["message"]["content"] and "tool_calls" not in choice["message"], choice
        assert choice["finish_reason"] == "length"
        import httpx

        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny-llama", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "temperature": 0, "max_tokens": 8, "stream": True, "tools": [WEATHER]}) as st:
            events = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        assert text == choice["message"]["content"]


@needs_xgrammar
def test_the_openai_client_reads_the_calls(served):
    from openai import OpenAI

    client = OpenAI(base_url=served.url + "/v1", api_key="unused")
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "time?"}],
                                       tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=120)
    calls = r.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} <= {"get_weather", "get_time"}
    stream = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0, max_tokens=120)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    (call,) = merged_calls([t.model_dump(exclude_none=True) for d in deltas for t in (d.tool_calls or [])])
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
