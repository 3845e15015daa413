"""POST /v1/chat/completions: messages through the tokenizer's chat template (a plain
"role: content" template when it has none), SSE when streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from ..engine import AsyncEngine
from .deps import get_engine, merged, open_streams, resolve_adapter, until_disconnected
from .errors import APIError
from .logprobs import chat_logprobs
from .schemas import ChatCompletionRequest, new_id, now, usage
from .sse import sse_response

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 engine: AsyncEngine = Depends(get_engine)):
    refusal = body.refusal()
    if refusal:
        raise APIError(400, refusal[0], param=refusal[1])
    adapter = resolve_adapter(engine, body.model)
    eng = engine.engine
    if eng.tokenizer is None:
        raise APIError(400, "this server has no tokenizer: use /v1/completions with token ids")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        prompt = eng.tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    # Without max_tokens a chat reply may use the rest of the context (as vLLM does).
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, eng.max_model_len - len(prompt))
    params = body.sampling(max_tokens)
    streams = open_streams(engine, [prompt], params, adapter, body.model)
    rid, created = new_id("chatcmpl"), now()
    want_logprobs = params.logprobs is not None

    def chunk(choices: list[dict], object_: str, usage_: dict | None = None) -> dict:
        return {"id": rid, "object": object_, "created": created, "model": body.model, "choices": choices,
                **({"usage": usage_} if usage_ is not None else {})}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict]:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], "chat.completion.chunk")
            last = None
            async for _, out in merged(streams):
                last = out
                # Tokens whose text is held back (a possible stop string) still bring their logprobs.
                if out.text or out.finished or (want_logprobs and out.token_ids):
                    lp = chat_logprobs(eng.tokenizer, out.token_ids, out.logprobs) if want_logprobs else None
                    yield chunk([{"index": 0, "delta": {"content": out.text} if out.text else {},
                                  "logprobs": lp, "finish_reason": out.finish_reason if out.finished else None}],
                                "chat.completion.chunk")
            if include_usage and last is not None:
                yield chunk([], "chat.completion.chunk", usage(last.prompt_tokens, last.completion_tokens))

        return sse_response(events())

    async def collect() -> dict:
        text, reason, last = "", None, None
        ids, lps = [], []
        async for _, out in merged(streams):
            text += out.text
            last = out
            if want_logprobs:
                ids += out.token_ids
                lps += out.logprobs
            if out.finished:
                reason = out.finish_reason
        return chunk([{"index": 0, "message": {"role": "assistant", "content": text},
                       "logprobs": chat_logprobs(eng.tokenizer, ids, lps) if want_logprobs else None,
                       "finish_reason": reason}], "chat.completion",
                     usage(last.prompt_tokens, last.completion_tokens))

    return await until_disconnected(request, collect())
