"""Base checkpoints of every promised shape, made by transformers itself, give the logits
transformers gives (CPU, float32); checkpoints this engine cannot run are refused at load
with the reason, never served wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.server.config import ModelConfig
from loraplex.server.kv_cache import KVCache
from loraplex.server.model import LlamaModel, PrefillSeq
from loraplex.server.weights import check_checkpoint, load_weights

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.08, bos_token_id=1, eos_token_id=2)


def make_checkpoint(path: Path, model_type: str, arch: str = "AutoModelForCausalLM", **config) -> Path:
    """A random checkpoint of transformers' own making; every bias random (HF zero-inits them)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **(SHAPE | config))
    torch.manual_seed(0)
    cls = getattr(transformers, arch)
    model = cls.from_config(cfg, dtype=torch.float32) if arch.startswith("Auto") else cls(cfg)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def last_logits(path: Path, n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') float32 logits of a random prompt's last token."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_dir(path)
    weights = load_weights(path, cfg, torch.device("cpu"), torch.float32)
    model = LlamaModel(cfg, weights, KVCache(cfg, 1, 64, torch.device("cpu"), torch.float32), None, "torch")
    ids = torch.randint(3, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(1))
    ours = model.prefill(ids, torch.full((n,), -1, dtype=torch.int32), [PrefillSeq(0, 0, n)], max_adapters=0)[0]
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0, -1]
    return ours, hf


def test_llama_with_attention_bias_matches_transformers(tmp_path):
    """Llama's attention_bias=true puts a bias on o_proj as well as on q/k/v."""
    path = make_checkpoint(tmp_path / "m", "llama", attention_bias=True)
    ours, hf = last_logits(path)
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)


def test_a_checkpoint_of_another_head_is_refused(tmp_path):
    """A sequence classifier has `score.weight` where the LM head would be: served, its
    embeddings stood in for lm_head and every completion was noise."""
    from loraplex.server.config import ModelConfigError

    path = make_checkpoint(tmp_path / "m", "llama", arch="LlamaForSequenceClassification")
    with pytest.raises(ModelConfigError, match="LlamaForSequenceClassification"):
        ModelConfig.from_dir(path)


def rewrite(path: Path, drop: tuple[str, ...] = (), add: dict | None = None) -> Path:
    """The checkpoint's model.safetensors less `drop`, plus `add`."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = {k: v for k, v in load_file(f).items() if k not in drop} | (add or {})
    save_file(tensors, f, metadata={"format": "pt"})
    return path


def refusals(path: Path) -> tuple[str, str]:
    """The messages of the CLI's check before a server starts, and of load_weights."""
    from loraplex.server.engine import check_settings
    from loraplex.server.settings import ServerSettings

    with pytest.raises(ValueError) as checked:
        check_settings(ServerSettings(model=str(path), device="cpu"))
    with pytest.raises(ValueError) as loaded:
        load_weights(path, ModelConfig.from_dir(path), torch.device("cpu"), torch.float32)
    return str(checked.value), str(loaded.value)


def test_a_tensor_the_model_would_not_use_is_refused_by_name(tmp_path):
    """An extra weight (here an MLP bias) changes what the checkpoint computes: leaving it
    out silently served other outputs than transformers'."""
    path = rewrite(make_checkpoint(tmp_path / "m", "llama"), add={"model.layers.1.mlp.down_proj.bias": torch.ones(64)})
    for message in refusals(path):
        assert "model.layers.1.mlp.down_proj.bias" in message


def test_a_missing_tensor_is_refused_by_name_before_the_server_starts(tmp_path):
    """The CLI's check read the headers only: the server started, then died loading the
    weights with a KeyError traceback."""
    path = rewrite(make_checkpoint(tmp_path / "m", "llama"), drop=("model.layers.1.mlp.up_proj.weight",))
    for message in refusals(path):
        assert "model.layers.1.mlp.up_proj.weight" in message


def test_untied_embeddings_without_an_lm_head_are_refused(tmp_path):
    """tie_word_embeddings=false and no lm_head.weight: the input embeddings were taken for
    the LM head (transformers would make a random one); neither is the model."""
    path = rewrite(make_checkpoint(tmp_path / "m", "llama", tie_word_embeddings=False), drop=("lm_head.weight",))
    for message in refusals(path):
        assert "lm_head.weight" in message


