"""What a structured output's grammar stands on, apart from the grammar engine: each token's
bytes as the grammar matches them (`Tokenizer.vocabulary_bytes`), and the sampler's mask
(`structured.mask_logits`), on the CPU and on CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.server.structured import mask_logits
from loraplex.server.tokenizer import Tokenizer

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


# -- the vocabulary a grammar matches ----------------------------------------------------------


def test_byte_level_tokens_are_their_bytes(hf_llama):
    tok = Tokenizer(hf_llama)
    vocab = tok.vocabulary_bytes()
    assert len(vocab) == tok.vocab_size
    assert all(vocab[i] is None for i in tok.special_ids)
    text = 'The {"fox": [1, 2.5]} jumps over the lazy dog, naïvely. ✓'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids) == text.encode()


def test_sentencepiece_tokens_have_their_spaces_and_byte_pieces(tmp_path):
    """A Llama-2 style tokenizer.json: "▁" for a space, <0xNN> pieces for bytes not in the
    vocabulary, a decoder that drops the first token's leading space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "\u2581he", "ll", "\u2581hell",
                  "\u2581hello", "\u2581w", "\u2581wo"):
        vocab[piece] = len(vocab)
    merges = [("\u2581", "h"), ("\u2581h", "e"), ("l", "l"), ("\u2581he", "ll"), ("\u2581hell", "o"),
              ("\u2581", "w"), ("\u2581w", "o")]
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer(tmp_path)
    vocab_bytes = tok.vocabulary_bytes()
    text = "hello world é"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # é went through byte pieces
    # The pieces hold the space the normalizer put before the text; decoding drops it.
    assert b"".join(vocab_bytes[i] for i in ids) == (" " + text).encode()
    assert tok.decode(ids) == text
    assert vocab_bytes[vocab["\u2581hello"]] == b" hello" and vocab_bytes[vocab["<0xC3>"]] == b"\xc3"


# -- the sampler's mask ------------------------------------------------------------------------


class Allow:
    """A grammar state that allows a fixed set of tokens."""

    def __init__(self, tokens):
        self.tokens = tokens

    def fill(self, bitmask, index):
        bitmask[index] = 0
        for t in self.tokens:
            bitmask[index, t // 32] |= 1 << (t % 32) if t % 32 != 31 else -(1 << 31)


@pytest.mark.parametrize("device", DEVICES)
def test_the_mask_keeps_each_rows_allowed_tokens_and_falls_back_to_the_grammar_alone(device):
    vocab = 70  # three words of the bitmask, the last partly past the vocabulary
    logits = torch.randn(3, vocab, device=device)
    before = logits.clone()
    banned = logits.clone()
    banned[2, [5, 63]] = float("-inf")  # row 2's own masks took every token its grammar allows
    out = mask_logits(banned, [0, 2], [Allow([31, 69]), Allow([5, 63])], fallback=logits)
    assert torch.equal(logits, before)  # inputs untouched
    assert torch.equal(out[1], banned[1])  # a row without a grammar as it was
    assert out.device == logits.device
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [31, 69]
    assert torch.equal(out[0, [31, 69]], logits[0, [31, 69]])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [5, 63]
    assert torch.equal(out[2, [5, 63]], logits[2, [5, 63]])
