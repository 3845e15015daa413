"""The `bytes` of a chat logprob are the token's own UTF-8 bytes, as OpenAI defines them ("useful
when characters are represented by multiple tokens and their byte representations must be
combined"): a token that holds part of a character ("日" is three byte-level tokens) has
its part, not the three bytes of "\\ufffd" that its text alone decodes to. Joined, the
bytes of an answer's tokens are the answer."""

from __future__ import annotations

import json

import httpx
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from loraplex.server.demo import build_tokenizer
from loraplex.server.tokenizer import Tokenizer

from .test_tokenizer import SENTENCEPIECE_DECODERS

TEXT = "héllo 中文 😀 wörld, 日本語のテキスト"


def test_the_bytes_of_a_byte_level_text_s_tokens_join_into_the_text(tmp_path):
    build_tokenizer(tmp_path, vocab_size=320)
    tok = Tokenizer(tmp_path)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # the characters are split over tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == TEXT
    assert tok.token_bytes(tok.eos_token_id) == b""  # a special token: no text, no bytes


def sentencepiece_with_byte_fallback(path) -> Tokenizer:
    """Llama 2's layout: the 256 byte pieces "<0x00>".."<0xFF>" are ordinary vocabulary
    entries, which a character outside the vocabulary falls back to, one per byte."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "h": 4, "l": 5, "o": 6, "\u2581h": 7}
    vocab |= {f"<0x{b:02X}>": 8 + b for b in range(256)}
    tok = HFTokenizer(models.BPE(vocab, [("\u2581", "h")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = SENTENCEPIECE_DECODERS["llama-2"]()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(path)


def test_a_sentencepiece_byte_piece_is_its_byte(tmp_path):
    tok = sentencepiece_with_byte_fallback(tmp_path)
    ids = tok.encode("hollo 中文 😀", add_special_tokens=False)
    pieces = [tok._tok.id_to_token(i) for i in ids]
    assert "<0xE4>" in pieces and "\u2581h" in pieces
    cjk = [i for i, p in zip(ids, pieces) if p.startswith("<0x")]
    assert any("\ufffd" in tok.decode([i]) for i in cjk)  # alone, a byte piece is no character
    assert b"".join(tok.token_bytes(i) for i in cjk) == "中文😀".encode()
    assert tok.decode(ids) == "hollo 中文 😀"
    assert tok.token_bytes(tok._tok.token_to_id("l")) == b"l"


def test_chat_logprob_bytes_join_into_the_answer(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        split = 0
        for seed in range(6):
            r = c.post("/v1/chat/completions", json={
                "model": "qv-r8", "messages": [{"role": "user", "content": "日本語 😀"}], "max_tokens": 24,
                "temperature": 1.0, "seed": seed, "ignore_eos": True, "logprobs": True, "top_logprobs": 3})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            content = choice["logprobs"]["content"]
            joined = b"".join(bytes(t["bytes"]) for t in content).decode("utf-8", errors="replace")
            assert joined == choice["message"]["content"], (seed, content)
            split += sum(t["token"] == "\ufffd" for t in content)
            for t in content:
                for alt in t["top_logprobs"]:
                    if alt["token"] != "\ufffd":
                        assert bytes(alt["bytes"]) == alt["token"].encode()
                    else:  # part of a character: its own bytes, none of them a whole character
                        assert alt["bytes"] and alt["bytes"] != [239, 191, 189]
        assert split  # characters split over tokens were sampled: the check meant something