def test_a_tensor_of_the_wrong_shape_is_refused_by_name_before_the_server_starts(tmp_path):
    path = rewrite(make_checkpoint(tmp_path / "m", "llama"),
                   add={"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})
    for message in refusals(path):
        assert "k_proj" in message and "(16, 64)" in message


@pytest.mark.parametrize("head", ["the embeddings", "another"])
def test_tied_checkpoints_may_carry_an_lm_head_and_old_rotary_buffers(tmp_path, head):
    """transformers ignores the inv_freq buffers older Llama checkpoints saved, and reads a
    tied checkpoint's lm_head.weight only where it differs from the embeddings: then it
    does not tie them ("both are present in the checkpoints with different values")."""
    path = make_checkpoint(tmp_path / "m", "llama", tie_word_embeddings=True)
    from safetensors.torch import load_file

    embed = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    lm_head = embed.clone() if head == "the embeddings" else torch.randn(embed.shape)
    rewrite(path, add={"lm_head.weight": lm_head, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    ours, hf = last_logits(path)
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)


def test_a_sharded_checkpoint_reads_the_files_its_index_names(tmp_path):
    """Mistral's repositories hold consolidated.safetensors (mistral's own tensor names)
    beside the HF shards and their model.safetensors.index.json; transformers reads the
    index's files only, and so must we (its tensors are no extra ones)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mistral", **(SHAPE | dict(sliding_window=None)))
    torch.manual_seed(0)
    path = tmp_path / "m"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("model-*.safetensors"))) > 2
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64), "tok_embeddings.weight": torch.zeros(320, 64)},
              path / "consolidated.safetensors")
    check_checkpoint(path)
    ours, hf = last_logits(path)
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type, config", [
    ("llama", dict(attention_bias=True, tie_word_embeddings=True)),
    ("qwen2", dict(head_dim=32, tie_word_embeddings=False)),
    ("mistral", dict(head_dim=8, sliding_window=None, rope_theta=1e6)),
])
def test_greedy_generation_matches_transformers(tmp_path, model_type, config):
    """Prefill and decode steps of the engine (bfloat16 on disk, float32 served) against
    transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from loraplex.server.engine import LLMEngine
    from loraplex.server.sampling import SamplingParams
    from loraplex.server.settings import ServerSettings

    made = make_checkpoint(tmp_path / "m", model_type, **config)
    path = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(made, dtype=torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    assert not (path / "model.safetensors").exists() and (path / "model.safetensors.index.json").is_file()
    engine = LLMEngine.from_settings(ServerSettings(model=str(path), device="cpu", dtype="float32", max_num_seqs=2,
                                                    max_model_len=64, max_loras=1, max_lora_rank=8))
    prompt = [1, 17, 99, 250, 7, 64, 3]
    req = engine.make_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), None)
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, len(prompt):]
    assert req.output_ids == want.tolist()


@pytest.mark.parametrize("top_level", [None, 128])
def test_llama3_scaling_without_original_max_position_embeddings_falls_back_as_in_transformers(tmp_path, top_level):
    """transformers takes a top-level original_max_position_embeddings first, then the
    scaling's own, then max_position_embeddings."""
    import json

    path = make_checkpoint(tmp_path / "m", "llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    cfg = json.loads((path / "config.json").read_text())
    scaling = cfg.get("rope_parameters") or cfg["rope_scaling"]
    if top_level is None:
        del scaling["original_max_position_embeddings"]
    else:
        cfg["original_max_position_embeddings"] = top_level
    (path / "config.json").write_text(json.dumps(cfg))
    ours, hf = last_logits(path, n=40)
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 4.0},
                                     {"type": "linear", "factor": 3}])
def test_linear_and_dynamic_rope_scaling_match_transformers(tmp_path, scaling):
    """Linear scaling divides the frequencies by its factor; dynamic NTK scaling changes them
    only past max_position_embeddings, where the engine never goes (older transformers
    configs write "type" for "rope_type")."""
    import json

    path = make_checkpoint(tmp_path / "m", "llama", rope_theta=10000.0)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = scaling
    (path / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(path).rope_scaling["rope_type"] == scaling.get("rope_type", scaling.get("type"))
    ours, hf = last_logits(path, n=48)
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 0.5}, {"rope_type": "dynamic"},
                                     {"rope_type": "yarn", "factor": 4.0}])
def test_rope_scaling_that_cannot_be_served_as_transformers_does_is_refused(tmp_path, scaling):
    import json

    from loraplex.server.config import ModelConfigError

    path = make_checkpoint(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = scaling
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="rope scaling"):
        ModelConfig.from_dir(path)
