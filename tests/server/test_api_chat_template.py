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


OPTIONS_TEMPLATE = (
    "{{ bos_token }}{% if documents %}{% for d in documents %}<|doc|>{{ d['title'] }}: {{ d['text'] }}<|end|>\n"
    "{% endfor %}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}")
TRIMMING_TEMPLATE = (  # strips each content: a final message's trailing spaces do not survive
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONTINUED = [{"role": "user", "content": "write a haiku"}, {"role": "assistant", "content": "Autumn moon, "}]


@pytest.mark.parametrize("template", [OPTIONS_TEMPLATE, TRIMMING_TEMPLATE, *TEMPLATES.values()])
@pytest.mark.parametrize("options", [
    dict(add_generation_prompt=False),
    dict(add_generation_prompt=False, continue_final_message=True),
    dict(template_kwargs={"enable_thinking": False}),
    dict(template_kwargs={"enable_thinking": True, "bos_token": "<|start|>"}),
    dict(documents=[{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]),
])
def test_prompt_options_render_as_transformers_renders_them(tmp_path, template, options):
    """vLLM's chat fields (add_generation_prompt, continue_final_message, chat_template_kwargs,
    documents) reach the template as transformers passes them: the prompt vLLM would send."""
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path, vocab_size=320, chat_template=template)
    messages = CONTINUED if options.get("continue_final_message") else MESSAGES
    hf = AutoTokenizer.from_pretrained(tmp_path)
    kwargs = dict(options)
    kwargs.update(kwargs.pop("template_kwargs", {}))
    try:
        want = hf.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kwargs})
    except ValueError:  # the loop-controls template stops at the last user turn: nothing to continue
        with pytest.raises(ValueError, match="continue_final_message"):
            Tokenizer(tmp_path).apply_chat_template(messages, **options)
        return
    ours = Tokenizer(tmp_path).apply_chat_template(messages, **options)
    assert hf.decode(ours) == want
    if options.get("continue_final_message"):
        assert want.rstrip().endswith("Autumn moon,")


def test_continue_final_message_and_the_generation_prompt_exclude_each_other(tmp_path):
    build_tokenizer(tmp_path, vocab_size=320, chat_template=OPTIONS_TEMPLATE)
    with pytest.raises(ValueError, match="cannot both be true"):
        Tokenizer(tmp_path).apply_chat_template(CONTINUED, continue_final_message=True)
