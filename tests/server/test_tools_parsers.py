"""The "auto" parsers on replies as models write them, whole and streamed
(server/api/tools.py): the content a stream sends plus its calls are what the whole reply
reads as, however the reply's text is split into deltas."""

from __future__ import annotations

import json
import random

import pytest

from loraplex.server.api.tools import ToolCall, ToolStream, read_reply

from .conftest import merged_calls

CALL = '{"name": "get_weather", "arguments": {"city": "Zürich"}}'
REPLIES = {
    "hermes": [
        f"<tool_call>\n{CALL}\n</tool_call>",  # Qwen2.5's own layout
        f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>",
        f"\n\n<tool_call>{CALL}</tool_call>\n",  # whitespace only before the call
        f"  Sure  \t<tool_call>{CALL}</tool_call> and text after",
        f"<tool_call>{CALL}</tool_call>\n<tool_call>{{\"name\": \"t\", \"arguments\": {{}}}}</tool_call>",
        f"one <tool_call>{CALL}",  # cut before the closing tag
        "x <tool_call>{oops", "a <tool> b <tool_ca", "no call at all\n\n", "  ", "", "ok </tool_call>",
        f"<<tool_call>{CALL}</tool_call>",
    ],
    "llama3_json": [
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "é"}}\n',
        "\n\nHello {there}", "<|python_tag|>hi", "<|pyth", "{not json", "  ",
        '{"name": "a", "parameters": {}} trailing',
    ],
}


def splits(text: str):
    """Every way of cutting the text once, and one character a delta."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("parser,text", [(p, t) for p, texts in REPLIES.items() for t in texts])
def test_the_stream_reads_as_the_whole_reply(parser, text):
    content, calls = read_reply(parser, None, text)
    for parts in splits(text):
        stream = ToolStream(parser)
        sent = "".join(stream.feed(part) for part in parts)
        rest, streamed_calls = stream.end()
        assert ((sent + rest) or None, streamed_calls) == (content or None, calls), parts


def test_hermes_content_ends_before_the_whitespace_that_leads_to_the_call():
    assert read_reply("hermes", None, f"Let me check.\n<tool_call>{CALL}</tool_call>") == \
        ("Let me check.", [ToolCall("get_weather", '{"city": "Zürich"}')])
    assert read_reply("hermes", None, f"\n \n<tool_call>{CALL}</tool_call>")[0] is None
    assert read_reply("hermes", None, f"\n  Hi <tool_call>{CALL}</tool_call>")[0] == "\n  Hi"


@pytest.mark.parametrize("parser,key", [("hermes", "arguments"), ("llama3_json", "parameters")])
def test_arguments_written_as_a_string_are_json_text(parser, key):
    def reply(args: str) -> str:
        call = f'{{"name": "f", "{key}": {args}}}'
        return f"<tool_call>{call}</tool_call>" if parser == "hermes" else call

    # A string of JSON is that JSON; a string that is no JSON is a JSON string, never bare
    # text that a client's json.loads(arguments) fails on.
    assert read_reply(parser, None, reply('"{\\"city\\": \\"Oslo\\"}"'))[1] == [ToolCall("f", '{"city": "Oslo"}')]
    assert read_reply(parser, None, reply('"Oslo"'))[1] == [ToolCall("f", '"Oslo"')]
    assert read_reply(parser, None, reply('{"q": "日本"}'))[1] == [ToolCall("f", '{"q": "日本"}')]


@pytest.mark.parametrize("parser,text", [
    ("hermes", f"First.\n<tool_call>{CALL}</tool_call>\n<tool_call>{{\"name\": \"t\", \"arguments\": {{}}}}</tool_call>"),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'),
])
@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_keeps_the_first_call(parser, text, parallel):
    """As vLLM: under "auto" a reply of two calls gives its first one alone when the request
    says parallel_tool_calls false, whole and streamed; both otherwise (the default: true)."""
    from types import SimpleNamespace

    body = SimpleNamespace(parallel_tool_calls=parallel)
    content, calls = read_reply(parser, body, text)
    assert len(calls) == (1 if parallel is False else 2)
    assert calls[0].name == ("get_weather" if parser == "hermes" else "a")
    stream = ToolStream(parser, body)
    sent = "".join(stream.feed(ch) for ch in text)
    rest, streamed = stream.end()
    assert [c.name for c in streamed] == [c.name for c in calls] and (sent + rest or None) == content


REQUIRED = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}, {"name":"get_time","parameters":{"zone":"U\\"TC"}}]',
    '[ {"name" : "f" , "parameters" : { "a" : [1, {"b": "}]"}] } } ]',
    '[{"name": "g", "parameters": 12}]',
    '[{"name": "g", "parameters": null}, {"name": "h", "parameters": "x,}"}]',
    '[]',
]


class _Body:
    """What ToolStream reads of a request held by tool_choice "required"."""

    tool_choice = "required"
    parallel_tool_calls = None

    def tool_mode(self) -> str:
        return "required"


def _streamed(text: str, seed: int) -> tuple[str, list[dict], int]:
    """A "required" reply fed in random pieces: (content sent, the tool_calls deltas sent, how
    many of them went before the reply's end)."""
    rng = random.Random(seed)
    stream, content, deltas, i = ToolStream(None, _Body()), "", [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        content += stream.feed(text[i: i + n])
        deltas += stream.call_deltas()
        i += n
    rest, calls = stream.end()
    return content + rest, deltas + stream.end_deltas(calls), len(deltas)


@pytest.mark.parametrize("text", REQUIRED)
def test_required_calls_stream_as_their_arguments_are_written(text):
    """The calls of a "required" reply (its grammar's JSON array) stream as OpenAI's do, each
    its id and name first, then its arguments in pieces as they come; put together they are
    the whole reply's calls, whose arguments are the parameters' own text."""
    want = [(c["name"], c["parameters"]) for c in json.loads(text)]
    _, whole = read_reply(None, _Body(), text)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == want
    for seed in range(20):
        content, deltas, before_end = _streamed(text, seed)
        assert content == ("" if want else text)  # "[]": no call, the content
        assert before_end >= len(want)  # each call began before the reply ended
        assert all(d["id"].startswith("chatcmpl-tool-") for d in deltas if "id" in d)
        merged = merged_calls(deltas)
        assert [c["function"] for c in merged] == [{"name": c.name, "arguments": c.arguments} for c in whole]


def test_a_cut_required_reply_keeps_the_calls_it_named():
    """Cut by max_tokens: the calls whose names are whole, the last one's arguments cut (as
    OpenAI's cut calls); cut before any name, the text is the content."""
    text = REQUIRED[0]
    cut = text[: text.index('"zone"') + 4]
    _, calls = read_reply(None, _Body(), cut)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "unit": "C"}'),
                                                       ("get_time", '{"zon')]
    assert read_reply(None, _Body(), '[{"name": "get_w') == ('[{"name": "get_w', [])
    assert _streamed(cut, 0)[1][-1]["function"]["arguments"]  # streamed up to the cut too
