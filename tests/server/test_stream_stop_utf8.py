"""Stop strings and multi-byte UTF-8 characters split across tokens, as byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen) split them: a token may end in the first bytes of a
character (" \\xe2\\x80" is the start of " —", " “", " ’"), whose text the detokenizer holds
back until the character is complete, or until the request ends and the tail is flushed."""

from __future__ import annotations

from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams


class ByteTokenizer:
    """Token i is the bytes VOCAB[i]; decoding joins them and replaces an incomplete or
    invalid UTF-8 sequence with U+FFFD, as `tokenizers` does."""

    VOCAB = [b"<s>", b"</s>", b" Huma", b"n \xe2\x80", b"\x94", b"ok", b"\x97", b"\xa5", b"\xe6",
             b"\xe6\x9c", b"\xac", b"x"]
    special_ids = frozenset({0, 1})

    def decode(self, ids):
        return b"".join(self.VOCAB[i] for i in ids if i not in self.special_ids).decode("utf-8", "replace")


def tid(piece: bytes) -> int:
    return ByteTokenizer.VOCAB.index(piece)


def run(params: SamplingParams, pieces: list[bytes], eos=(1,)) -> tuple[list[str], Request]:
    req = Request.new("r", [0], params, None, 0, ByteTokenizer())
    deltas = []
    for piece in pieces:
        if req.finished:
            break
        req.append(tid(piece), eos, 1000)
        deltas.append(req.take_output().text)
    return deltas, req


def test_a_stop_string_completed_by_a_token_ending_in_a_split_character_and_length():
    # "n \xe2\x80" completes " Human" but ends in half a character: its text is held back; the
    # request then ends by max_tokens and the flushed tail must still be cut at the stop string.
    deltas, req = run(SamplingParams(max_tokens=3, stop=[" Human"]), [b"ok", b" Huma", b"n \xe2\x80"])
    assert "".join(deltas) == "ok"
    assert req.finish_reason == "stop"


def test_a_stop_string_in_the_flushed_tail_before_eos_is_cut():
    deltas, req = run(SamplingParams(max_tokens=10, stop=[" Human"]), [b"ok", b" Huma", b"n \xe2\x80", b"</s>"])
    assert "".join(deltas) == "ok" and req.finish_reason == "stop"


def test_the_character_completed_by_the_next_token_is_whole_and_the_stop_still_cuts():
    deltas, req = run(SamplingParams(max_tokens=10, stop=[" Human"]), [b"ok", b" Huma", b"n \xe2\x80", b"\x94"])
    assert "".join(deltas) == "ok" and req.finish_reason == "stop"
    deltas, req = run(SamplingParams(max_tokens=10, stop=["zz"]), [b"ok", b" Huma", b"n \xe2\x80", b"\x94", b"ok"])
    assert "".join(deltas) == "ok Human —ok" and "\ufffd" not in "".join(deltas)


def test_a_multi_byte_stop_string_split_over_tokens():
    pieces = [b"ok", b"\xe6", b"\x97", b"\xa5", b"\xe6\x9c", b"\xac", b"x"]  # ok 日 本 x
    deltas, req = run(SamplingParams(max_tokens=10, stop=["日本"]), pieces)
    assert "".join(deltas) == "ok" and req.finish_reason == "stop" and "\ufffd" not in "".join(deltas)
    deltas, req = run(SamplingParams(max_tokens=10, stop=["本x"]), pieces)
    assert "".join(deltas) == "ok日" and req.finish_reason == "stop"
    deltas, req = run(SamplingParams(max_tokens=10), pieces)
    assert "".join(deltas) == "ok日本x" and all("\ufffd" not in d for d in deltas)
