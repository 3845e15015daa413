"""A request's life inside the engine: prompt, sampling params, adapter, output so far.

State: WAITING (in the scheduler's queue) -> RUNNING (holds a KV row) -> FINISHED. Text
handling lives here too: incremental detokenization, stop strings (the text stops before
the stop string, or after it with include_stop_str_in_output; while streaming, text that
could be the start of a stop string is held back until it cannot be), stop tokens (EOS,
stop_token_ids: their text is left out too, unless include_stop_str_in_output), bad words,
and the finish reasons of the OpenAI API ("stop", "length", "abort").
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from .sampling import SamplingParams, TokenLogprobs
from .structured import GrammarState
from .tokenizer import IncrementalDetokenizer, Tokenizer


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request (the deltas since the last output)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # why the request failed (finish_reason "error"), e.g. its adapter's load
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when the request asked
    # With echo and logprobs, in the request's first output only: one per prompt token, the
    # first None (see LlamaModel.prefill).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error_code: str | None = None  # with error: adapter_load_failed or grammar_dead_end (Request.fail)
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache (Request.cached_tokens)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None  # adapter name, None = base only
    seed: int  # the request's seed, or one the engine drew for it
    slot: int = -1  # adapter slot, -1 = base only
    arrival: float = field(default_factory=time.monotonic)
    state: State = State.WAITING
    row: int = -1  # KV row while RUNNING
    num_computed: int = 0  # prompt tokens in its KV row; < len(prompt_ids) mid chunked prefill
    cached_tokens: int = 0  # of those, found in the prefix cache at admission (not prefilled)
    prefix_key: tuple | None = None  # what its K/V is computed under, for the prefix cache (scheduler)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, if asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token, with echo + logprobs
    finish_reason: str | None = None
    error: str | None = None  # set with finish_reason "error"
    error_code: str | None = None  # with it: adapter_load_failed (the default), grammar_dead_end
    detok: IncrementalDetokenizer | None = None
    grammar: GrammarState | None = None  # with a structured output: where its output stands in the grammar
    _emitted_ids: int = 0
    _emitted_chars: int = 0
    _text_end: int | None = None  # where a stop string cut the text
    _emitted_prompt: bool = False  # the prompt logprobs went out (with the first output)
    _stop_match: tuple | None = None  # per stop string: (it, its prefix function), and a matcher state
    _stop_fed: int = 0  # characters of the text the stop matchers have read

    @classmethod
    def new(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
            seed: int, tokenizer: Tokenizer | None) -> "Request":
        req = cls(request_id, list(prompt_ids), params, adapter, seed)
        if tokenizer is not None:
            req.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        return req

    @property
    def position(self) -> int:
        """Position of the next token fed to the model (the last sampled one)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @functools.cached_property
    def distinct_prompt_ids(self) -> np.ndarray:
        """The prompt's distinct token ids, int64, for the repetition penalty: made once, so a
        step penalises a long prompt without reading its Python list again."""
        return np.unique(np.asarray(self.prompt_ids, dtype=np.int64))

    def append(self, token: int, eos_ids: tuple[int, ...], max_len: int,
               logprobs: TokenLogprobs | None = None) -> None:
        """Record a sampled token (and its logprobs) and decide whether the request is done."""
        self.output_ids.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        p = self.params
        if self.grammar is not None and not self.grammar.accept(token):
            # The sampler's mask allows only tokens it accepts.
            return self.fail("structured output: its grammar allows no token after the output so far",
                             code="grammar_dead_end")
        # A stop token (EOS, or one of stop_token_ids) ends the request and its text stays out
        # of the answer, as a stop string's does (vLLM's rule; with include_stop_str_in_output
        # its text is kept, when it has one); it is still an output token. After a whole match
        # of a structured output's grammar, only a stop token could come: it ends the request
        # even with ignore_eos.
        if ((not p.ignore_eos and token in eos_ids) or token in p.stop_ids
                or (self.grammar is not None and self.grammar.terminated)):
            if p.include_stop_str_in_output and self.detok is not None:
                self.detok.add(token)
            return self._finish("stop")
        if self.detok is not None:
            searched = len(self.detok.text)
            self.detok.add(token)
            if p.stop and self._stop_armed() and self._find_stop(searched):
                return self._finish("stop")
        if self._at_length(len(self.output_ids), max_len):
            return self._finish("length")

    def banned_tokens(self, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Tokens this request may not sample next: before its min_tokens-th output token, EOS
        (unless ignore_eos) and its stop_token_ids, as vLLM's min_tokens; and the last token of
        each bad word whose other tokens end the output so far (of a one-token word, always),
        as vLLM's bad_words."""
        p = self.params
        banned: tuple[int, ...] = ()
        if len(self.output_ids) < p.min_tokens and not (self.grammar is not None and self.grammar.complete):
            # (a whole match of a structured output's grammar can only stop: min_tokens yields)
            banned = (() if p.ignore_eos else tuple(eos_ids)) + tuple(p.stop_ids)
        if p.bad_words_ids:
            out = self.output_ids
            banned += tuple(w[-1] for w in p.bad_words_ids
                            if len(w) == 1 or (len(w) - 1 <= len(out) and tuple(out[len(out) - len(w) + 1:]) == w[:-1]))
        return banned

    def next_token_ends_by_length(self, max_len: int) -> bool:
        """The next token (sampled, not yet appended) ends the request by its length."""
        return self._at_length(len(self.output_ids) + 1, max_len)

    def _at_length(self, outputs: int, max_len: int) -> bool:
        return outputs >= self.params.max_tokens or len(self.prompt_ids) + outputs >= max_len

    def prefilled(self, prompt_logprobs: list[TokenLogprobs | None] | None) -> None:
        """The prompt is in the KV cache: keep its logprobs; with max_tokens 0 (echo only)
        the request is done, nothing to generate."""
        self.prompt_logprobs = prompt_logprobs
        if self.params.max_tokens == 0:
            self._finish("length")

    def abort(self) -> None:
        self._finish("abort")

    def fail(self, error: str, code: str = "adapter_load_failed") -> None:
        """End the request with an error its client sees (its adapter failed to load; `code`
        grammar_dead_end: its grammar allowed no token after the output so far)."""
        self.error, self.error_code = error, code
        self._finish("error")

    def _finish(self, reason: str) -> None:
        if self.detok is not None and self._text_end is None:
            searched = len(self.detok.text)
            self.detok.flush()
            # The flushed tail (tokens held back as they ended in half a UTF-8 character) was
            # never searched: a stop string it completes still cuts the text and is the reason.
            if (self.params.stop and reason in ("stop", "length") and self._stop_armed()
                    and self._find_stop(searched)):
                reason = "stop"
        self.state = State.FINISHED
        self.finish_reason = reason

    def _stop_armed(self) -> bool:
        """Stop strings count once more than min_tokens tokens are out (vLLM's rule), as EOS
        and stop_token_ids may be sampled only from then on (`banned_tokens`)."""
        return len(self.output_ids) > self.params.min_tokens

    def _find_stop(self, searched: int) -> bool:
        """A stop string that ends in the text past `searched` (its length when last looked
        at): an older one was either found then or lay in the min_tokens, where none count."""
        text = self.detok.text
        hits = [(i, len(s)) for s in self.params.stop if (i := text.find(s, max(0, searched - len(s) + 1))) >= 0]
        if hits:
            start, length = min(hits)  # the first stop string in the text
            self._text_end = start + length if self.params.include_stop_str_in_output else start
            return True
        return False

    def _holdback(self, text: str) -> int:
        """Characters at the end of `text` that could begin a stop string: the longest n with
        text ending in s[:n] (n < len(s)), over the stop strings s.

        `text` only grows between calls (the detokenizer appends), so each stop string keeps
        the state of a Knuth-Morris-Pratt matcher over the text so far: each call feeds it the
        new characters only, in amortised constant time per character, however long or
        repetitive the stop string. (Comparing every prefix at every step made the engine
        thread's work per row grow with the square of a stop string's length.)"""
        stops = self.params.stop
        if self._stop_match is None:
            matchers = [(s, _prefix_function(s)) for s in stops if s]
            self._stop_match = matchers, [0] * len(matchers)
        matchers, states = self._stop_match
        for c in text[self._stop_fed:]:
            for i, (s, fail) in enumerate(matchers):
                k = states[i]
                if k == len(s):  # a whole match last time: go on from its longest border
                    k = fail[k - 1]
                while k and s[k] != c:
                    k = fail[k - 1]
                states[i] = k + 1 if s[k] == c else k
        self._stop_fed = len(text)
        return max((k if k < len(s) else fail[k - 1] for (s, fail), k in zip(matchers, states)), default=0)

    def take_output(self) -> RequestOutput:
        """The new tokens and text since the last call."""
        new_ids = self.output_ids[self._emitted_ids:]
        logprobs = self.output_logprobs[self._emitted_ids:] if self.params.logprobs is not None else None
        self._emitted_ids = len(self.output_ids)
        prompt_logprobs = None
        if not self._emitted_prompt and self.prompt_logprobs is not None:
            prompt_logprobs, self._emitted_prompt = self.prompt_logprobs, True
        text = ""
        if self.detok is not None:
            full = self.detok.text
            if self._text_end is not None:
                end = self._text_end
            elif self.finished:
                end = len(full)
            else:
                # Text that may begin a stop string is held back, unless a stop string would
                # stay in the text anyway (vLLM streams it then as it comes).
                hold = self.params.stop and not self.params.include_stop_str_in_output
                end = len(full) - (self._holdback(full) if hold else 0)
            if end > self._emitted_chars:
                text = full[self._emitted_chars:end]
                self._emitted_chars = end
        return RequestOutput(self.request_id, new_ids, text, self.finished, self.finish_reason,
                             len(self.prompt_ids), len(self.output_ids), self.error, logprobs, prompt_logprobs,
                             self.error_code, self.cached_tokens)


def _prefix_function(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
