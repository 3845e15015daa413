"""Structured outputs: a request's output held to a JSON schema, to any JSON object, to a
regular expression, to one of fixed choices, or to an EBNF grammar (OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` fields).

The API turns a request's fields into a `GrammarSpec` (`api/schemas.py`, which imports
nothing of this module's engine), and `Grammars.compile` turns that into a grammar over the
model's vocabulary, on a worker thread and cached by spec. `LLMEngine.make_request` gives each
request its own `GrammarState`. Each step the sampler masks, in the rows of such requests,
every token the grammar does not allow next (`mask_logits`), and `Request.append` moves the
state on by the sampled token. Once the grammar is complete only a stop token (EOS, or the
request's `stop_token_ids`) may follow, and the request ends "stop".

The grammar engine is xgrammar, an optional dependency (`pip install 'loraplex[structured]'`):
without it a request that asks for structured output is refused with a 400 that says so,
and every other request is served as before. JSON is held to the separators `", "` and
`": "` with no other whitespace (xgrammar's any_whitespace off): a small model under a
grammar that allows any whitespace can write spaces or newlines until max_tokens.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from dataclasses import dataclass

import torch

# The most choices one request may list (vLLM sets none; each is one alternative of the grammar).
MAX_CHOICES = 1024
# A spec's text (a schema dumped as JSON, a regex, a grammar) is at most this many characters.
MAX_SPEC_CHARS = 256 * 1024
# Grammars kept compiled (each holds a token mask per grammar state: up to a few MB).
COMPILED_CACHE = 64


class GrammarError(ValueError):
    """A spec that does not compile: its message says why, for the client."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. kind: "json" (value: a JSON schema, as JSON text),
    "json_object" (any JSON object; value ""), "regex", "choice" (value: the choices as a
    JSON list) or "grammar" (EBNF, in xgrammar's dialect, as vLLM's xgrammar backend takes it).
    `param` names the request field it came from, for errors."""

    kind: str
    value: str
    param: str

    def choices(self) -> list[str]:
        return json.loads(self.value)


def available() -> bool:
    """True when the grammar engine is installed."""
    return importlib.util.find_spec("xgrammar") is not None


# xgrammar's errors start with its log prefix and the C++ source line:
# "[15:56:42] /project/cpp/regex_converter.cc:94: Regex parsing error at position 4: ...".
_ENGINE_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def _client_message(e: Exception) -> str:
    text = _ENGINE_PREFIX.sub("", str(e)).strip()
    text = text.removeprefix("Check failed: (error.empty()) is false: ").strip()
    return text.splitlines()[0] if text else type(e).__name__


def _ebnf_literal(text: str) -> str:
    """`text` as a string literal of xgrammar's EBNF: JSON's escapes are its own."""
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """The grammar compiler of one model: its tokenizer's vocabulary (as bytes, padded with
    nothing-tokens to the logits' width) and its stop tokens. Built on first use (the import
    and the vocabulary take about a second); thread-safe."""

    def __init__(self, tokenizer, vocab_width: int, stop_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self.vocab_width = vocab_width
        self.stop_ids = tuple(stop_ids)
        self._compiler = None
        self._cache: dict[GrammarSpec, object] = {}
        self._lock = threading.Lock()

    def _engine(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # A special token writes no text: b"" is a token xgrammar never allows, but
                # the stop tokens.
                vocab = [b if b is not None else b"" for b in self._tokenizer.vocabulary_bytes()]
                vocab = vocab[:self.vocab_width]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_width,
                                         stop_token_ids=list(self.stop_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec` (cached); GrammarError when it does not compile."""
        with self._lock:
            hit = self._cache.pop(spec, None)
            if hit is not None:  # now the last used: the cache evicts the least recently used
                self._cache[spec] = hit
        if hit is not None:
            return hit
        compiler = self._engine()
        try:
            if spec.kind == "json":
                grammar = compiler.compile_json_schema(spec.value, any_whitespace=False)
            elif spec.kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "regex":
                grammar = compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                grammar = compiler.compile_grammar(
                    "root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choices()))
            elif spec.kind == "grammar":
                grammar = compiler.compile_grammar(spec.value)
            else:
                raise GrammarError(f"unknown structured output kind {spec.kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError) with the cause
            raise GrammarError(f"{spec.param}: {_client_message(e)}") from None
        start = GrammarState(grammar, self.stop_ids)
        if not start.matched and not start.allowed().any():
            # Rules that only call themselves ("root ::= item", "item ::= root") compile, but
            # no token may come first: each of its requests would fail at its first step.
            raise GrammarError(f"{spec.param}: the {spec.kind} matches no output")
        if spec.kind == "json" and start.matched:
            # An empty anyOf or oneOf compiles to the empty output, which is no JSON.
            raise GrammarError(f"{spec.param}: the schema matches no JSON value")
        with self._lock:
            if len(self._cache) >= COMPILED_CACHE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = grammar
        return grammar


class GrammarState:
    """Where one request's output stands in its grammar."""

    def __init__(self, compiled, stop_ids: tuple[int, ...]):
        import xgrammar as xgr

        # A stop_token_ids entry outside the vocabulary is never sampled (the sampler drops it
        # too); the matcher refuses one.
        self._vocab = vocab = compiled.tokenizer_info.vocab_size
        stops = [t for t in stop_ids if 0 <= t < vocab]
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self._stops = stops or list(compiled.tokenizer_info.stop_token_ids)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` (int32 [n, ceil(V / 32)], on the CPU): bit t set where
        token t may come next."""
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens that may come next (stop tokens among them), on the CPU."""
        bitmask = torch.empty((1, (self._vocab + 31) // 32), dtype=torch.int32)
        self.fill(bitmask, 0)
        return _unpack(bitmask, self._vocab)[0]

    @property
    def matched(self) -> bool:
        """The output so far is a whole match (a longer one may still continue it)."""
        return self._matcher.is_completed()

    def accept(self, token: int) -> bool:
        """Move on by `token`; False if the grammar does not allow it (nothing changes then)."""
        return self._matcher.accept_token(token)

    @property
    def complete(self) -> bool:
        """Only a stop token may come next: the output so far is a whole match that no longer
        one continues (for "[0-9]+", "7" is matched but not complete: "78" continues it)."""
        if not self._matcher.is_completed():
            return False
        others = self.allowed()
        others[self._stops] = False
        return not others.any()

    @property
    def terminated(self) -> bool:
        """A stop token came after a whole match."""
        return self._matcher.is_terminated()


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [n, vocab] from a bitmask int32 [n, ceil(vocab / 32)]: token t is bit t % 32 of
    word t // 32 (xgrammar sets the bits past the vocabulary: they are cut off)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()


def mask_logits(logits: torch.Tensor, rows: list[int], states: list[GrammarState],
                fallback: torch.Tensor | None = None) -> torch.Tensor:
    """logits float32 [N, V] with, in row rows[j], every token states[j] does not allow next
    at -inf; a new tensor (the input may be the decode graph's buffer). Where that leaves a
    row nothing (the request's other masks, allowed_token_ids or bad_words, took every token
    the grammar allows), the row is `fallback`'s (the logits before those masks) under the
    grammar's mask alone: the output still matches its grammar. The bitmask is filled on the
    host, one row per state, and unpacked on the logits' device, with no synchronisation."""
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)  # each row filled whole below
    # Row by row: xgrammar's batch fill (on its threads) made a step with 64 held rows slower
    # on the H200's host, 0.891x against 0.967x of the free batch (engine_h200_notes.md).
    for j, state in enumerate(states):
        state.fill(bitmask, j)
    device = logits.device
    allowed = _unpack(bitmask.to(device, non_blocking=True), vocab)
    index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    held = logits[index].masked_fill(~allowed, float("-inf"))
    if fallback is not None and fallback is not logits:
        alone = fallback[index].masked_fill(~allowed, float("-inf"))
        held = torch.where(torch.isneginf(held).all(dim=-1, keepdim=True), alone, held)
    out = logits.clone()
    out[index] = held
    return out
