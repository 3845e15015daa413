"""A base's tokenizer files read as transformers reads them."""

from __future__ import annotations

from loraplex.server.demo import build_tokenizer
from loraplex.server.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def hf_chat_ids(path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path).apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    """transformers: "independent chat template file(s) take priority over template entries in
    the tokenizer config". A fine-tune that ships its own chat_template.jinja beside the base's
    tokenizer_config.json was prompted in the base's format."""
    build_tokenizer(tmp_path, vocab_size=320)  # tokenizer_config.json with the demo's template
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template(MESSAGES) == hf_chat_ids(tmp_path)
    assert tok.decode(tok.apply_chat_template(MESSAGES)).startswith("[system] be brief")


def test_an_unreadable_tokenizer_is_refused_before_the_server_starts(tmp_path):
    """The CLI's check passed a tokenizer.json cut short (or a tokenizer_config.json that is
    not JSON): the server then died in its lifespan with the tokenizers library's traceback."""
    import pytest

    from loraplex.server.engine import check_settings
    from loraplex.server.settings import ServerSettings

    from .test_model_checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "m", "llama")
    build_tokenizer(path, vocab_size=320)
    whole = (path / "tokenizer.json").read_text()
    (path / "tokenizer.json").write_text(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="tokenizer.json"):
        check_settings(ServerSettings(model=str(path), device="cpu"))
    (path / "tokenizer.json").write_text(whole)
    (path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        check_settings(ServerSettings(model=str(path), device="cpu"))


def test_special_tokens_of_a_legacy_special_tokens_map_are_read(tmp_path):
    """Older tokenizers keep bos/eos in special_tokens_map.json, not in tokenizer_config.json
    (transformers reads it for a config without added_tokens_decoder): the EOS that ends a
    generation was unknown, and the chat template's {{ bos_token }} rendered empty."""
    import json

    from transformers import AutoTokenizer

    build_tokenizer(tmp_path, vocab_size=320)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["bos_token"], cfg["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False, "normalized": False,
                                           "rstrip": False, "single_word": False}}))
    tok, hf = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert tok.apply_chat_template(MESSAGES) == hf_chat_ids(tmp_path)
