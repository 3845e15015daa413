"""POST /v1/chat/completions: messages through the tokenizer's chat template (a plain
"role: content" template when it has none), `n` choices (index 0..n-1), SSE when streaming.

Streamed, each choice first gets a chunk with its role, then the chunks of all choices
interleave, each naming its `index`; each choice ends with its own finish_reason.

vLLM's `echo: true`: a reply starts with the last message's content when that message is
the assistant's (streamed, a chunk of its own after the role's), as vLLM answers it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from ..engine import AsyncEngine
from .auth import get_caller
from .deps import compile_grammar, get_engine, merged, open_choices, resolve_adapter, until_disconnected
from .errors import APIError
from .logprobs import chat_logprobs, prompt_logprobs
from .schemas import ChatCompletionRequest, new_id, now, usage
from .tools import ToolStream, finish_reason, read_reply
from .sse import sse_response

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 engine: AsyncEngine = Depends(get_engine)):
    # The model first, as vLLM checks it: an unknown one is a 404 whatever else is wrong.
    adapter = resolve_adapter(engine, body.model, get_caller(request))
    refusal = body.refusal() or body.vocab_refusal(engine.engine.cfg.vocab_size)
    if refusal:
        raise APIError(400, refusal[0], param=refusal[1])
    eng = engine.engine
    if eng.tokenizer is None:
        raise APIError(400, "this server has no tokenizer: use /v1/completions with token ids")
    refusal = body.prompt_refusal(eng.tokenizer.chat_template)
    if refusal:
        raise APIError(400, refusal[0], param=refusal[1])
    tools = body.tool_mode()
    if tools == "auto" and not (eng.settings.enable_auto_tool_choice and eng.settings.tool_call_parser):
        # vLLM's rule: what "auto" calls is read out of the reply, so the server must know how.
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                            'set (or send tool_choice "required", a named tool, or "none")', param="tool_choice")
    # How each reply is read for calls: a parser (auto), the held JSON (required, named), or not at all.
    parser = eng.settings.tool_call_parser if tools == "auto" else None
    reads_calls = tools != "none"
    try:  # off the event loop, which serves every stream: a long conversation takes seconds
        prompt = await asyncio.to_thread(eng.tokenizer.apply_chat_template, body.chat_messages(),
                                         **body.template_options())
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    # Without max_tokens a chat reply may use the rest of the context (as vLLM does).
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, eng.max_model_len - len(prompt))
    grammar = await compile_grammar(engine, body.grammar_spec())
    params = body.sampling(max_tokens, tokenizer=eng.tokenizer, grammar=grammar)
    streams = open_choices(engine, [prompt], body, params, adapter)
    rid, created = new_id("chatcmpl"), now()
    echoed = body.echoed()
    want_logprobs = params.logprobs is not None
    # With return_tokens_as_token_ids, the tokens are named as on a server without a tokenizer.
    lp_tokenizer = None if body.return_tokens_as_token_ids else eng.tokenizer

    def chunk(choices: list[dict], object_: str, usage_: dict | None = None) -> dict:
        return {"id": rid, "object": object_, "created": created, "model": body.model, "choices": choices,
                **({"usage": usage_} if usage_ is not None else {})}

    details = eng.settings.enable_prompt_tokens_details
    cached = [0] * len(streams)  # each choice's prompt tokens found in the prefix cache

    def total(completion_tokens: list[int]) -> dict:
        """The prompt counts once, however many choices (its cached tokens: the first's)."""
        return usage(len(prompt), sum(completion_tokens), cached[0] if details else None)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict]:
            for j in range(len(streams)):
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], "chat.completion.chunk")
            if echoed:
                for j in range(len(streams)):
                    yield chunk([{"index": j, "delta": {"content": echoed}, "logprobs": None,
                                  "finish_reason": None}], "chat.completion.chunk")
            counts = [0] * len(streams)
            splits = [ToolStream(parser, body) for _ in streams] if reads_calls else None
            async for j, out in merged(streams):
                counts[j], cached[j] = out.completion_tokens, out.cached_tokens
                text, deltas, reason = out.text, [], out.finish_reason
                if splits is not None:  # a call's text is held back, or streamed as its deltas
                    text = splits[j].feed(out.text)
                    if out.finished:
                        rest, calls = splits[j].end()
                        text, deltas = text + rest, splits[j].end_deltas(calls)
                        reason = finish_reason(tools, calls, reason)
                    else:
                        deltas = splits[j].call_deltas()
                # Tokens whose text is held back (a possible stop string) still bring their logprobs.
                if text or deltas or out.finished or (want_logprobs and out.token_ids):
                    lp = (chat_logprobs(lp_tokenizer, out.token_ids, out.logprobs, body.skip_special_tokens)
                          if want_logprobs else None)
                    done = reason if out.finished else None
                    if deltas:
                        if text or lp is not None:
                            yield chunk([{"index": j, "delta": {"content": text} if text else {}, "logprobs": lp,
                                          "finish_reason": None}], "chat.completion.chunk")
                        yield chunk([{"index": j, "delta": {"tool_calls": deltas}, "logprobs": None,
                                      "finish_reason": done}], "chat.completion.chunk")
                        continue
                    yield chunk([{"index": j, "delta": {"content": text} if text else {},
                                  "logprobs": lp, "finish_reason": done}], "chat.completion.chunk")
            if include_usage:
                yield chunk([], "chat.completion.chunk", total(counts))

        return sse_response(events())

    async def collect() -> dict:
        texts = [echoed] * len(streams)
        reasons: list[str | None] = [None] * len(streams)
        counts = [0] * len(streams)
        ids: list[list[int]] = [[] for _ in streams]
        lps: list[list] = [[] for _ in streams]
        prompt_lps: list | None = None  # the prompt's, from the first choice's request
        async for j, out in merged(streams):
            if out.prompt_logprobs is not None and prompt_lps is None:
                prompt_lps = out.prompt_logprobs
            texts[j] += out.text
            counts[j], cached[j] = out.completion_tokens, out.cached_tokens
            if want_logprobs:
                ids[j] += out.token_ids
                lps[j] += out.logprobs
            if out.finished:
                reasons[j] = out.finish_reason
        messages = [{"role": "assistant", "content": texts[j]} for j in range(len(streams))]
        if reads_calls:
            for j in range(len(streams)):
                # The reply alone is read for calls (as streamed); the echoed message stays its content's start.
                content, calls = read_reply(parser, body, texts[j][len(echoed):])
                if calls:
                    messages[j] = {"role": "assistant", "content": (echoed + (content or "")) or None,
                                   "tool_calls": [c.as_openai() for c in calls]}
                    reasons[j] = finish_reason(tools, calls, reasons[j])
        response = chunk([{"index": j, "message": messages[j],
                           "logprobs": (chat_logprobs(lp_tokenizer, ids[j], lps[j], body.skip_special_tokens)
                                        if want_logprobs else None),
                           "finish_reason": reasons[j]} for j in range(len(streams))], "chat.completion",
                         total(counts))
        if body.prompt_logprobs is not None:  # vLLM's, beside the choices: the rendered prompt's
            response["prompt_logprobs"] = prompt_logprobs(lp_tokenizer, prompt, prompt_lps or [],
                                                          body.prompt_logprobs, body.skip_special_tokens)
        return response

    return await until_disconnected(request, collect())
