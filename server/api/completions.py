"""POST /v1/completions: text (or token-id) prompts, one choice per prompt, SSE when streaming.

`echo: true` (what lm-eval-harness sends to score a text, with `max_tokens` 0 or 1 and
`logprobs`): the choice's text is the prompt followed by the completion, and its logprobs
cover the prompt's tokens first; streamed, the first chunk carries the prompt and its logprobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from ..engine import AsyncEngine
from .deps import get_engine, merged, open_streams, resolve_adapter, until_disconnected
from .errors import APIError
from .logprobs import CompletionLogprobs
from .schemas import CompletionRequest, new_id, now, usage
from .sse import sse_response

router = APIRouter(tags=["completions"])


def _prompts(engine: AsyncEngine, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """The request's prompts as token ids, from "text", ["a", "b"], [1, 2, 3] or [[1, 2], [3]],
    and as text (what echo returns): as sent, or token ids decoded ("" without a tokenizer)."""
    p = body.prompt
    tok = engine.engine.tokenizer
    ids = None
    if isinstance(p, str):
        texts = [p]
    elif p and all(isinstance(x, int) for x in p):
        ids = [list(p)]
    elif p and all(isinstance(x, list) for x in p):
        ids = [list(x) for x in p]
    elif p and all(isinstance(x, str) for x in p):
        texts = list(p)
    else:
        raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
    if ids is not None:
        return ids, [tok.decode(i) if tok is not None and body.echo else "" for i in ids]
    if tok is None:
        raise APIError(400, "this server has no tokenizer: send the prompt as token ids", param="prompt")
    return [tok.encode(t) for t in texts], texts


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, engine: AsyncEngine = Depends(get_engine)):
    refusal = body.refusal()
    if refusal:
        raise APIError(400, refusal[0], param=refusal[1])
    adapter = resolve_adapter(engine, body.model)
    prompts, prompt_texts = _prompts(engine, body)
    params = body.sampling(16 if body.max_tokens is None else body.max_tokens, echo=body.echo)
    streams = open_streams(engine, prompts, params, adapter, body.model)
    rid, created = new_id("cmpl"), now()
    want_logprobs = params.logprobs is not None
    builders = [CompletionLogprobs(engine.engine.tokenizer) for _ in prompts]
    echoed = [not body.echo] * len(prompts)

    def delta(i: int, out) -> tuple[str, list[int], list]:
        """An output's text, token ids and logprobs; a choice's first one starts with its
        prompt when echoing (the engine sends the prompt's logprobs with its first output)."""
        text, ids, lps = out.text, out.token_ids, out.logprobs or []
        if not echoed[i]:
            echoed[i] = True
            text = prompt_texts[i] + text
            if out.prompt_logprobs is not None:
                ids, lps = prompts[i] + ids, out.prompt_logprobs + lps
        return text, ids, lps

    def chunk(choices: list[dict], usage_: dict | None = None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                "choices": choices, **({"usage": usage_} if usage_ is not None else {})}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict]:
            counts = [(len(p), 0) for p in prompts]
            async for i, out in merged(streams):
                counts[i] = (out.prompt_tokens, out.completion_tokens)
                first = not echoed[i]
                text, ids, lps = delta(i, out)
                # Tokens whose text is held back (a possible stop string) still bring their logprobs.
                if text or out.finished or first or (want_logprobs and ids):
                    lp = builders[i].chunk(ids, lps) if want_logprobs else None
                    yield chunk([{"index": i, "text": text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None}])
            if include_usage:
                yield chunk([], usage(sum(c[0] for c in counts), sum(c[1] for c in counts)))

        return sse_response(events())

    async def collect() -> dict:
        texts = [""] * len(prompts)
        reasons: list[str | None] = [None] * len(prompts)
        counts = [(len(p), 0) for p in prompts]
        ids: list[list[int]] = [[] for _ in prompts]
        lps: list[list] = [[] for _ in prompts]
        async for i, out in merged(streams):
            text, new_ids, new_lps = delta(i, out)
            texts[i] += text
            counts[i] = (out.prompt_tokens, out.completion_tokens)
            if want_logprobs:
                ids[i] += new_ids
                lps[i] += new_lps
            if out.finished:
                reasons[i] = out.finish_reason
        choices = [{"index": i, "text": texts[i],
                    "logprobs": builders[i].chunk(ids[i], lps[i]) if want_logprobs else None,
                    "finish_reason": reasons[i]} for i in range(len(prompts))]
        return chunk(choices, usage(sum(c[0] for c in counts), sum(c[1] for c in counts)))

    return await until_disconnected(request, collect())
