"""Text out of token ids while streaming: each step's delta, joined, is the text the output
continues the prompt with, whatever the tokenizer's decoder does at a window's start (a
SentencePiece decoder drops a leading space) and however a UTF-8 character is split."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from loraplex.server.demo import _CORPUS, build_tokenizer
from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams
from loraplex.server.tokenizer import Tokenizer

# The decoders of SentencePiece models' tokenizer.json: Llama 2's (Replace, ByteFallback, Fuse,
# Strip one leading space) and the newer Metaspace one; both drop the first token's space.
SENTENCEPIECE_DECODERS = {
    "llama-2": lambda: decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                          decoders.Strip(" ", 1, 0)]),
    "metaspace": lambda: decoders.Metaspace(replacement="▁", prepend_scheme="first"),
}


def sentencepiece_tokenizer(path, decoder: str) -> Tokenizer:
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = SENTENCEPIECE_DECODERS[decoder]()
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator([_CORPUS] * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                               show_progress=False))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "add_bos_token": True}))
    return Tokenizer(path)


def stream(tok: Tokenizer, prompt: list[int], output: list[int], stop: list[str] = ()) -> tuple[list[str], Request]:
    req = Request.new("r", prompt, SamplingParams(max_tokens=1000, stop=list(stop)), None, 0, tok)
    deltas = []
    for t in output:
        if req.finished:
            break
        req.append(t, (), 10_000)
        deltas.append(req.take_output().text)
    return deltas, req


@pytest.mark.parametrize("decoder", SENTENCEPIECE_DECODERS)
@pytest.mark.parametrize("prompt, completion", [("The quick brown fox", " jumps over the lazy dog"),
                                                ("Pack my box", " with five dozen liquor jugs.")])
def test_the_first_token_keeps_its_leading_space_after_the_prompt(tmp_path, decoder, prompt, completion):
    # Decoded alone, "▁jumps" is "jumps": the completion read "The quick brown foxjumps".
    tok = sentencepiece_tokenizer(tmp_path, decoder)
    prompt_ids = tok.encode(prompt)
    full = tok.encode(prompt + completion)
    assert full[:len(prompt_ids)] == prompt_ids
    deltas, _ = stream(tok, prompt_ids, full[len(prompt_ids):])
    assert "".join(deltas) == completion


@pytest.mark.parametrize("text", ["héllo 中文 😀 wörld", "日本語のテキスト", "😀😀 a😀"])
def test_characters_split_over_tokens_are_never_sent_in_pieces(tmp_path, text):
    build_tokenizer(tmp_path, vocab_size=320)  # byte-level BPE: these characters are 2-4 tokens each
    tok = Tokenizer(tmp_path)
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)
    deltas, _ = stream(tok, tok.encode("Say:"), ids)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    for stop in ("中文", "😀 a", "ö"):  # stop strings of split characters, never sent in part
        if stop in text:
            deltas, req = stream(tok, tok.encode("Say:"), ids, [stop])
            assert "".join(deltas) == text[:text.index(stop)] and req.finish_reason == "stop"
            assert not any("\ufffd" in d for d in deltas)


def test_the_stop_hold_back_is_the_longest_stop_prefix_ending_the_text():
    """What streaming holds back while it could still become a stop string: the longest
    prefix s[:n] (n < len(s)) of any stop string that ends the text, against every prefix
    compared, on random texts and stops, the text growing by random pieces as it does
    between steps (the matchers read only what is new)."""
    import random

    def every_prefix(text: str, stops: list[str]) -> int:
        return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
                   default=0)

    rng = random.Random(7)
    for _ in range(600):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randrange(1, 9))) for _ in range(rng.randrange(1, 4))]
        req = Request("r", [1], SamplingParams(stop=stops), None, 0)
        text = ""
        for _ in range(rng.randrange(1, 8)):
            text += "".join(rng.choice("ab c") for _ in range(rng.randrange(0, 5)))
            assert req._holdback(text) == every_prefix(text, stops), (text, stops)
    # A repetitive stop string, the text growing past it: the longest proper prefix stays held.
    req = Request("r", [1], SamplingParams(stop=["a" * 255 + "b"]), None, 0)
    text = ""
    for _ in range(100):
        text += "aaaa"
        assert req._holdback(text) == min(len(text), 255)


@pytest.mark.parametrize("kind", ["byte-level", "llama-2"])
def test_special_tokens_add_no_text_and_do_not_grow_the_window(tmp_path, kind):
    """A run of special tokens (EOS after EOS, as a benchmark's ignore_eos gets) adds no text,
    wherever it stands, and stays out of the detokenizer's window: the window used to grow
    with every one, each step decoding the whole run again."""
    if kind == "byte-level":
        build_tokenizer(tmp_path, vocab_size=320)
        tok = Tokenizer(tmp_path)
    else:
        tok = sentencepiece_tokenizer(tmp_path, kind)
    eos = tok.eos_token_id
    assert eos in tok.special_ids
    prompt = tok.encode("The quick brown fox")
    words = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)[-6:]
    plain, _ = stream(tok, prompt, words)
    mixed = [eos] * 3 + words[:2] + [eos] * 500 + words[2:] + [eos] * 50
    deltas, req = stream(tok, prompt, mixed)
    assert "".join(deltas) == "".join(plain) and "".join(plain).strip()
    assert len(req.detok.ids) <= 5 + len(words)  # the prompt's context and the words, no EOS
