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


def test_random_byte_pieces_and_stop_strings_keep_the_stream_consistent():
    """Random byte-level pieces of multi-byte text, random stop strings: the joined deltas
    are a prefix of the whole decode, hold no stop string, and a request ended by length
    never generated one."""
    import random

    chars = "ab日本—x"
    rng = random.Random(0)
    pieces = set()
    for _ in range(300):
        s = "".join(rng.choice(chars) for _ in range(3)).encode()
        i = rng.randrange(len(s))
        pieces.add(s[i:rng.randrange(i + 1, len(s) + 1)])
    vocab = [b"<s>", b"</s>", *sorted(pieces)]

    class Tok:
        special_ids = frozenset({0, 1})

        def decode(self, ids):
            return b"".join(vocab[i] for i in ids if i > 1).decode("utf-8", "replace")

    for _ in range(3000):
        stops = ["".join(rng.choice(chars) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(3))]
        req = Request.new("r", [0], SamplingParams(max_tokens=rng.randrange(1, 15), stop=stops), None, 0, Tok())
        toks, deltas = [], []
        while not req.finished:
            toks.append(1 if rng.random() < 0.03 else rng.randrange(2, len(vocab)))
            req.append(toks[-1], (1,), 1000)
            deltas.append(req.take_output().text)
        out, full = "".join(deltas), Tok().decode(toks)
        assert full.startswith(out) and not any(s in out for s in stops), (stops, toks)
        if req.finish_reason == "length":
            assert not any(s in full for s in stops), (stops, toks)
