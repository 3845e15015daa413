"""OpenAI request and response bodies (the subset a completions server needs), plus vLLM's
adapter-admin bodies. OpenAI's logit_bias is taken as OpenAI and vLLM define it. Extra fields
that vLLM accepts (top_k, min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids,
allowed_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens) are accepted
here too; vLLM's and OpenAI's
fields this server does not implement are refused when they would change the output
(UNSUPPORTED); other unknown fields are ignored, as vLLM does.

Values out of OpenAI's bounds that a client is likely to send on purpose (logprobs,
top_logprobs, penalties, logit_bias) are refused with a 400 naming the parameter, as OpenAI does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator,
                      model_validator)

from ..sampling import LOGIT_BIAS_LIMIT, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from ..structured import MAX_CHOICES, MAX_SPEC_CHARS, GrammarSpec
from ..tokenizer import bad_words_token_ids

MAX_N = 16  # the most choices one request may ask for (`n`); each is a batch row of its own
# Stop strings a request may give, and their length (OpenAI takes up to 4): each is matched
# against the text as it grows, on the engine thread, for every row (Request._holdback,
# _find_stop), and its matcher is built there once.
MAX_STOP = 16
MAX_STOP_CHARS = 256
# bad_words a request may give (each makes up to two token sequences, checked against the
# output's end on the engine thread every step), and their length.
MAX_BAD_WORDS_GIVEN = MAX_BAD_WORDS // 2
MAX_BAD_WORD_CHARS = 256
# allowed_token_ids a request may give (a vocabulary is ~150k tokens at most).
MAX_ALLOWED_TOKENS = 1 << 18
# A logit_bias key: a token id written as a JSON object key, a string of decimal digits
# ("-1" parses, and is then outside the vocabulary). Longer than 18 digits it is no token id.
_TOKEN_KEY = re.compile(r"-?[0-9]{1,18}")


def parse_logit_bias(value: dict | None) -> dict[int, float]:
    """OpenAI's logit_bias {"token id": bias} as {id: bias}; ValueError (its message names
    logit_bias) for a key that is not an integer, a bias that is not a number in
    [-100, 100] (vLLM clamps it; OpenAI refuses it, as here), a token named twice ("5" and
    "05") or more than MAX_LOGIT_BIAS tokens. Ids are checked against the vocabulary by
    `_SamplingFields.vocab_refusal`, which knows it."""
    if not value:
        return {}
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    bias: dict[int, float] = {}
    for key, b in value.items():
        if isinstance(key, int) and not isinstance(key, bool):
            token = key
        elif isinstance(key, str) and _TOKEN_KEY.fullmatch(key):
            token = int(key)
        else:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {str(key)[:40]!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be numbers between -{LOGIT_BIAS_LIMIT:g} and "
                             f"{LOGIT_BIAS_LIMIT:g}, got {str(b)[:40]} for token {token}")
        if token in bias:
            raise ValueError(f"logit_bias names token {token} twice")
        bias[token] = float(b)
    return bias


def _unpaired_surrogate(body) -> str | None:
    """Where in a decoded JSON value a string holds an unpaired UTF-16 surrogate ("messages.0.content"),
    or None. A loop over a stack, not recursion: json.loads takes nesting as deep as the
    interpreter's recursion limit allows."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and _unpaired_surrogate(key) is not None:
                    return path or "body"  # not the key itself: the message must stay encodable
                stack.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value))
    return None


