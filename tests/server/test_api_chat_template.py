"""Chat templates render as transformers renders them (the environment vLLM's chat endpoint
uses): with loop controls ({% break %}, {% continue %}), the {% generation %} block that
fine-tuning templates mark assistant turns with (it renders its body), and a `tojson` that
keeps the text as it is (Jinja's own escapes "<" and non-ASCII characters). Without them a
template that uses one failed on every chat request, or the prompt differed from vLLM's."""

from __future__ import annotations

import pytest

from loraplex.server.demo import build_tokenizer
from loraplex.server.tokenizer import Tokenizer

TEMPLATES = {
    "loop-controls": (
        "{{ bos_token }}{%- set ns = namespace(last=0) %}"
        "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{%- continue %}{%- endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
        "{%- if loop.index0 == ns.last %}{%- break %}{%- endif %}{%- endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
    "generation-block": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}\n"
        "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
    "tojson": (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | tojson }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo <b>wörld</b> & 'you'"},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "again, 日本"},
            {"role": "tool", "content": "{\"x\": 1}"}]


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_template_renders_as_transformers_renders_it(tmp_path, name):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path, vocab_size=320, chat_template=TEMPLATES[name])
    ours = Tokenizer(tmp_path).apply_chat_template(MESSAGES)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert hf.decode(ours) == want
    assert ours == hf(want, add_special_tokens=False)["input_ids"]
