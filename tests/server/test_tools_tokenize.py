"""POST /tokenize of a conversation with tools: the prompt chat completions send, tools
and all, as vLLM's /tokenize counts it (server/api/tokenize.py)."""

from __future__ import annotations

import httpx

from loraplex.server.demo import build_tokenizer

from .conftest import make_hf_base, serve_tiny_llama

TOOL = {"type": "function", "function": {"name": "get_time", "description": "the time in a zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
# A template that shows the tools, as tool-calling models' templates do.
TEMPLATE = ("{% for t in tools or [] %}[{{ t.function.name }}: {{ t.function.description }}]{% endfor %}"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}<|assistant|>")


def test_tokenize_counts_the_tools_as_chat_completions_prompts_them(tmp_path):
    base = make_hf_base(tmp_path / "llama")
    build_tokenizer(base, vocab_size=320, chat_template=TEMPLATE)
    messages = [{"role": "user", "content": "what time is it?"}]
    with serve_tiny_llama(base, {}) as s:
        r = httpx.post(s.url + "/tokenize", json={"model": "tiny-llama", "messages": messages, "tools": [TOOL]})
        assert r.status_code == 200, r.text
        without = httpx.post(s.url + "/tokenize", json={"messages": messages}).json()["count"]
        assert r.json()["count"] > without
        chat = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "messages": messages, "tools": [TOOL], "tool_choice": "none", "max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"], chat.text
        bad = httpx.post(s.url + "/tokenize", json={"messages": messages, "tools": [{"type": "function"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text
        assert "function" in bad.json()["error"]["message"]
