"""The "auto" parsers on replies as models write them, whole and streamed
(server/api/tools.py): the content a stream sends plus its calls are what the whole reply
reads as, however the reply's text is split into deltas."""

from __future__ import annotations

import pytest

from loraplex.server.api.tools import ToolCall, ToolStream, read_reply

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
