"""POST /v1/completions: text (or token-id) prompts, `n` choices per prompt, SSE when streaming.

With several prompts the choices run prompt-major, as OpenAI and vLLM number them: prompts
["a", "b"] with n=2 give choices 0, 1 (of "a") and 2, 3 (of "b"). Streamed, the chunks of all
choices interleave, each naming its `index`; each choice ends with its own finish_reason.

`echo: true` (what lm-eval-harness sends to score a text, with `max_tokens` 0 or 1 and
`logprobs`): the choice's text is the prompt followed by the completion, and its logprobs
cover the prompt's tokens first; streamed, the first chunk carries the prompt and its logprobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from ..engine import AsyncEngine, RequestError
from ..sampling import TokenLogprobs
from .auth import get_caller
from .deps import compile_grammar, get_engine, merged, open_choices, resolve_adapter, until_disconnected
from .errors import APIError
from .logprobs import CompletionLogprobs, prompt_logprobs
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
        try:  # before decoding them for echo: a tokenizer cannot decode an id it does not have
            for i in ids:
                engine.engine.check_token_ids(i)
        except RequestError as e:
            raise APIError(400, str(e), param="prompt") from None
        return ids, [tok.decode(i) if tok is not None and body.echo else "" for i in ids]
    if tok is None:
        raise APIError(400, "this server has no tokenizer: send the prompt as token ids", param="prompt")
    return [tok.encode(t, add_special_tokens=body.add_special_tokens) for t in texts], texts


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, engine: AsyncEngine = Depends(get_engine)):
    # The model first, as vLLM checks it: an unknown one is a 404 whatever else is wrong.
    adapter = resolve_adapter(engine, body.model, get_caller(request))
    refusal = body.refusal() or body.vocab_refusal(engine.engine.cfg.vocab_size)
    if refusal:
        raise APIError(400, refusal[0], param=refusal[1])
    # Tokenizing a long text takes seconds: off the event loop, which serves every stream.
    prompts, prompt_texts = await asyncio.to_thread(_prompts, engine, body)
    tokenizer = engine.engine.tokenizer
    if tokenizer is None and body.bad_words:
        raise APIError(400, "this server has no tokenizer: bad_words cannot be tokenized; use logit_bias",
                       param="bad_words")
    grammar = await compile_grammar(engine, body.grammar_spec())
    params = body.sampling(16 if body.max_tokens is None else body.max_tokens, echo=body.echo, tokenizer=tokenizer,
                           grammar=grammar)
    if params.stop and tokenizer is None:
        # Without a tokenizer there is no text to find a stop string in: refused (as vLLM does
        # without detokenization), not ignored while the request runs on to max_tokens.
        raise APIError(400, "this server has no tokenizer: stop strings cannot be matched; use stop_token_ids",
                       param="stop")
    streams = open_choices(engine, prompts, body, params, adapter)
    n, rid, created = body.n, new_id("cmpl"), now()
    want_logprobs = params.logprobs is not None
    # With return_tokens_as_token_ids, the tokens are named as on a server without a tokenizer.
    lp_tokenizer = None if body.return_tokens_as_token_ids else engine.engine.tokenizer
    builders = [CompletionLogprobs(lp_tokenizer, body.skip_special_tokens, len(prompts[k // n]) if body.echo else 0)
                for k in range(len(streams))]
    echoed = [not body.echo] * len(streams)
    prompt_lps: list[list | None] = [None] * len(streams)  # each choice's, for prompt_logprobs

    def delta(k: int, out) -> tuple[str, list[int], list]:
        """Choice k's output's text, token ids and logprobs; a choice's first one starts with its
        prompt when echoing (the engine sends the prompt's logprobs with its first output)."""
        text, ids, lps = out.text, out.token_ids, out.logprobs or []
        if out.prompt_logprobs is not None:
            prompt_lps[k] = out.prompt_logprobs
        if not echoed[k]:
            echoed[k] = True
            text = prompt_texts[k // n] + text
            if out.prompt_logprobs is not None:
                # echo's `logprobs` alternatives (prompt_logprobs may have asked for more)
                echo = [lp if lp is None else TokenLogprobs(lp.logprob, lp.top[:params.logprobs])
                        for lp in out.prompt_logprobs]
                ids, lps = prompts[k // n] + ids, echo + lps
        return text, ids, lps

    details = engine.engine.settings.enable_prompt_tokens_details

    def total(counts: list[tuple[int, int, int]]) -> dict:
        """Usage from each choice's (prompt tokens, completion tokens, cached prompt tokens): a
        prompt counts once, however many choices (its cached tokens: its first choice's)."""
        return usage(sum(c[0] for c in counts[::n]), sum(c[1] for c in counts),
                     sum(c[2] for c in counts[::n]) if details else None)

    def chunk(choices: list[dict], usage_: dict | None = None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                "choices": choices, **({"usage": usage_} if usage_ is not None else {})}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict]:
            counts = [(len(prompts[k // n]), 0, 0) for k in range(len(streams))]
            async for k, out in merged(streams):
                counts[k] = (out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                first = not echoed[k]
                text, ids, lps = delta(k, out)
                # Tokens whose text is held back (a possible stop string) still bring their logprobs.
                if text or out.finished or first or (want_logprobs and ids):
                    lp = builders[k].chunk(ids, lps) if want_logprobs else None
                    yield chunk([{"index": k, "text": text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None}])
            if include_usage:
                yield chunk([], total(counts))

        return sse_response(events())

    async def collect() -> dict:
        texts = [""] * len(streams)
        reasons: list[str | None] = [None] * len(streams)
        counts = [(len(prompts[k // n]), 0, 0) for k in range(len(streams))]
        ids: list[list[int]] = [[] for _ in streams]
        lps: list[list] = [[] for _ in streams]
        async for k, out in merged(streams):
            text, new_ids, new_lps = delta(k, out)
            texts[k] += text
            counts[k] = (out.prompt_tokens, out.completion_tokens, out.cached_tokens)
            if want_logprobs:
                ids[k] += new_ids
                lps[k] += new_lps
            if out.finished:
                reasons[k] = out.finish_reason
        choices = [{"index": k, "text": texts[k],
                    "logprobs": builders[k].chunk(ids[k], lps[k]) if want_logprobs else None,
                    "finish_reason": reasons[k]} for k in range(len(streams))]
        if body.prompt_logprobs is not None:  # vLLM's, per choice
            for k, choice in enumerate(choices):
                choice["prompt_logprobs"] = prompt_logprobs(lp_tokenizer, prompts[k // n], prompt_lps[k] or [],
                                                            body.prompt_logprobs, body.skip_special_tokens)
        return chunk(choices, total(counts))

    return await until_disconnected(request, collect())
