"""Tool calling on chat completions: OpenAI's `tools` and `tool_choice`, served as vLLM
serves them.

The tools are shown to the chat template (its `tools` variable); what the reply may be
depends on `tool_choice`:

- "none": text, as without tools.
- a named tool (`{"type": "function", "function": {"name": "f"}}`): the reply is held to f's
  parameters schema (a structured output, structured.py) and comes back as one call of f,
  its text the arguments, finish_reason "stop" (OpenAI's, for a forced function); cut by
  max_tokens or a stop string, still the call (its arguments cut), as OpenAI's.
- "required": the reply is held to a JSON array of calls, `[{"name": <a tool's>,
  "parameters": <its schema>}, ...]` (one call at most with `parallel_tool_calls: false`),
  and comes back as those calls, each its parameters' text the arguments, finish_reason
  "tool_calls" (OpenAI's and vLLM's); cut, the calls whose names it wrote, the last one's
  arguments cut.
- "auto", the default with tools (the server needs `--enable-auto-tool-choice` and
  `--tool-call-parser`): the model writes text, or calls as its template taught it, and a
  parser reads them out of the reply (`hermes`: `<tool_call>{"name", "arguments"}</tool_call>`
  blocks, text before them the content; `llama3_json`: a reply that is a JSON object
  `{"name", "parameters"}`, or several joined by ";"). A reply the parser cannot read as
  calls is the content, whole.

Streamed, the text that cannot be part of a call is sent as it comes. The calls of a named
tool or "required" stream as OpenAI's do: a first delta with a call's id and name, then its
arguments piece by piece as the model writes them. An "auto" reply's calls are held back
and come in one delta at the end (`ToolStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..structured import GrammarSpec


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`

    def as_openai(self, index: int | None = None) -> dict:
        """The call as a message's `tool_calls` entry (with `index`, a stream delta's)."""
        return {**({"index": index} if index is not None else {}), "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _parameters(tool) -> dict:
    """A tool's parameters schema. Without one (or with {}) the tool takes none, as OpenAI
    defines it ("an empty parameter list") and vLLM holds it: its arguments are {}."""
    return tool.function.parameters or {"type": "object", "properties": {}, "additionalProperties": False}


# Keywords whose values are JSON values, not schemas (a "$ref" key there is data), and those
# whose values map names to schemas (the names are no keywords).
_VALUES = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _moved(schema, at: str):
    """`schema` placed at JSON pointer `at` of a larger schema: its references within itself
    ("#", "#/$defs/City") rewritten to where it now lies ("#" + at + "/$defs/City")."""
    if isinstance(schema, list):
        return [_moved(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            value = "#" + at + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _moved(s, at) for name, s in value.items()}
        elif key not in _VALUES:
            value = _moved(value, at)
        out[key] = value
    return out


def required_schema(tools: list, one: bool) -> dict:
    """The JSON schema of a "required" reply: an array of calls of the given tools. Each
    tool's parameters sit inside it, so their own references ($defs) are moved with them."""
    at = ["/items" if len(tools) == 1 else f"/items/anyOf/{i}" for i in range(len(tools))]
    calls = [{"type": "object", "properties": {
        "name": {"const": t.function.name}, "parameters": _moved(_parameters(t), f"{at[i]}/properties/parameters")},
        "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    return {"type": "array", "minItems": 1, **({"maxItems": 1} if one else {}),
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def tool_grammar_spec(body) -> GrammarSpec | None:
    """The structured output a request's tool_choice holds its reply to: the named tool's
    parameters, or (required) an array of calls; None for "none" and "auto"."""
    choice = body.tool_choice
    if not body.tools or choice in (None, "none", "auto"):
        return None
    if choice == "required":
        schema = required_schema(body.tools, one=body.parallel_tool_calls is False)
    else:
        schema = _parameters(body.named_tool())
    return GrammarSpec("json", json.dumps(schema, ensure_ascii=False), "tool_choice")


def forced_calls(body, text: str) -> list[ToolCall] | None:
    """The calls of a reply held by tool_choice: a named tool's, its text (stripped) the
    arguments; "required"'s, each its parameters' text (RequiredCalls). Whole or cut by
    max_tokens or a stop string (the last call's arguments cut, a call whose name was cut
    left out); None for a reply with no call."""
    if body.tool_choice != "required":
        arguments = text.strip()
        return [ToolCall(body.named_tool().function.name, arguments)] if arguments else None
    reader = RequiredCalls()
    reader.feed(text)
    return reader.calls() or None


def _string(raw: str) -> str | None:
    """A JSON string's text decoded; None if it is none (which no grammar-held reply writes)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class RequiredCalls:
    """An incremental reader of a "required" reply, which its grammar holds to a JSON array of
    {"name": ..., "parameters": ...} objects (in that order, required_schema): each call's name
    once its string is whole, and its parameters' text as far as it is written, so that the
    arguments can stream as the model writes them (`feed` the text as it comes; `calls`).
    The arguments are the model's own text of the parameters, as OpenAI's are.

    A character scanner, not a parser: the grammar already made the text valid JSON. It keeps
    the nesting depth (2 inside a call object) and whether it is in a string, and at depth 2
    which key's value comes (`_key`) and where that value lies."""

    def __init__(self) -> None:
        self.text = ""
        self._depth = 0
        self._in_string = self._escape = False
        self._string_at = 0  # where the string being read began (its quote)
        self._expect = ""  # at depth 2: "key", "value" (after the colon), "in-value", "" (after one)
        self._key: str | None = None
        self._last = 0  # the last character of a number, true, false or null being read at depth 2
        self._calls: list[list] = []  # [name or None, parameters' start or None, their end or None]

    def feed(self, delta: str) -> None:
        start, self.text = len(self.text), self.text + delta
        text = self.text
        for i in range(start, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 2:
                        self._string_ended(text[self._string_at: i + 1], i + 1)
                continue
            if ch in " \t\r\n":
                continue
            if self._depth == 2 and self._expect == "value":  # a value of the call's `_key` begins
                self._expect = "in-value"
                if self._key == "parameters":
                    self._calls[-1][1] = i
            if ch == '"':
                self._in_string, self._string_at = True, i
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2 and ch == "{":
                    self._calls.append([None, None, None])
                    self._expect = "key"
            elif ch in "]}":
                if self._depth == 2:
                    self._value_ended(self._last + 1)  # a number or literal ended by the call's end
                self._depth -= 1
                if self._depth == 2 and self._expect == "in-value":  # an object or array value ended
                    self._value_ended(i + 1)
            elif self._depth == 2:
                if ch == ":":
                    self._expect = "value"
                elif ch == ",":
                    self._value_ended(self._last + 1)
                    self._expect = "key"
                else:
                    self._last = i

    def _string_ended(self, raw: str, end: int) -> None:
        if self._expect == "key":
            self._key = _string(raw)
        elif self._expect == "in-value":
            if self._key == "name":
                self._calls[-1][0] = _string(raw)
            self._value_ended(end)

    def _value_ended(self, end: int) -> None:
        if self._expect == "in-value":
            if self._key == "parameters":
                self._calls[-1][2] = end
            self._expect = ""

    def arguments(self, k: int) -> str | None:
        """Call k's arguments as far as written: its parameters' text up to their end, or up
        to the text's end while they are being written ("" before they start); None while its
        name is not whole."""
        name, start, end = self._calls[k]
        if name is None:
            return None
        if start is None:
            return ""
        if end is None and self._depth == 2 and self._expect == "in-value" and self.text[start] not in "[{\"":
            end = self._last + 1  # a number or literal: up to its last character
        return self.text[start: end if end is not None else len(self.text)]

    def calls(self) -> list[ToolCall]:
        """The calls so far (a cut call's arguments cut), those with a name."""
        return [ToolCall(c[0], self.arguments(k)) for k, c in enumerate(self._calls) if c[0] is not None]


# -- "auto": reading calls out of a reply --------------------------------------------------------

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.S)
_PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's opening of a call, where its template writes one


def _call_of(obj, arguments_key: str) -> ToolCall | None:
    """The call a parsed {"name", arguments_key} object makes. Arguments a model wrote as a
    string of JSON ("{\"city\": \"Paris\"}") are that JSON; any other string is a JSON string,
    for `function.arguments` is always JSON text (clients json.loads it)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments" if arguments_key == "parameters" else "parameters", {}))
    if isinstance(args, str) and _is_json(args):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a hermes-style reply: `<tool_call>` blocks of JSON (the last one
    may be cut before its closing tag), the text before the first one the content (the
    whitespace that ends it, before the tag, left out: so ToolStream sends it)."""
    if _HERMES_OPEN not in text:
        return text, []
    calls = []
    for m in _HERMES_CALL.finditer(text):
        try:
            call = _call_of(json.loads((m.group(1) if m.group(1) is not None else m.group(2)).strip()), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index(_HERMES_OPEN)].rstrip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a Llama 3 reply: calls when the whole reply is JSON objects
    {"name", "parameters"} (after an optional <|python_tag|>), joined by ";"; else content."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call_of(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


class ToolStream:
    """A streamed reply's text split as it comes: `feed` returns the text that can be sent as
    content now, `call_deltas` the tool_calls deltas that can be sent now; `end` returns the
    rest of the content and the calls, `end_deltas` their deltas not sent yet.

    hermes: content streams until a `<tool_call>` (text that could begin one, and whitespace
    at the end, are held back);
    llama3_json: a reply that starts with "{" (or the python tag) is held whole;
    named and required (forced): no content; each call's first delta (id, name, the
    arguments so far) once its name is known, then its arguments as they are written (named:
    the reply, whitespace at either end held back; required: RequiredCalls)."""

    def __init__(self, parser: str | None, body=None):
        self.parser = parser
        self.body = body  # for a forced reply (parser None)
        self.text = ""
        self._sent = 0  # characters of text sent as content
        self._holding = parser is None
        mode = body.tool_mode() if parser is None and body is not None else None
        self._named = mode == "named"
        self._required = RequiredCalls() if mode == "required" else None
        self._forced = self._named or self._required is not None  # held by tool_choice
        self._args_sent: list[int] = []  # per call streamed, the characters of its arguments sent

    def _forced_calls(self) -> list[ToolCall]:
        """A forced reply's calls as far as written: the required reader's (fed as the text
        came, not scanned again), or forced_calls' of the named tool."""
        if self._required is not None:
            return self._required.calls()
        return (forced_calls(self.body, self.text) or []) if self._named else []

    def call_deltas(self) -> list[dict]:
        """The tool_calls deltas of a forced reply that can go now: a call's first (its id,
        name and arguments so far), or the arguments written since."""
        deltas = []
        for k, call in enumerate(self._forced_calls()):
            args = call.arguments
            if k == len(self._args_sent):
                self._args_sent.append(len(args))
                deltas.append(call.as_openai(k))
            elif len(args) > self._args_sent[k]:
                deltas.append({"index": k, "function": {"arguments": args[self._args_sent[k]:]}})
                self._args_sent[k] = len(args)
        return deltas

    def feed(self, delta: str) -> str:
        self.text += delta
        if self._required is not None:
            self._required.feed(delta)
        if self._holding:
            return ""
        if self.parser == "llama3_json":
            head = self.text.lstrip()
            if self._sent == 0:  # undecided: calls, or text
                if head.startswith("{") or head.startswith(_PYTHON_TAG):
                    self._holding = True
                    return ""
                if not head or _PYTHON_TAG.startswith(head):  # whitespace, or maybe the tag
                    return ""
            out, self._sent = self.text[self._sent:], len(self.text)
            return out
        # hermes: whitespace at the end is held too, for it ends the content if a call follows.
        at = self.text.find(_HERMES_OPEN, self._sent)
        if at >= 0:
            self._holding = True
            end = max(self._sent, len(self.text[:at].rstrip()))
            out, self._sent = self.text[self._sent:end], end
            return out
        keep = next((n for n in range(min(len(_HERMES_OPEN) - 1, len(self.text)), 0, -1)
                     if self.text.endswith(_HERMES_OPEN[:n])), 0)
        end = len(self.text[:len(self.text) - keep].rstrip())
        out = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def end(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls) once the reply is whole."""
        calls = self._forced_calls() if self._forced else read_reply(self.parser, self.body, self.text)[1]
        # With calls, the content went out as it came (hermes: the text before the first
        # call; forced and llama3_json replies have none); without, what was held goes now.
        return ("", calls) if calls else (self.text[self._sent:], [])

    def end_deltas(self, calls: list[ToolCall]) -> list[dict]:
        """The tool_calls deltas of `calls` (`end`'s) not sent yet: a forced reply's last
        arguments, or every call (an "auto" reply's, held back to the end)."""
        if self._forced:
            return self.call_deltas()
        return [c.as_openai(k) for k, c in enumerate(calls)]


def read_reply(parser: str | None, body, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply: read by `parser` under "auto" (its first call only
    with `parallel_tool_calls: false`), else (parser None) a reply held by tool_choice, which
    is all calls; a reply without calls is all content."""
    if parser is not None:
        content, calls = PARSERS[parser](text)
        if calls and body is not None and body.parallel_tool_calls is False:
            calls = calls[:1]  # as vLLM: the reply's first call alone, the others dropped
        return content, calls
    calls = forced_calls(body, text)
    return (None, calls) if calls else (text, [])


def finish_reason(mode: str, calls: list[ToolCall], reason: str | None) -> str | None:
    """OpenAI's, as vLLM gives it: "tool_calls" where an "auto" reply made calls, or a
    "required" one made them and ended by itself ("stop"); a named tool's call keeps
    "stop" (OpenAI's, for a forced function), and a reply without calls its own reason."""
    if calls and (mode == "auto" or (mode == "required" and reason == "stop")):
        return "tool_calls"
    return reason
