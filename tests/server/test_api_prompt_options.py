"""vLLM's request fields that shape the prompt: served as vLLM serves them, or refused with a
400 naming the field where vLLM refuses them too. They were all accepted and silently
dropped, so a client asking to continue an assistant message, to render without the
generation prompt, or to pass `chat_template_kwargs` (Qwen3's `enable_thinking`, say) got an
answer to another prompt than the one it asked for, with no sign of it.

The test server's tokenizer has the demo chat template, which reads `messages`,
`add_generation_prompt`, `bos_token` and `eos_token`."""

from __future__ import annotations

import httpx
import pytest

from loraplex.server.tokenizer import Tokenizer

from .test_http import error_of

CHAT = {"model": "qv-r8", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
        "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("options", [
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_special_tokens": True},
    {"chat_template_kwargs": {"bos_token": "<|user|>"}},  # a name the template reads
])
def test_chat_prompt_options_shape_the_prompt_as_vllm_does(served, hf_llama, options):
    """The prompt is the tokenizer's template rendered with these options (the rendering itself
    is checked against transformers in test_api_chat_template), streamed or not."""
    tok = Tokenizer(hf_llama)
    messages = CHAT["messages"]
    default = tok.apply_chat_template(messages)
    want = tok.apply_chat_template(messages, add_generation_prompt=options.get("add_generation_prompt", True),
                                   continue_final_message=options.get("continue_final_message", False),
                                   template_kwargs=options.get("chat_template_kwargs"),
                                   add_special_tokens=options.get("add_special_tokens", False))
    assert want != default
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=CHAT | options)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        with c.stream("POST", "/v1/chat/completions", json=CHAT | options | {
                "stream": True, "stream_options": {"include_usage": True}}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert '"prompt_tokens":%d' % len(want) in lines[-1]


@pytest.mark.parametrize("options, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default generation prompt
    ({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, "chat_template"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_chat_prompt_options_vllm_refuses_are_refused_by_name(served, options, param):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json=CHAT | options | {"stream": stream})
            assert r.status_code == 400 and error_of(r)["param"] == param, r.text


def test_documents_reach_the_template(served):
    # The demo template reads none: neutral there (the rendering with documents is checked
    # against transformers in test_api_chat_template).
    with httpx.Client(base_url=served.url, timeout=30) as c:
        before = c.post("/v1/chat/completions", json=CHAT).json()
        r = c.post("/v1/chat/completions", json=CHAT | {"documents": [{"title": "t", "text": "x"}]})
        assert r.status_code == 200 and r.json()["choices"] == before["choices"], r.text
        r = c.post("/v1/chat/completions", json=CHAT | {"documents": ["not a dict"]})
        assert r.status_code == 400 and error_of(r)["param"].startswith("documents"), r.text


@pytest.mark.parametrize("field, value", [
    ("add_generation_prompt", True), ("continue_final_message", False), ("add_special_tokens", False),
    ("chat_template", None), ("chat_template_kwargs", {}), ("chat_template_kwargs", None),
    ("chat_template_kwargs", {"enable_thinking": False}),  # the demo template never reads it
    ("documents", None), ("documents", []),
])
def test_chat_prompt_options_with_their_neutral_values_are_served(served, field, value):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        want = c.post("/v1/chat/completions", json=CHAT).json()
        r = c.post("/v1/chat/completions", json=CHAT | {field: value})
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == want["choices"] and r.json()["usage"] == want["usage"]


def test_the_tokenizers_own_chat_template_sent_back_is_served(served, hf_llama):
    template = Tokenizer(hf_llama).chat_template
    assert template and "add_generation_prompt" in template
    with httpx.Client(base_url=served.url, timeout=30) as c:
        want = c.post("/v1/chat/completions", json=CHAT).json()
        r = c.post("/v1/chat/completions", json=CHAT | {"chat_template": template})
        assert r.status_code == 200 and r.json()["choices"] == want["choices"], r.text


def test_completions_add_special_tokens_false_leaves_bos_out(served, hf_llama):
    # vLLM's completions take add_special_tokens (default true); false tokenizes the prompt
    # without BOS. It was ignored: the model saw a BOS the client had asked to leave out.
    tok = Tokenizer(hf_llama)
    text = "The quick brown fox"
    with_bos, without = tok.encode(text), tok.encode(text, add_special_tokens=False)
    assert with_bos == [tok.bos_token_id] + without
    body = {"model": "qv-r8", "prompt": text, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "echo": True}
    with httpx.Client(base_url=served.url, timeout=30) as c:
        def run(**extra):
            r = c.post("/v1/completions", json=body | extra)
            assert r.status_code == 200, r.text
            return r.json()
        plain, explicit, off = run(), run(add_special_tokens=True), run(add_special_tokens=False)
        ids_off = run(prompt=without)
        # The same tokens and logprobs (to float rounding: a request may get another KV row, so
        # another decode batch, as the prefix cache keeps the rows of requests before it).
        def same(a, b):
            assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-5)
        same(plain["choices"][0], explicit["choices"][0])
        assert plain["usage"]["prompt_tokens"] == len(with_bos)
        assert off["usage"]["prompt_tokens"] == len(without)
        # The same tokens as the prompt sent as ids without BOS (logprobs: the same model input).
        same(off["choices"][0], ids_off["choices"][0])
        assert off["choices"][0]["logprobs"]["tokens"][0] != plain["choices"][0]["logprobs"]["tokens"][0]
        # Streamed too.
        with c.stream("POST", "/v1/completions", json=body | {"add_special_tokens": False, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert '"prompt_tokens":%d' % len(without) in lines[-1]


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(served):
    # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N", so tokens that
    # decode alike (pieces of a UTF-8 character, all "\ufffd") stay apart. It was ignored: the
    # client parsing "token_id:N" got decoded text.
    with httpx.Client(base_url=served.url, timeout=30) as c:
        body = {"model": "qv-r8", "prompt": [1, 40, 41], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 2, "echo": True}
        plain = c.post("/v1/completions", json=body).json()["choices"][0]
        r = c.post("/v1/completions", json=body | {"return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert r.json()["choices"][0]["text"] == plain["text"]
        assert lp["tokens"][:3] == ["token_id:1", "token_id:40", "token_id:41"]
        assert all(t.startswith("token_id:") for t in lp["tokens"])
        # To float rounding: the second request may decode in another KV row (the prefix cache
        # keeps the first one's), so in another batch.
        assert lp["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
        assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]

        chat = {"model": "qv-r8", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json=chat | {"return_tokens_as_token_ids": True, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                import json
                contents = [e for line in r.text.splitlines() if line.startswith("data: {")
                            for e in ((json.loads(line[6:])["choices"] or [{}])[0].get("logprobs") or {})
                            .get("content", [])]
            else:
                contents = r.json()["choices"][0]["logprobs"]["content"]
            assert len(contents) == 3
            for e in contents:
                assert e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
                assert len(e["top_logprobs"]) == 2 and all(t["token"].startswith("token_id:") for t in e["top_logprobs"])
        plain = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
        assert not plain[0]["token"].startswith("token_id:")


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "structural_tag", '{"type": "structural_tag"}'),
    ("/v1/completions", "structural_tag", '{"type": "structural_tag"}'),
    ("/v1/completions", "prompt_embeds", "AAAA"),
])
def test_other_vllm_fields_that_change_the_output_are_refused(served, path, field, value):
    body = {"model": "qv-r8", "max_tokens": 2, field: value}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400 and error_of(r)["param"] == field, r.text
        assert c.post(path, json=body | {field: None}).status_code == 200


def test_tool_choice_that_asks_for_a_tool_call_is_refused(served):
    # tools are refused; tool_choice "required" or a named function without them was ignored,
    # and the client that demanded a tool call got plain text back.
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            r = c.post("/v1/chat/completions", json=CHAT | {"tool_choice": choice})
            assert r.status_code == 400 and error_of(r)["param"] == "tool_choice", r.text
        for choice in (None, "none", "auto"):
            assert c.post("/v1/chat/completions", json=CHAT | {"tool_choice": choice, "tools": []}).status_code == 200


def test_chat_echo_prepends_a_final_assistant_message_as_vllm_does(served):
    # vLLM's chat echo: the reply starts with the last message's content when that message
    # is the assistant's (the reply's role); otherwise it changes nothing. It was ignored.
    import json
    with httpx.Client(base_url=served.url, timeout=30) as c:
        want = c.post("/v1/chat/completions", json=CHAT | {"n": 2}).json()
        r = c.post("/v1/chat/completions", json=CHAT | {"n": 2, "echo": True})
        assert r.status_code == 200, r.text
        got = r.json()
        assert [ch["message"]["content"] for ch in got["choices"]] == \
            ["Sure" + ch["message"]["content"] for ch in want["choices"]]
        assert got["usage"] == want["usage"]
        with c.stream("POST", "/v1/chat/completions", json=CHAT | {"n": 2, "echo": True, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        for j in range(2):
            parts = [ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"][0]["index"] == j]
            assert parts[:2] == ["", "Sure"] and "".join(parts) == got["choices"][j]["message"]["content"]
        # The last message the user's: nothing to echo.
        user_last = CHAT | {"messages": CHAT["messages"][:1]}
        assert c.post("/v1/chat/completions", json=user_last | {"echo": True}).json()["choices"] == \
            c.post("/v1/chat/completions", json=user_last).json()["choices"]
