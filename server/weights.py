"""Base weights: read from HF safetensors (q/k/v and gate/up fused on load) or random.

Layout (nn.Linear style, [out_features, in_features]; `y = x @ W.T`):

    embed      [vocab, hidden]
    layer i:   input_norm [hidden], qkv [q + 2*kv, hidden] (+ qkv_bias [q + 2*kv] on Qwen2),
               o [hidden, q] (+ o_bias [hidden] on Llama with attention_bias), post_norm [hidden],
               gate_up [2*inter, hidden], down [hidden, inter]
    norm       [hidden]
    lm_head    [vocab, hidden]   (the same tensor as embed when embeddings are tied)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    o_bias: torch.Tensor | None = None


@dataclass
class BaseWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor

    def nbytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.embed, self.norm, self.lm_head]
        for lw in self.layers:
            tensors += [t for t in vars(lw).values() if t is not None]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, chosen as transformers chooses them:
    model.safetensors; else the shards model.safetensors.index.json names (a Mistral
    repository's consolidated.safetensors, mistral's own layout, lies beside them unread);
    else every *.safetensors file."""
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names {f.name}, which is not there")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


class _Shards:
    """Tensor lookup over the safetensors files of a checkpoint directory (checkpoint_files)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = checkpoint_files(path)
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def has(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, from its file's header (nothing is read)."""
        return tuple(self._where[key].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._where[key].get_tensor(key)
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {key!r}") from None


# Tensors that transformers, too, leaves unread: the RoPE buffers older Llama checkpoints saved.
_UNUSED_SUFFIXES = (".rotary_emb.inv_freq",)


def checkpoint_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor an HF checkpoint of `cfg` must hold (lm_head.weight only
    when the embeddings are untied)."""
    h, q, kv, inter, vocab = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (vocab, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,)}
        if cfg.qkv_bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
    return out


def _check_tensors(shards: _Shards, cfg: ModelConfig, path: str | Path) -> None:
    """ValueError, naming the tensor, unless the checkpoint holds exactly the tensors of
    cfg's shape: one missing cannot be served, one more (a bias, another head) means the
    checkpoint computes something this model would not."""
    want = checkpoint_tensors(cfg)

    def more(names: list[str]) -> str:
        return f" (and {len(names) - 1} more)" if len(names) > 1 else ""

    missing = [k for k in want if not shards.has(k)]
    if missing:
        raise ValueError(f"{path}: the checkpoint has no tensor {missing[0]!r}{more(missing)}, "
                         f"which its config.json's {cfg.model_type} shape needs")
    extra = [k for k in shards.keys() if k not in want and not k.endswith(_UNUSED_SUFFIXES)
             and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if extra:
        raise ValueError(f"{path}: the checkpoint's tensor {extra[0]!r}{more(extra)} is not part of a "
                         f"{cfg.model_type} model as its config.json describes it; not served without it")
    if cfg.tie_word_embeddings and shards.has("lm_head.weight"):  # read where it differs (load_weights)
        want = want | {"lm_head.weight": want["model.embed_tokens.weight"]}
    for k, shape in want.items():
        if shards.shape(k) != shape:
            raise ValueError(f"{path}: tensor {k!r} has shape {shards.shape(k)}, config.json says {shape}")


def check_checkpoint(path: str | Path, cfg: ModelConfig | None = None) -> None:
    """ValueError unless `path` holds safetensors files whose headers read and list exactly
    the tensors of its config (`cfg`, or its config.json), each of its shape. No tensor is
    read: the CLI's check before a server starts."""
    try:
        shards = _Shards(Path(path))
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # a header safetensors cannot parse, a file cut short
        raise ValueError(f"{path}: unreadable checkpoint: {type(e).__name__}: {e}") from None
    _check_tensors(shards, cfg or ModelConfig.from_dir(path), path)


def load_weights(path: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> BaseWeights:
    """Read an HF Llama/Mistral/Qwen2 checkpoint, fusing q/k/v and gate/up."""
    shards = _Shards(Path(path))
    _check_tensors(shards, cfg, path)

    def get(key: str) -> torch.Tensor:
        return shards.get(key).to(device=device, dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([shards.get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).to(device, dtype)
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([shards.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]).to(device, dtype)
        gate_up = torch.cat([shards.get(p + "mlp.gate_proj.weight"), shards.get(p + "mlp.up_proj.weight")])
        layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=qkv, qkv_bias=bias,
            o=get(p + "self_attn.o_proj.weight"),
            o_bias=get(p + "self_attn.o_proj.bias") if cfg.o_bias else None,
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=gate_up.to(device, dtype),
            down=get(p + "mlp.down_proj.weight"),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    if cfg.tie_word_embeddings and shards.has("lm_head.weight"):
        # transformers (>= 5) leaves a tied checkpoint untied when its lm_head.weight differs
        # from the embeddings. Compared as stored, on the host: a head equal to the embeddings
        # costs no second copy on the device.
        if not torch.equal(shards.get("lm_head.weight"), shards.get("model.embed_tokens.weight")):
            log.warning("%s: tie_word_embeddings is true but lm_head.weight differs from the embeddings: "
                        "served untied, as transformers does", path)
            lm_head = get("lm_head.weight")
    weights = BaseWeights(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head)
    _check_shapes(weights, cfg)
    return weights


def dummy_weights(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                  std: float = 0.02) -> BaseWeights:
    """Random weights of cfg's shape, made on `device` (no host copy of an 8B model)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, device=device, dtype=dtype)
        return t.normal_(0.0, std, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    layers = [
        LayerWeights(
            input_norm=ones(h), qkv=rand(q + 2 * kv, h),
            qkv_bias=rand(q + 2 * kv) if cfg.qkv_bias else None,
            o=rand(h, q), o_bias=rand(h) if cfg.o_bias else None,
            post_norm=ones(h), gate_up=rand(2 * inter, h), down=rand(h, inter))
        for _ in range(cfg.num_layers)
    ]
    embed = rand(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else rand(cfg.vocab_size, h)
    weights = BaseWeights(embed=embed, layers=layers, norm=ones(h), lm_head=lm_head)
    _check_shapes(weights, cfg)
    return weights


def _check_shapes(w: BaseWeights, cfg: ModelConfig) -> None:
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    want = {"embed": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h), "norm": (h,)}
    for name, shape in want.items():
        if tuple(getattr(w, name).shape) != shape:
            raise ValueError(f"{name}: shape {tuple(getattr(w, name).shape)}, config says {shape}")
    layer_want = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter),
                  "input_norm": (h,), "post_norm": (h,)}
    for i, lw in enumerate(w.layers):
        for name, shape in layer_want.items():
            if tuple(getattr(lw, name).shape) != shape:
                raise ValueError(f"layer {i} {name}: shape {tuple(getattr(lw, name).shape)}, config says {shape}")


def save_hf_checkpoint(w: BaseWeights, cfg: ModelConfig, path: str | Path) -> None:
    """Write `w` as an HF checkpoint (model.safetensors with unfused names); used by the demo."""
    from safetensors.torch import save_file

    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = w.lm_head
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        qw, kw, vw = lw.qkv.split([q, kv, kv])
        out |= {p + "self_attn.q_proj.weight": qw, p + "self_attn.k_proj.weight": kw,
                p + "self_attn.v_proj.weight": vw, p + "self_attn.o_proj.weight": lw.o,
                p + "mlp.gate_proj.weight": lw.gate_up[:inter], p + "mlp.up_proj.weight": lw.gate_up[inter:],
                p + "mlp.down_proj.weight": lw.down, p + "input_layernorm.weight": lw.input_norm,
                p + "post_attention_layernorm.weight": lw.post_norm}
        if lw.qkv_bias is not None:
            qb, kb, vb = lw.qkv_bias.split([q, kv, kv])
            out |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                    p + "self_attn.v_proj.bias": vb}
        if lw.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = lw.o_bias
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in out.items()}, str(Path(path) / "model.safetensors"))
