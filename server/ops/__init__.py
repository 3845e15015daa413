"""loraplex.server.ops: Triton kernels for the small ops of a decode step (CUDA path).

One decoder layer of `LlamaModel.decode` with these ops, B rows, hidden H, heads n, kv heads
m, head dim d, MLP width I (LoRA terms added in `_linear`, unchanged)::

    h      [B, H]                  = rms_norm(x, input_norm)        (first layer; then from add_rms_norm)
    qkv    [B, (n+2m)*d]           = h @ Wqkv^T            + add_lora
    q      [B, n, d]               = rope_and_cache_write(qkv, cos, sin, k[i], v[i], rows, positions, 1/sqrt(d))
                                     (also writes k, v at [row, :, position])
    attn   [B, n, d]               = decode_attention(q, k[i], v[i], positions, kv_len)
    x, h   [B, H], [B, H]          = add_rms_norm(x, attn @ Wo^T + add_lora, post_norm)
    act    [B, I]                  = silu_mul(h @ Wgate_up^T + add_lora)
    x, h   [B, H], [B, H]          = add_rms_norm(x, act @ Wdown^T + add_lora, next layer's input_norm
                                                                              or the final norm)

A prefill step's attention is one launch per layer for all its prompts, each against its
KV row (whole prompts, later chunks, prompts after a cached prefix): `prefill_attention`
with the step's `PrefillPlan`, after one K/V write per layer.

Each op has a torch reference in `reference.py`. The launchers check shapes, dtypes and
devices and run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from .attention import decode_attention
from .norm import add_rms_norm, rms_norm
from .prefill_attention import PrefillPlan, prefill_attention
from .rope import rope_and_cache_write
from .silu_mul import silu_mul

__all__ = ["PrefillPlan", "add_rms_norm", "decode_attention", "prefill_attention", "rms_norm", "rope_and_cache_write",
           "silu_mul"]
