"""Logprobs in the two OpenAI response shapes, from the engine's `TokenLogprobs`.

/v1/completions with `logprobs: 1`, one choice that wrote " the fox"::

    {"tokens": [" the", " fox"], "token_logprobs": [-0.4, -2.1],
     "top_logprobs": [{" the": -0.4}, {" dog": -1.0, " fox": -2.1}],  # the top 1, plus the sampled token
     "text_offset": [0, 4]}                                          # where each token starts in the text

With `echo: true` the prompt's tokens come first, the first one with null for its logprob
and its top_logprobs (nothing predicts it)::

    {"tokens": ["The", " quick", " the", ...], "token_logprobs": [null, -7.5, -0.4, ...],
     "top_logprobs": [null, {",": -1.2, " quick": -7.5}, {" the": -0.4}, ...], ...}

/v1/chat/completions with `logprobs: true, top_logprobs: 1`::

    {"content": [{"token": " the", "logprob": -0.4, "bytes": [32, 116, 104, 101],
                  "top_logprobs": [{"token": " the", "logprob": -0.4, "bytes": [32, 116, 104, 101]}]}, ...]}

The values are the model's own distribution: log_softmax of the raw logits in float32,
before penalties, temperature, top-k and top-p (vLLM's default "raw_logprobs"). A token's
string is that token decoded alone ("\\ufffd" for a piece of a UTF-8 character; "" for a
special token, which the tokenizer skips, unless the request's skip_special_tokens is false:
then its text, as in the output's text), or "token_id:N" on a server without a tokenizer
(vLLM's spelling for ids). A chat logprob's `bytes` are the token's own, as OpenAI's: for a
piece of a character, that piece ("日" over three tokens: [230], [151], [165]), so the bytes
of an answer's tokens join into the answer.
"""

from __future__ import annotations

import functools

from ..sampling import TokenLogprobs
from ..tokenizer import Tokenizer

# A logprob of -inf has no JSON spelling; vLLM sends this floor instead.
MIN_LOGPROB = -9999.0


@functools.lru_cache(maxsize=1 << 16)
def token_text(tokenizer: Tokenizer | None, token_id: int, skip_special_tokens: bool = True) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens)


@functools.lru_cache(maxsize=1 << 16)
def token_bytes(tokenizer: Tokenizer | None, token_id: int, skip_special_tokens: bool = True) -> tuple[int, ...]:
    """The token's own bytes: for a piece of a character, that piece, not "\ufffd"'s bytes."""
    if tokenizer is None:
        return tuple(token_text(None, token_id).encode())
    return tuple(tokenizer.token_bytes(token_id, skip_special_tokens))


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class CompletionLogprobs:
    """The `logprobs` object of one /v1/completions choice, a chunk at a time; text_offset
    runs on across chunks, so a stream's chunks join into the non-streamed object.
    `skip_special_tokens`: the request's (special tokens' text kept when false, as in its
    text); the first `prompt_tokens` (an echoed prompt's) skip them whatever it says, as the
    echoed prompt's text (as sent, or its ids decoded) has no BOS."""

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True, prompt_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.prompt_left = prompt_tokens  # echoed prompt tokens still to come
        self.offset = 0  # characters of token text so far

    def chunk(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict:
        """None in `logprobs`: a token nothing scored (an echoed prompt's first), null in JSON."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, logprobs):
            skip = self.skip or self.prompt_left > 0
            self.prompt_left = max(0, self.prompt_left - 1)
            text = token_text(self.tokenizer, token_id, skip)
            top: dict[str, float] | None = None
            if lp is not None:
                top = {}
                # Tokens that decode alike (pieces of UTF-8 characters: "\ufffd") share a key:
                # the most likely keeps it. OpenAI lists the sampled (or prompt) token too.
                for t, v in (*lp.top, (token_id, lp.logprob)):
                    top.setdefault(token_text(self.tokenizer, t, skip), _value(v))
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else _value(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _entry(tokenizer: Tokenizer | None, token_id: int, logprob: float, skip: bool) -> dict:
    return {"token": token_text(tokenizer, token_id, skip), "logprob": _value(logprob),
            "bytes": token_bytes(tokenizer, token_id, skip)}


def chat_logprobs(tokenizer: Tokenizer | None, token_ids: list[int], logprobs: list[TokenLogprobs],
                  skip_special_tokens: bool = True) -> dict:
    """The `logprobs` object of a /v1/chat/completions choice (or of one streamed chunk);
    `skip_special_tokens` as in CompletionLogprobs."""
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        entry = _entry(tokenizer, token_id, lp.logprob, skip_special_tokens)
        entry["top_logprobs"] = [_entry(tokenizer, t, v, skip_special_tokens) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def prompt_logprobs(tokenizer: Tokenizer | None, prompt_ids: list[int], entries: list[TokenLogprobs | None],
                    k: int, skip_special_tokens: bool = True) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first (nothing predicts it), then
    {token id: {"logprob", "rank", "decoded_token"}} of the prompt token and of the `k` most
    likely tokens there, the prompt token first, e.g. for k = 1:
    [None, {"7": {"logprob": -3.2, "rank": 5, "decoded_token": " fox"},
            "12": {"logprob": -0.9, "rank": 1, "decoded_token": " the"}}, ...]"""
    out: list[dict | None] = []
    for token_id, lp in zip(prompt_ids, entries):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token_id): {"logprob": _value(lp.logprob), "rank": lp.rank,
                                 "decoded_token": token_text(tokenizer, token_id, skip_special_tokens)}}
        for rank, (t, v) in enumerate(lp.top[:k], 1):
            entry.setdefault(str(t), {"logprob": _value(v), "rank": rank,
                                      "decoded_token": token_text(tokenizer, t, skip_special_tokens)})
        out.append(entry)
    return out
