"""POST /tokenize and POST /detokenize, as vLLM serves them, so that clients count and check
tokens with the served model's own tokenizer:

    POST /tokenize {"model": "sql-expert", "prompt": "SELECT 1"}
      -> {"count": 4, "max_model_len": 2048, "tokens": [1, 5003, 220, 16], "token_strs": null}
    POST /tokenize {"messages": [{"role": "user", "content": "hi"}]}   (the chat prompt, rendered
      as /v1/chat/completions renders it; add_generation_prompt, tools etc. as there)
    POST /detokenize {"tokens": [1, 5003]} -> {"prompt": "<s>SELECT"}

`model` may be left out (the base); named, it must be one the caller may use (a 404 as
elsewhere), though every adapter shares the base's tokenizer. With API keys on, these paths
need a key as /v1/ does (api/auth.py; vLLM leaves them open): a 404 here would otherwise tell
one tenant the names of another's adapters. Detokenizing keeps special tokens' text, as vLLM's
does.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from ..engine import AsyncEngine
from ..tokenizer import Tokenizer
from .auth import get_caller
from .deps import get_engine, resolve_adapter
from .errors import APIError
from .schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest

router = APIRouter(tags=["tokenize"])


def _tokenizer(engine: AsyncEngine, model: str | None, request: Request) -> Tokenizer:
    if model is not None:
        resolve_adapter(engine, model, get_caller(request))
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer (its model folder has no tokenizer.json)")
    return tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request,
                   engine: AsyncEngine = Depends(get_engine)):
    tokenizer = _tokenizer(engine, body.model, request)
    # Off the event loop, which serves every stream: a long text takes seconds to tokenize.
    if isinstance(body, TokenizeChatRequest):
        refusal = body.prompt_refusal(tokenizer.chat_template)
        if refusal:
            raise APIError(400, refusal[0], param=refusal[1])
        try:
            ids = await asyncio.to_thread(tokenizer.apply_chat_template, body.chat_messages(),
                                          **body.template_options())
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
    else:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": engine.engine.max_model_len, "tokens": ids,
            "token_strs": [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, engine: AsyncEngine = Depends(get_engine)):
    tokenizer = _tokenizer(engine, body.model, request)
    vocab = tokenizer.vocab_size
    bad = sorted({t for t in body.tokens if not 0 <= t < vocab})
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}
