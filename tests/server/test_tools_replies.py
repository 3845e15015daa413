"""Tool calling's replies over HTTP, as OpenAI's clients read them: finish_reason, calls with
echo, tools without parameters or with `$defs`, and the refusals of tools the server cannot
serve as asked (server/api/tools.py, server/api/chat.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from loraplex.server.structured import available

from .conftest import merged_calls, serve_tiny_llama

needs_xgrammar = pytest.mark.skipif(not available(), reason="xgrammar is not installed")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters) as server:
        yield server


def body(**fields) -> dict:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "temperature": 0, "max_tokens": 120, **fields}


def chat(url, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json=body(**fields))


def stream(url, **fields) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json=body(stream=True, **fields)) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def streamed_reply(events: list[dict], index: int = 0) -> tuple[str, list[dict], str | None]:
    """(content, calls, finish_reason) of one choice of a stream (its calls merged from their deltas)."""
    choices = [c for e in events for c in e["choices"] if c["index"] == index]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    calls = merged_calls([t for c in choices for t in c["delta"].get("tool_calls", [])])
    return content, calls, choices[-1]["finish_reason"]


@needs_xgrammar
def test_required_calls_finish_with_tool_calls_streamed_too(served):
    # OpenAI's (and vLLM's) finish_reason where "required" made calls; a named tool's is "stop".
    content, calls, reason = streamed_reply(stream(served.url, tools=[WEATHER, TIME], tool_choice="required"))
    assert calls and reason == "tool_calls" and content == "", (content, calls, reason)
    assert chat(served.url, tools=[WEATHER, TIME], tool_choice="required").json()["choices"][0]["finish_reason"] \
        == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert chat(served.url, tools=[WEATHER, TIME], tool_choice=named).json()["choices"][0]["finish_reason"] == "stop"
    # Cut by max_tokens before a call's name is whole: the text is the content, finish_reason "length".
    choice = chat(served.url, tools=[WEATHER, TIME], tool_choice="required", max_tokens=4).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"], choice


@needs_xgrammar
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_echo_keeps_the_calls_as_streamed(served, tool_choice):
    # vLLM's echo: the final assistant message starts the content; the reply after it is
    # still read for calls (the stream read them; the whole response read the echo as JSON).
    fields = dict(messages=[{"role": "user", "content": "time?"}, {"role": "assistant", "content": "Sure"}],
                  add_generation_prompt=False, continue_final_message=True, echo=True, tools=[WEATHER, TIME],
                  tool_choice=tool_choice)
    message = chat(served.url, **fields).json()["choices"][0]["message"]
    content, calls, _ = streamed_reply(stream(served.url, **fields))
    assert message["content"] == content == "Sure", (message, content)
    assert [c["function"] for c in message.get("tool_calls", [])] == [c["function"] for c in calls] != [], message


@needs_xgrammar
@pytest.mark.parametrize("function", [{"name": "ping"}, {"name": "ping", "parameters": {}}])
def test_a_tool_without_parameters_is_called_with_none(served, function):
    # OpenAI: "omitting parameters defines a function with an empty parameter list". Held to
    # any object instead, the random model wrote keys until max_tokens cut the call.
    ping = {"type": "function", "function": function}
    for tool_choice in ("required", {"type": "function", "function": {"name": "ping"}}):
        choice = chat(served.url, tools=[ping], tool_choice=tool_choice, max_tokens=40).json()["choices"][0]
        calls = choice["message"].get("tool_calls")
        assert calls and all(c["function"] == {"name": "ping", "arguments": "{}"} for c in calls), choice


def test_two_tools_of_one_name_are_refused(served):
    # A call names its function and nothing else, so a client could not tell which of the two
    # it is; a named tool_choice held the reply to the first one's parameters, silently.
    other = {"type": "function", "function": {"name": "get_weather", "parameters": TIME["function"]["parameters"]}}
    for tool_choice in ("none", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = chat(served.url, tools=[WEATHER, other], tool_choice=tool_choice, max_tokens=5)
        assert r.status_code == 400, (tool_choice, r.text)
        error = r.json()["error"]
        assert error["param"] == "tools" and "get_weather" in error["message"], error


@needs_xgrammar
def test_a_named_call_cut_by_max_tokens_is_still_the_call_streamed_and_not(served):
    """OpenAI's: a forced function's reply cut by max_tokens is that call with its arguments
    cut, finish_reason "length" (it was the text, as content). Streamed, the arguments come
    piece by piece, and together they are the whole response's."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(served.url, tools=[WEATHER, TIME], tool_choice=named, max_tokens=40).json()["choices"][0]
    whole_args = whole["message"]["tool_calls"][0]["function"]["arguments"]
    json.loads(whole_args)
    choice = chat(served.url, tools=[WEATHER, TIME], tool_choice=named, max_tokens=3).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"], choice
    cut = call["function"]["arguments"]
    assert call["function"]["name"] == "get_weather" and cut and whole_args.startswith(cut) and cut != whole_args
    content, calls, reason = streamed_reply(stream(served.url, tools=[WEATHER, TIME], tool_choice=named, max_tokens=3))
    assert content == "" and reason == "length"
    assert [c["function"] for c in calls] == [call["function"]]
