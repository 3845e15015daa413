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
  and comes back as those calls, finish_reason "tool_calls" (OpenAI's and vLLM's).
- "auto", the default with tools (the server needs `--enable-auto-tool-choice` and
  `--tool-call-parser`): the model writes text, or calls as its template taught it, and a
  parser reads them out of the reply (`hermes`: `<tool_call>{"name", "arguments"}</tool_call>`
  blocks, text before them the content; `llama3_json`: a reply that is a JSON object
  `{"name", "parameters"}`, or several joined by ";"). A reply the parser cannot read as
  calls is the content, whole.

Streamed, the text that cannot be part of a call is sent as it comes. A named tool's call
streams as OpenAI's does: a first delta with its id and name, then its arguments piece by
piece as the model writes them. Other calls' text is held back and the calls come in one
delta at the end (`ToolStream`).
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
        return {**({"index": index} if index is not None else {}), "id": new_call_id(),
                "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


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
    arguments, whole or cut (None for no text at all); "required"'s, None when the reply is not
    a whole one (max_tokens or a stop string cut it)."""
    if body.tool_choice != "required":
        arguments = text.strip()
        return [ToolCall(body.named_tool().function.name, arguments)] if arguments else None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


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
    named: no content; the call's first delta (id, name) once the arguments begin, then
    their text as it comes (whitespace at either end held back: the arguments are stripped);
    required: all of it is held."""

    def __init__(self, parser: str | None, body=None):
        self.parser = parser
        self.body = body  # for a forced reply (parser None)
        self.text = ""
        self._sent = 0  # characters of text sent as content
        self._holding = parser is None
        self._named = parser is None and body is not None and body.tool_mode() == "named"
        self._args_sent: int | None = None  # characters of the named call's arguments sent (None: no delta yet)

    def call_deltas(self) -> list[dict]:
        """The named call's deltas that can go now: its first (id, name, the arguments so far),
        or the arguments written since (the text stripped: whitespace at the end waits)."""
        if not self._named:
            return []
        args = self.text.strip()
        if self._args_sent is None:
            if not args:
                return []
            self._args_sent = len(args)
            return [{"index": 0, "id": new_call_id(), "type": "function",
                     "function": {"name": self.body.named_tool().function.name, "arguments": args}}]
        piece, self._args_sent = args[self._args_sent:], max(self._args_sent, len(args))
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def feed(self, delta: str) -> str:
        self.text += delta
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
        _, calls = read_reply(self.parser, self.body, self.text)
        # With calls, the content went out as it came (hermes: the text before the first
        # call; forced and llama3_json replies have none); without, what was held goes now.
        return ("", calls) if calls else (self.text[self._sent:], [])

    def end_deltas(self, calls: list[ToolCall]) -> list[dict]:
        """The tool_calls deltas of `calls` (`end`'s) not sent yet: the named call's last
        arguments, or every call (held back to the end)."""
        if self._named:
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
