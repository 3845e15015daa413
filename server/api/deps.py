"""Small dependencies the routers share: the engine, the adapter a `model` names, and
opening engine streams (one per prompt and choice) with engine errors turned into API
errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..engine import AsyncEngine, RequestError, RequestStream, UnknownModelError
from ..request import RequestOutput
from ..sampling import SamplingParams
from ..structured import GrammarError, GrammarSpec
from ..structured import available as structured_outputs_available
from .auth import OPEN, Caller
from .errors import APIError, model_not_found
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


def get_engine(request: Request) -> AsyncEngine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise APIError(503, "the engine is not running", type="service_unavailable")
    if engine.error is not None:
        raise APIError(503, f"the engine has stopped: {engine.error!r}", type="service_unavailable")
    return engine


def resolve_adapter(engine: AsyncEngine, model: str, caller: Caller = OPEN) -> str | None:
    """The adapter a request's `model` names; None for the base model; 404 otherwise, also
    for an adapter of a tenant other than the caller's (the tenant check: api/auth.py)."""
    if model == engine.engine.model_name:
        return None
    cache = engine.engine.adapters
    if cache.has(model) and caller.may_use(cache.tenant_of(model)):
        return model
    raise model_not_found(model)


async def compile_grammar(engine: AsyncEngine, spec: GrammarSpec | None):
    """The compiled grammar of a request's structured output (None without one), compiled
    on a worker thread (a large schema takes a while, and the event loop serves every
    stream); a 400 naming the field when it cannot be."""
    if spec is None:
        return None
    grammars = engine.engine.grammars
    if grammars is None:
        raise APIError(400, "this server has no tokenizer: a structured output cannot be matched", param=spec.param)
    if not structured_outputs_available():
        raise APIError(400, "structured outputs need the xgrammar package on this server "
                            "(pip install 'loraplex[structured]')", param=spec.param,
                       code="structured_outputs_unavailable")
    try:
        return await asyncio.to_thread(grammars.compile, spec)
    except GrammarError as e:
        raise APIError(400, str(e), param=spec.param) from None


def open_streams(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                 adapter: str | None, model: str):
    """Queue one request per prompt; on any error, abort the ones already queued."""
    streams = []
    try:
        for ids in prompts:
            streams.append(engine.add_request(ids, params, adapter))
    except BaseException as e:
        for s in streams:
            s.close()
        if isinstance(e, UnknownModelError):
            raise model_not_found(model) from None
        if isinstance(e, (RequestError, ValueError)):
            raise APIError(400, str(e)) from None
        if isinstance(e, RuntimeError):
            raise APIError(503, str(e), type="service_unavailable") from None
        raise
    return streams


def check_context(engine: AsyncEngine, prompts: list[list[int]], body: CompletionRequest | ChatCompletionRequest,
                  max_tokens: int) -> None:
    """A 400 `context_length_exceeded` naming the parameter to shorten, in OpenAI's and vLLM's
    words, when a prompt (with room for one token at least) or a prompt plus `max_tokens` is
    past the context: tools that trim a conversation and retry know the overflow by that code
    or that sentence. The engine checks the same (its message is for its other callers)."""
    limit = engine.engine.max_model_len
    chat = isinstance(body, ChatCompletionRequest)
    where = "messages" if chat else "prompt"
    for ids in prompts:
        n = len(ids)
        if n and n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your {where} "
                                f"{'resulted in' if chat else 'has'} {n} tokens, which leaves no room for the "
                                f"completion. Please reduce the length of the {where}.",
                           param=where, code="context_length_exceeded")
        if n + max_tokens > limit:
            asked = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{n + max_tokens} tokens ({n} in the {where}, {max_tokens} in the completion). "
                                f"Please reduce the length of the {where} or completion.",
                           param=asked, code="context_length_exceeded")


def open_choices(engine: AsyncEngine, prompts: list[list[int]], body: CompletionRequest | ChatCompletionRequest,
                 params: SamplingParams, adapter: str | None) -> list[RequestStream]:
    """Queue `body.n` requests per prompt and return their streams prompt-major: stream k is
    choice k % n of prompt k // n, and k is that choice's `index`. Each choice is a request
    of its own (its own batch row, its own seed; see `choice_params`); the n copies of a
    prompt share no prefix and each prefills it (no prefix sharing yet). On any error,
    abort the ones already queued."""
    check_context(engine, prompts, body, params.max_tokens)
    per_choice: list[list[RequestStream]] = []  # [n][prompts]
    try:
        for p in body.choice_params(params):
            per_choice.append(open_streams(engine, prompts, p, adapter, body.model))
    except BaseException:
        for streams in per_choice:
            for s in streams:
                s.close()
        raise
    return [per_choice[j][i] for i in range(len(prompts)) for j in range(body.n)]


async def merged(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several request streams as they come; closing this closes them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def until_disconnected(request: Request, work):
    """Run the coroutine `work`; cancel it (aborting its requests) if the client goes away,
    and answer 499 (nginx's "client closed request"), which no one reads: a disconnect is a
    client's right, not a server error to log with a traceback.

    Waits on the ASGI receive channel, which reports http.disconnect once the body is read:
    an event, not a poll."""
    task = asyncio.ensure_future(work)
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if not disconnected or getattr(me, "cancelling", lambda: 0)():  # Task.cancelling: 3.11+
            raise  # this handler itself is cancelled (the server is shutting down)
        log.info("client went away: %s %s aborted", request.method, request.url.path)
        return Response(status_code=499)
    finally:
        watcher.cancel()
