"""tool_choice "auto" end to end: a server with --enable-auto-tool-choice and each
--tool-call-parser, its replies read for calls streamed and not, n > 1; and conversations
with earlier calls through templates shaped like Qwen2.5's and Llama 3.1's."""

from __future__ import annotations

import json

import httpx
import pytest

from loraplex.server.api.schemas import ChatCompletionRequest
from loraplex.server.demo import build_tokenizer
from loraplex.server.structured import available
from loraplex.server.tokenizer import Tokenizer

from .conftest import serve_tiny_llama

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
# The random model writes no call by itself: a structured output holds it to the text a model
# taught the parser's format writes (under "auto" the reply is then read as any other).
WRITES = {
    "hermes": {"regex": r'Checking\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}'
                        r'\n</tool_call>'},
    "llama3_json": {"json": {"type": "object", "properties": {
        "name": {"const": "get_time"}, "parameters": TIME["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False}},
}


@pytest.mark.skipif(not available(), reason="xgrammar is not installed")
@pytest.mark.parametrize("parser", sorted(WRITES))
def test_auto_reads_the_calls_streamed_and_not(hf_llama, llama_adapters, parser):
    content = "Checking." if parser == "hermes" else None
    fields = {"model": "tiny-llama", "messages": [{"role": "user", "content": "time?"}], "tools": [TIME],
              "structured_outputs": WRITES[parser], "n": 2, "seed": 1, "temperature": 1, "max_tokens": 120}
    with serve_tiny_llama(hf_llama, llama_adapters, enable_auto_tool_choice=True, tool_call_parser=parser) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json=fields)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            message = choice["message"]
            assert message["content"] == content and choice["finish_reason"] == "tool_calls", choice
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"])["zone"]
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60,
                          json=fields | {"stream": True, "stream_options": {"include_usage": True}}) as st:
            events = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == r.json()["usage"]
    for j, whole in enumerate(r.json()["choices"]):
        deltas = [c for e in events for c in e["choices"] if c["index"] == j]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert ("".join(c["delta"].get("content") or "" for c in deltas) or None) == content
        calls = [t for c in deltas for t in c["delta"].get("tool_calls", [])]
        assert [(t["index"], t["function"]) for t in calls] == [(0, whole["message"]["tool_calls"][0]["function"])]
        assert [c["finish_reason"] for c in deltas if c["finish_reason"]] == ["tool_calls"]


# Written after the shape of Qwen2.5's and Llama 3.1's templates: what they read of a message.
QWEN_LIKE = (
    "{%- if tools %}<|system|>{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls %}{% if c.function is defined %}{% set c = c.function %}{% endif %}"
    "<tool_call>{\"name\": \"{{ c.name }}\", \"arguments\": {{ c.arguments | tojson }}}</tool_call>{% endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response><|end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}<|assistant|>")
LLAMA_LIKE = (
    "{%- for m in messages %}"
    "{%- if 'tool_calls' in m %}{% if m.tool_calls | length != 1 %}{{ raise_exception('one call at a time') }}"
    "{% endif %}{% set c = m.tool_calls[0].function %}"
    "<|assistant|>{\"name\": \"{{ c.name }}\", \"parameters\": {{ c.arguments | tojson }}}<|end|>"
    "{%- elif m.role == 'tool' %}<|user|>{% if m.content is mapping %}{{ m.content | tojson }}"
    "{% else %}{{ m.content }}{% endif %}<|end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endif %}{% endfor %}<|assistant|>")


@pytest.mark.parametrize("template,call", [
    (QWEN_LIKE, '<tool_call>{"name": "get_time", "arguments": {"zone": "CET", "note": "Zürich <b>"}}</tool_call>'),
    (LLAMA_LIKE, '{"name": "get_time", "parameters": {"zone": "CET", "note": "Zürich <b>"}}'),
])
def test_an_assistant_turn_of_calls_with_null_content_renders_as_the_model_learned_it(tmp_path, template, call):
    build_tokenizer(tmp_path, vocab_size=400, chat_template=template)
    tok = Tokenizer(tmp_path)
    body = ChatCompletionRequest(model="m", tools=[TIME], messages=[
        {"role": "user", "content": "time in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "CET", "note": "Zürich <b>"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
    text = tok.decode(tok.apply_chat_template(body.chat_messages(), **body.template_options()), False)
    # The arguments as the JSON the model wrote (no escapes of "<" or "ü"), no "None" for the content.
    assert f"<|assistant|>{call}<|end|>" in text and "None" not in text, text
    assert "<tool_response>12:00</tool_response>" in text or "<|user|>12:00<|end|>" in text, text
