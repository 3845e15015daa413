"""`loraplex-server --demo`: a tiny random base, a tokenizer and PEFT adapters, made on the spot.

Nothing is downloaded. The folder (by default ~/.cache/loraplex/demo) holds::

    base/           config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    adapters/NAME/  adapter_config.json, adapter_model.safetensors (PEFT's layout and keys)

The tokenizer is a byte-level BPE trained with the `tokenizers` library on a few
paragraphs below; the adapters are random (non-zero A and B) with different ranks, alphas
and target modules, one of them rsLoRA. A random model writes gibberish: the demo shows the
serving path (many adapters in one batch, streaming, the OpenAI API), not a language model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .adapter_format import peft_key, write_adapter_config
from .config import ModelConfig, named_shape

log = logging.getLogger(__name__)

# Adapters of the demo: name -> (r, lora_alpha, target modules, use_rslora)
DEMO_ADAPTERS = {
    "sql-expert": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "poet": (16, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "pirate": (4, 8, ["gate_proj", "up_proj", "down_proj"], False),
}

_CORPUS = """\
loraplex serves many LoRA adapters of one base model from one copy of the base weights.
Every request names an adapter, or the base model itself, and the rows of one batch use
different adapters in the same forward pass. The base matrix multiply runs once for all
rows; a small kernel adds each row's own low-rank term. Adapters that are used rarely wait
in host memory or on local disk and are copied to the GPU when a request needs them.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
SELECT name, count(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;
Shall I compare thee to a summer's day? Thou art more lovely and more temperate.
Ahoy matey, hoist the colours and batten down the hatches, there be weather ahead!
user: hello! assistant: hi, how can I help you today? system: you are a helpful assistant.
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def default_demo_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "loraplex" / "demo"


def build_tokenizer(path: str | Path, vocab_size: int, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Train a byte-level BPE tokenizer on the demo corpus; write tokenizer.json and
    tokenizer_config.json into `path`. Ids 0, 1, 2 are <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "add_bos_token": False, "model_max_length": 2048}
    if chat_template:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def write_random_adapter(path: str | Path, cfg: ModelConfig, *, r: int, lora_alpha: float,
                         target_modules: list[str], use_rslora: bool = False, seed: int = 0,
                         rank_pattern: dict | None = None) -> None:
    """A random PEFT LoRA adapter for `cfg` (non-zero A and B), in PEFT's files and keys."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = cfg.module_shapes()
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj in target_modules:
            rank = (rank_pattern or {}).get(proj, r)
            in_f, out_f = shapes[proj]
            # nn.Linear's default init scale for both (as peft with init_lora_weights=False).
            tensors[peft_key(layer, proj, "A")] = (torch.rand(rank, in_f, generator=gen) * 2 - 1) / in_f ** 0.5
            tensors[peft_key(layer, proj, "B")] = (torch.rand(out_f, rank, generator=gen) * 2 - 1) / rank ** 0.5
    write_adapter_config(path, r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                         use_rslora=use_rslora, rank_pattern=rank_pattern, base_model_name_or_path="loraplex-demo")
    save_file(tensors, str(Path(path) / "adapter_model.safetensors"), metadata={"format": "pt"})


def build_demo(root: str | Path, shape: str = "tiny", seed: int = 0) -> tuple[Path, dict[str, Path]]:
    """Write the demo base and adapters under `root` (kept if already there). Returns
    (base dir, {adapter name: dir})."""
    import torch

    from .weights import dummy_weights, save_hf_checkpoint

    root = Path(root)
    base = root / "base"
    adapters = {name: root / "adapters" / name for name in DEMO_ADAPTERS}
    done = root / ".complete"
    if done.is_file():
        return base, adapters
    cfg = named_shape(shape)
    build_tokenizer(base, cfg.vocab_size)
    (base / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    weights = dummy_weights(cfg, torch.device("cpu"), torch.float32, seed=seed, std=0.1)
    save_hf_checkpoint(weights, cfg, base)
    for i, (name, (r, alpha, targets, rslora)) in enumerate(DEMO_ADAPTERS.items()):
        write_random_adapter(adapters[name], cfg, r=r, lora_alpha=alpha, target_modules=targets,
                             use_rslora=rslora, seed=seed + 1 + i)
    done.write_text("ok\n")
    log.info("demo model and adapters written to %s", root)
    return base, adapters
