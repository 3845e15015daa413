"""config.json values this engine cannot serve as written are refused when the config is
read (the CLI's check before a server starts), naming the value."""

from __future__ import annotations

import pytest

from loraplex.server.config import ModelConfig, ModelConfigError

BASE = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4)


@pytest.mark.parametrize("missing", ["factor", "low_freq_factor", "high_freq_factor"])
def test_llama3_rope_scaling_without_one_of_its_values_is_refused_by_name(missing):
    """The server started and died building its RoPE tables with a bare KeyError."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    del scaling[missing]
    with pytest.raises(ModelConfigError, match=missing):
        ModelConfig.from_hf(BASE | {"rope_scaling": scaling})


@pytest.mark.parametrize("text, reason", [
    ('{"model_type": "llama", "hidden_size": 64}', "vocab_size"),
    ('{"model_type": "llama",', "config.json"),
])
def test_a_config_json_short_of_a_value_or_unparsable_is_refused_by_the_cli(tmp_path, capsys, text, reason):
    """A config.json without one of the shape's values left the CLI with a KeyError traceback."""
    from loraplex.server.cli import main

    (tmp_path / "config.json").write_text(text)
    assert main(["--model", str(tmp_path), "--device", "cpu"]) == 2
    assert reason in capsys.readouterr().err


@pytest.mark.parametrize("quant", [{"quant_method": "fp8", "activation_scheme": "dynamic"},
                                   {"quant_method": "gptq", "bits": 4, "group_size": 128},
                                   {"quant_method": "bitsandbytes", "load_in_4bit": True}])
def test_a_quantized_checkpoint_is_refused_naming_its_method(quant):
    """An FP8 checkpoint's float8 weights were cast to the serving dtype without their scales:
    served, every answer noise."""
    with pytest.raises(ModelConfigError, match=quant["quant_method"]):
        ModelConfig.from_hf(BASE | {"quantization_config": quant})


def test_mistral_sliding_window_caps_the_context_with_a_warning(caplog):
    """Served as full attention, which equals sliding-window attention only up to the
    window: the context is capped there, and the log says so (it said nothing, and a
    --max-model-len 32768 server refused 5000-token prompts with no word why at start)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="loraplex.server.config"):
        cfg = ModelConfig.from_hf(BASE | {"model_type": "mistral", "max_position_embeddings": 32768,
                                          "sliding_window": 4096})
    assert cfg.max_position_embeddings == 4096
    assert "sliding_window" in caplog.text and "4096" in caplog.text


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_values_a_config_json_leaves_out_take_transformers_defaults(model_type):
    """A config.json written by hand (or trimmed) without rms_norm_eps was served with eps
    1e-5 where transformers uses 1e-6; a Mistral one without sliding_window with full
    attention past transformers' default window of 4096, its context that of no model."""
    from transformers import AutoConfig

    given = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    hf = AutoConfig.for_model(model_type, **given)
    ours = ModelConfig.from_hf(given | {"model_type": model_type})
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    window = getattr(hf, "sliding_window", None) if model_type == "mistral" else None
    assert ours.max_position_embeddings == min(hf.max_position_embeddings, window or hf.max_position_embeddings)


@pytest.mark.parametrize("name", ["tiny", "small", "llama-3-8b", "llama-2-7b", "mistral-7b", "qwen2-7b"])
def test_every_named_shape_round_trips_through_its_config_json(name):
    """The demo and the benchmarks write named shapes as config.json (to_hf)."""
    from loraplex.server.config import named_shape

    assert ModelConfig.from_hf(named_shape(name).to_hf()) == named_shape(name)
