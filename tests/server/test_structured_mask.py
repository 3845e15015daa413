"""What a structured output's grammar stands on, apart from the grammar engine: each token's
bytes as the grammar matches them (`Tokenizer.vocabulary_bytes`), and the sampler's mask
(`structured.mask_logits`), on the CPU and on CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.server.structured import Grammars, GrammarSpec, GrammarState, available, mask_logits
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


def _metaspace_tokenizer(path, added=()):
    """A SentencePiece-style tokenizer.json whose pre-tokenizer and decoder are Metaspace
    (no Replace, no byte pieces), with `added` as added tokens that are not special."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    pieces = ["\u2581", *"helowrd", "\u2581h", "\u2581he", "ll", "\u2581hell", "\u2581hello", "\u2581w", "\u2581wo",
              "\u2581wor", "\u2581worl", "\u2581world"]
    vocab.update((piece, 3 + i) for i, piece in enumerate(pieces))
    merges = [("\u2581", "h"), ("\u2581h", "e"), ("l", "l"), ("\u2581he", "ll"), ("\u2581hell", "o"), ("\u2581", "w"),
              ("\u2581w", "o"), ("\u2581wo", "r"), ("\u2581wor", "l"), ("\u2581worl", "d")]
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.add_tokens([AddedToken(a, normalized=False) for a in added])
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(path)


def test_metaspace_tokens_have_their_spaces(tmp_path):
    """A Metaspace decoder (no Replace) writes "\u2581" as a space too, and drops the first
    token's only: inside an output, each piece is its text with the space."""
    tok = _metaspace_tokenizer(tmp_path)
    vocab = tok.vocabulary_bytes()
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "\u2581world"]
    assert b"".join(vocab[i] for i in ids) == b" hello world"
    assert tok.decode(ids + ids) == "hello world" + b"".join(vocab[i] for i in ids).decode()


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_added_tokens_are_the_text_the_decoder_writes_for_them(hf_llama, tmp_path, kind):
    """An added token that is not special goes through the decoder as a piece does: "\u0120zz"
    is " zz" under ByteLevel, "\u2581y" is " y" under Metaspace. The grammar matched their
    content instead ("[^ ]+" let " zz" through)."""
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    if kind == "byte_level":
        hf = HFTokenizer.from_file(str(hf_llama / "tokenizer.json"))
        hf.add_tokens([AddedToken("\u0120zz", normalized=False), AddedToken("<tool>", normalized=False)])
        hf.save(str(tmp_path / "tokenizer.json"))
        shutil.copy(hf_llama / "tokenizer_config.json", tmp_path)
        tok, added, text = Tokenizer(tmp_path), ["\u0120zz", "<tool>"], "The"
    else:
        tok, added, text = _metaspace_tokenizer(tmp_path, ["\u2581y", "<tool>"]), ["\u2581y", "<tool>"], "hello"
    vocab = tok.vocabulary_bytes()
    around = tok.encode(text, add_special_tokens=False)
    for content in added:
        ids = around + [tok._tok.token_to_id(content)] + around
        assert tok.decode(ids).encode() == tok.decode(around).encode() + b"".join(vocab[i] for i in ids[len(around):])


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


@pytest.mark.skipif(not available(), reason="xgrammar is not installed")
def test_ids_past_the_tokenizers_vocabulary_are_never_allowed(hf_llama):
    """A model's logits may be wider than its tokenizer's vocabulary (padded to a multiple of
    64, say): the grammar pads it with tokens it never allows, whatever their logits."""
    tok = Tokenizer(hf_llama)
    width = tok.vocab_size + 40
    grammars = Grammars(tok, width, (tok.eos_token_id,))
    state = GrammarState(grammars.compile(GrammarSpec("regex", "[^x]*", "guided_regex")), (tok.eos_token_id,))
    assert state.allowed().shape == (width,) and state.allowed()[:tok.vocab_size].any()
    assert not state.allowed()[tok.vocab_size:].any()
    logits = torch.zeros(2, width)
    logits[:, tok.vocab_size:] = 100.0
    out = mask_logits(logits, [1], [state], fallback=logits)
    assert torch.isneginf(out[1, tok.vocab_size:]).all() and out[1].argmax() < tok.vocab_size
    assert torch.equal(out[0], logits[0])