class RequestBody(BaseModel):
    """A JSON request body of text. JSON may escape half of a UTF-16 surrogate pair alone
    ("\\ud800"), which decodes to a Python str that is no Unicode text: the tokenizer refuses
    it and a response that quotes it (an echo, a 404 naming the model) cannot be written as
    UTF-8, each a 500. Such a body is refused here (400), naming the field that holds it."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        where = _unpaired_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} holds an unpaired UTF-16 surrogate, which is not text")
        return data


# Fields of vLLM's or OpenAI's API that this server does not implement, with the values that
# change nothing (accepted); any other value is refused with a 400 naming the field, never
# silently dropped. Each maps to its neutral values.
UNSUPPORTED: dict[str, tuple] = {
    # vLLM's per-request pick of a structured-output backend: xgrammar is this server's one.
    "guided_decoding_backend": (None, "", "auto", "xgrammar"), "guided_whitespace_pattern": (None, ""),
    "logits_processors": (None, []),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "truncate_prompt_tokens": (None,),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "structural_tag": (None, ""), "prompt_embeds": (None,), "tool_choice": (None, "none", "auto"),
}


class SpecRefused(ValueError):
    """A structured-output field the server cannot take: why, and the field."""

    def __init__(self, why: str, param: str):
        super().__init__(why)
        self.why, self.param = why, param


def _text_spec(kind: str, value, param: str) -> GrammarSpec:
    """A regex's or a grammar's spec: a non-empty string of bounded length."""
    if not isinstance(value, str) or not value:
        raise SpecRefused(f"{param} must be a non-empty string", param)
    if len(value) > MAX_SPEC_CHARS:
        raise SpecRefused(f"{param} may have at most {MAX_SPEC_CHARS} characters", param)
    return GrammarSpec(kind, value, param)


def _json_spec(schema, param: str) -> GrammarSpec:
    """A JSON schema's spec, from the schema object or its JSON text (key order kept: it is
    the order the properties are written in)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SpecRefused(f"{param}: the schema is not JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise SpecRefused(f"{param} must be a JSON schema object", param)
    return _text_spec("json", json.dumps(schema, ensure_ascii=False), param)


def _choice_spec(choices, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise SpecRefused(f"{param} must be a non-empty list of non-empty strings", param)
    if len(choices) > MAX_CHOICES:
        raise SpecRefused(f"{param} takes at most {MAX_CHOICES} choices, got {len(choices)}", param)
    return _text_spec("choice", json.dumps(choices, ensure_ascii=False), param)


def _response_format_spec(fmt: dict | None) -> GrammarSpec | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise SpecRefused("response_format json_schema needs json_schema.schema, a JSON schema object",
                              "response_format")
        return _json_spec(inner["schema"], "response_format")
    raise SpecRefused(f"response_format type {kind!r} is not supported (text, json_object or json_schema)",
                      "response_format")


# vLLM's structured_outputs keys this server reads; the rest (its options for other backends)
# are refused unless neutral.
_STRUCTURED_NEUTRAL = {"disable_fallback": (None, False, True), "disable_any_whitespace": (None, False, True),
                       "whitespace_pattern": (None,), "structural_tag": (None,)}


def _structured_outputs_spec(so: dict | None) -> GrammarSpec | None:
    """vLLM's structured_outputs: one of json (a schema), regex, choice, grammar (EBNF) or
    json_object (true). JSON is written without free whitespace whatever
    disable_any_whitespace says (structured.py)."""
    if not so:
        return None
    param = "structured_outputs"
    asked = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object")
             and v is not None and v is not False}
    for key, value in so.items():
        if key not in ("json", "regex", "choice", "grammar", "json_object") and \
                not any(value == v and type(value) is type(v) for v in _STRUCTURED_NEUTRAL.get(key, ())):
            raise SpecRefused(f"structured_outputs.{key} is not supported", param)
    if not asked:
        return None
    if len(asked) > 1:
        raise SpecRefused(f"structured_outputs takes one of json, regex, choice, grammar or json_object, "
                          f"got {sorted(asked)}", param)
    (key, value), = asked.items()
    if key == "json":
        return _json_spec(value, param)
    if key == "json_object":
        if value is not True:
            raise SpecRefused("structured_outputs.json_object must be true or false", param)
        return GrammarSpec("json_object", "", param)
    if key == "choice":
        return _choice_spec(value, param)
    return _text_spec(key, value, param)


def _guided_spec(body) -> GrammarSpec | None:
    """vLLM's older guided_json / guided_regex / guided_choice / guided_grammar, one of them."""
    given = [(name, getattr(body, name)) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(body, name) is not None]
    if len(given) > 1:
        raise SpecRefused(f"only one of {' and '.join(n for n, _ in given)} may be given", given[1][0])
    if not given:
        return None
    (name, value), = given
    if name == "guided_json":
        return _json_spec(value, name)
    if name == "guided_choice":
        return _choice_spec(value, name)
    return _text_spec(name.removeprefix("guided_"), value, name)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(RequestBody):
    model_config = ConfigDict(extra="allow")  # kept in model_extra, to refuse UNSUPPORTED ones

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)  # int64, as vLLM takes it
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)  # choices per prompt, each an independent sample
    best_of: int | None = None  # accepted only equal to n (vLLM's meaning: keep the n best of best_of)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's: > 0, 1 = off, over the prompt and the output
    user: str | None = None
    # vLLM's: logprob tokens spelled "token_id:N" (tokens that decode alike stay apart)
    return_tokens_as_token_ids: bool | None = None
    # OpenAI's {"token id": bias in [-100, 100]}, added to the logits before sampling
    # (parse_logit_bias; the ids are checked against the vocabulary by vocab_refusal).
    logit_bias: dict | None = None
    # vLLM's: only these token ids may be sampled (checked against the vocabulary by vocab_refusal).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output may not contain (as tokenizer.bad_words_token_ids tokenizes them).
    bad_words: list[str] | None = None
    # vLLM's: keep the stop string (or stop token's text) that ended the output in its text.
    include_stop_str_in_output: bool = False
    # vLLM's: False keeps special tokens' text in the output.
    skip_special_tokens: bool = True
    # vLLM's: each prompt token's logprob and rank, and this many most likely tokens there,
    # as `prompt_logprobs` beside the choices (not streamed, as vLLM refuses it with stream).
    prompt_logprobs: int | None = None
    # Structured outputs (structured.py; `grammar_spec` reads them): OpenAI's response_format
    # (text, json_object, json_schema), vLLM's structured_outputs (json, regex, choice,
    # grammar, json_object) and its older guided_* fields. One of them per request.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Parts of the OpenAI API this server does not implement: refused when they would change
    # the output (a 400 naming them), accepted when neutral (empty), never silently dropped.
    # (Chat completions take tools: ChatCompletionRequest.)
    tools: list | None = None
    TAKES_TOOLS: ClassVar[bool] = False

    def top_logprobs_k(self) -> int | None:
        """How many alternatives per token the response lists (None: no logprobs)."""
        raise NotImplementedError

    def max_tokens_asked(self) -> int | None:
        """The output length the request sets (None: the server picks it)."""
        raise NotImplementedError

    def refusal(self) -> tuple[str, str | None] | None:
        """(why, parameter) when this request cannot be served as asked; None when it can."""
        if self.n > MAX_N:
            return f"n must be at most {MAX_N}, got {self.n}", "n"
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                return f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}", \
                    "prompt_logprobs"
            if self.stream and self.prompt_logprobs > 0:  # vLLM's rule
                return "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            # vLLM's rule: options for a stream that is not one are a mistake, not ignored.
            return "stream_options can only be given with stream: true", "stream_options"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of is not supported (other than best_of equal to n)", "best_of"
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            return f"stop takes at most {MAX_STOP} strings, got {len(stop)}", "stop"
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_CHARS:
            return f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}", "stop"
        try:
            parse_logit_bias(self.logit_bias)
        except ValueError as e:
            return str(e), "logit_bias"
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            return "allowed_token_ids must name at least one token (leave it out to allow every token)", \
                "allowed_token_ids"
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) > MAX_ALLOWED_TOKENS:
            return f"allowed_token_ids takes at most {MAX_ALLOWED_TOKENS} tokens", "allowed_token_ids"
        words = self.bad_words or []
        if len(words) > MAX_BAD_WORDS_GIVEN:
            return f"bad_words takes at most {MAX_BAD_WORDS_GIVEN} words, got {len(words)}", "bad_words"
        if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
            return f"a bad word may have at most {MAX_BAD_WORD_CHARS} characters", "bad_words"
        try:
            self.grammar_spec()
        except SpecRefused as e:
            return e.why, e.param
        if self.tools and not self.TAKES_TOOLS:
            return "tools are not supported", "tools"
        limit = self.max_tokens_asked()
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            return f"min_tokens must be at most max_tokens ({limit}), got {self.min_tokens}", "min_tokens"
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in neutral):
                return f"{name} is not supported", name
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                return f"{name} must be between -2 and 2, got {value}", name
        if self.repetition_penalty is not None and not 0.0 < self.repetition_penalty < float("inf"):
            return f"repetition_penalty must be greater than 0, got {self.repetition_penalty}", "repetition_penalty"
        return None

    def grammar_spec(self) -> GrammarSpec | None:
        """The structured output the request asks for (None: free text). SpecRefused (why, the
        field) when a field is malformed, names what this server does not do, or when more
        than one field asks for one."""
        asked = [spec for spec in (_response_format_spec(self.response_format),
                                   _structured_outputs_spec(self.structured_outputs),
                                   _guided_spec(self)) if spec is not None]
        if len(asked) > 1:
            raise SpecRefused("only one structured output may be asked for, got "
                              + " and ".join(sorted({a.param for a in asked})), asked[1].param)
        return asked[0] if asked else None

    def vocab_refusal(self, vocab_size: int) -> tuple[str, str] | None:
        """(why, parameter) when logit_bias names a token outside a vocabulary of `vocab_size`
        (the logits' width), as vLLM refuses it; None when every id is in it."""
        bad = sorted(t for t in parse_logit_bias(self.logit_bias) if not 0 <= t < vocab_size)
        if bad:
            return f"logit_bias token ids {bad[:5]} are outside the vocabulary (size {vocab_size})", "logit_bias"
        bad = sorted({t for t in self.allowed_token_ids or () if not 0 <= t < vocab_size})
        if bad:
            return (f"allowed_token_ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                    "allowed_token_ids")
        return None

    @staticmethod
    def _logprobs_bound(name: str, value: int | None) -> tuple[str, str] | None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            return f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name
        return None

    def sampling(self, max_tokens: int, echo: bool = False, tokenizer=None, grammar=None) -> SamplingParams:
        """The request's SamplingParams; `tokenizer` tokenizes bad_words (the API refuses
        bad_words on a server without one); `grammar`, the compiled grammar of its
        `grammar_spec` (deps.compile_grammar)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            # Refused above max_tokens a request gives (refusal); a chat reply's max_tokens
            # from the context left may still be below it: the context ends the reply first.
            min_tokens=min(self.min_tokens or 0, max_tokens),
            seed=self.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self.top_logprobs_k(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            echo=echo,
            logit_bias=parse_logit_bias(self.logit_bias) or None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words_ids=bad_words_token_ids(tokenizer, self.bad_words) if self.bad_words else [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            # (a stream shows none: 0 is all one may ask for with one, and costs nothing then)
            prompt_logprobs_top=None if self.stream else self.prompt_logprobs,
            grammar=grammar,
        )

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """`params` for each of the n choices. With a seed, choice j samples with seed + j
        (vLLM's rule): the choices differ, the response is reproducible, and choice 0 is what
        n=1 gives. Without one, each choice's request gets its own seed from the engine."""
        if params.seed is None:
            return [params] * self.n
        return [dataclasses.replace(params, seed=params.seed + j) for j in range(self.n)]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's: false tokenizes a text prompt without BOS
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo: score the prompt
    echo: bool = False  # the text starts with the prompt, and with logprobs so do the logprobs
    suffix: str | None = None
    logprobs: int | None = None  # the sampled token's logprob plus this many most likely ones

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def max_tokens_asked(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens

    def refusal(self) -> tuple[str, str | None] | None:
        return (super().refusal() or self._logprobs_bound("logprobs", self.logprobs)
                or (("max_tokens 0 needs echo: true", "max_tokens")
                    if self.max_tokens == 0 and not self.echo else None)
                or (("suffix is not supported", "suffix") if self.suffix else None))


class TextContent(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    # JSON text, as OpenAI sends it; an object too, as vLLM takes one (a client that kept the
    # parsed arguments).
    arguments: str | dict


class MessageToolCall(BaseModel):
    """A call an assistant message made (an earlier turn of the conversation)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContent] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        """The content as one string; text parts joined by newlines, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it: {"role", "content"}, and where given its
        name, tool_call_id and tool_calls, each call's arguments as the object their JSON
        text holds (templates write them with `tojson`, as vLLM hands them over)."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return out


def _json_or_text(text: str | dict):
    if isinstance(text, dict):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None (or {}): no parameters
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatPromptFields(RequestBody):
    """The fields that make a chat prompt, as vLLM takes them: chat completions' and /tokenize's."""

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's fields that shape the chat prompt (template_options), as vLLM takes them; a
    # template other than the model's own is refused (prompt_refusal).
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None

    def chat_messages(self) -> list[dict]:
        """The messages as the chat template reads them (ChatMessage.for_template)."""
        return [m.for_template() for m in self.messages]

    def prompt_refusal(self, template: str | None) -> tuple[str, str] | None:
        """(why, parameter) when these fields ask for a prompt the tokenizer does not render
        (`template`: its chat template): another template (vLLM too refuses one sent in a
        request unless told to trust it), or both a generation prompt and the final message
        continued, which vLLM refuses as well."""
        if self.continue_final_message and self.add_generation_prompt is not False:
            return "continue_final_message and add_generation_prompt cannot both be true (send add_generation_prompt: " \
                   "false with continue_final_message: true)", "continue_final_message"
        if self.chat_template and self.chat_template != template:
            return "chat_template is not supported (the model's own chat template renders the prompt)", \
                "chat_template"
        if "messages" in (self.chat_template_kwargs or {}):
            return "chat_template_kwargs may not set messages", "chat_template_kwargs"
        return None

    def template_tools(self) -> list[dict] | None:
        return None  # (chat completions and /tokenize show their tools to the template)

    def template_options(self) -> dict:
        """Tokenizer.apply_chat_template's keyword arguments for these fields."""
        return dict(add_generation_prompt=self.add_generation_prompt is not False,
                    continue_final_message=bool(self.continue_final_message), tools=self.template_tools(),
                    template_kwargs=self.chat_template_kwargs, documents=self.documents or None,
                    add_special_tokens=bool(self.add_special_tokens))


class ChatCompletionRequest(_SamplingFields, ChatPromptFields):
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None  # alternatives per token; needs logprobs: true
    echo: bool = False  # vLLM's: the reply starts with a final assistant message's content
    # Tool calling (api/tools.py): the tools shown to the chat template, and what the reply may be.
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: "required" makes one call at most
    TAKES_TOOLS: ClassVar[bool] = True

    def tool_mode(self) -> str:
        """none, auto, required or named: what tool_choice asks (with tools, auto by default)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def named_tool(self) -> ToolDef:
        name = self.tool_choice.function.name
        return next(t for t in self.tools if t.function.name == name)

    def template_tools(self) -> list[dict] | None:
        return _template_tools(self.tools)

    def grammar_spec(self) -> GrammarSpec | None:
        """A structured output the request asks for, or the one its tool_choice holds the
        reply to (named or required); both at once are refused."""
        from .tools import tool_grammar_spec

        asked = super().grammar_spec()
        if self.tool_mode() == "named" and self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise SpecRefused(f"tool_choice names {self.tool_choice.function.name!r}, which is not one of the tools",
                              "tool_choice")
        tools = tool_grammar_spec(self)
        if tools is not None and len(tools.value) > MAX_SPEC_CHARS:  # the bound of any structured output
            raise SpecRefused(f"the tools' parameters schemas may have at most {MAX_SPEC_CHARS} characters in all "
                              f"under tool_choice {self.tool_mode()}, got {len(tools.value)}", "tools")
        if asked is not None and tools is not None:
            raise SpecRefused(f"tool_choice {self.tool_mode()} cannot be combined with {asked.param}", "tool_choice")
        return tools or asked

    def echoed(self) -> str:
        """What echo puts before each reply: the last message's content when it is the
        assistant's (the reply's role), as vLLM does; otherwise nothing."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def refusal(self) -> tuple[str, str | None] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs: true", "top_logprobs"
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return "tool_choice needs tools", "tool_choice"
        names = [t.function.name for t in self.tools or ()]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:  # a call names its function only: which of two would it be?
            return f"tools: function names must be unique, {twice!r} is given twice", "tools"
        return super().refusal() or self._logprobs_bound("top_logprobs", self.top_logprobs)


class TokenizeCompletionRequest(RequestBody):
    """vLLM's POST /tokenize of a text prompt."""

    model: str | None = None  # the base when left out
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


def _template_tools(tools: list[ToolDef] | None) -> list[dict] | None:
    """The tools as the chat template reads them (OpenAI's shape), None without."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class TokenizeChatRequest(ChatPromptFields):
    """vLLM's POST /tokenize of a conversation, rendered as chat completions render it (its
    tools too: they are part of the prompt)."""

    model: str | None = None
    return_token_strs: bool | None = False
    tools: list | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list | None) -> list[ToolDef] | None:
        """Each a ToolDef, as chat completions take it; what is wrong is named under "tools"."""
        try:
            return TypeAdapter(list[ToolDef] | None).validate_python(tools)
        except ValidationError as e:
            raise ValueError("; ".join(f"tools.{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                       for err in e.errors())) from None

    def template_tools(self) -> list[dict] | None:
        return _template_tools(self.tools)


def _tokenize_kind(body) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


# POST /tokenize's body: a chat's when it has messages, else a prompt's. Picked by that, not
# tried as both, so that a bad chat body's errors are its own, not "prompt: Field required".
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")], Discriminator(_tokenize_kind)]


class DetokenizeRequest(RequestBody):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class LoadAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with `cached_tokens` (--enable-prompt-tokens-details), its
    `prompt_tokens_details`."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out
