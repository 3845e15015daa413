"""The Llama-family forward pass, with every LoRA-capable projection as `y = x @ W.T; add_lora(y, ...)`.

Two entry points, as in gpt-fast, so decode can be captured as a CUDA graph:

- `prefill(...)`: new sequences' prompts (or chunks of them, `PrefillSeq.pos`) packed into
  one [T] token vector; writes their K/V into their cache rows and returns the logits of
  each sequence's last token (and, for whole prompts that ask, the logprob of every prompt
  token: /v1/completions echo).
- `decode(...)`: one token per KV row for rows 0..B-1 (a row's batch index is its KV row);
  static shapes for a given (B, kv_len, max_adapters, lora_groups), no host synchronisation.

Both take `token_slots` (int32 [T], -1 = base only), `max_adapters`, a bound the caller
knows on the distinct adapters among them (0: base only, no LoRA work at all), and
`lora_groups`, the layer groups those adapters target (adapters.group_mask; None: all); the
LoRABatch is built from them once per call and shared by every layer (StepLoRA). q/k/v and
gate/up are one fused base GEMM and one fused `add_lora` call each (output_slices), o and
down one each; a group no adapter of the step targets has no `add_lora` call at all.

With `fused_ops` (the default on CUDA) the small ops between those GEMMs run as the Triton
kernels of server/ops: in decode RoPE + KV write, attention, residual add + RMSNorm and
silu*mul; in prefill silu*mul and the attention of every prompt of the step in one launch
(`ops.prefill_attention`, after one K/V write per layer). Without it (the CPU, and the
reference) they are torch ops, prefill attention one SDPA call per prompt.

With `triton_gemm` (the default on CUDA with the Triton backend, on GPUs with programmatic
dependent launch: Hopper and later) a step of up to
TRITON_GEMM_MAX_TOKENS rows runs each projection as `kernels.linear`: our split-K GEMM
(`gemm`), or with adapters `lora_linear`, the same GEMM with the shrink running beside it and
the expand launched under it (`gemm` then `add_lora`, the shrink's K cut in its own way).
Larger steps, and projections with a bias, keep cuBLAS then `add_lora`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from loraplex.kernels import LoRABatch, add_lora

from .adapters import GROUPS
from .config import ModelConfig
from .kv_cache import KVCache
from .sampling import TokenLogprobs, to_device
from .weights import BaseWeights


# Steps of up to this many rows run their projections as kernels.linear's GEMM: there it
# matches cuBLAS (bench/results/linear_h200_overlap.json: Llama-3-8B's four projections at
# 1, 16 and 64 rows sum to 148-156 us against cuBLAS's 151-157); past it, it loses even at
# its best configuration with tiles of 128 rows (linear_h200_grid_128.json: q/k/v at 128
# rows 28.5 against 24.0 us, gate/up 84.2 against 77.0).
TRITON_GEMM_MAX_TOKENS = 64


def _overlaps(device: torch.device) -> bool:
    """Whether kernels.linear can overlap the LoRA term with its GEMM on `device`: it needs
    programmatic dependent launch (compute capability 9.0 and later). Without it the three
    launches run in turn, and the GEMM's configurations were tuned on an H200 only: cuBLAS
    then add_lora is the default there. (LORAPLEX_PDL=0 keeps kernels.linear, launched
    plainly: a switch for measuring what PDL gives.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _triton_linear():
    """loraplex.kernels.linear, imported on first use: it imports triton (a Linux-only
    dependency), which a CPU-only model never needs."""
    from loraplex.kernels import linear

    return linear


@dataclass(frozen=True)
class StepLoRA:
    """A step's LoRA work, shared by every layer: the batch metadata built once, and the layer
    groups (adapters.GROUPS) that any of the step's adapters targets; the others' add_lora is
    not launched (an adapter that targets q and v only needs the q/k/v group alone)."""

    batch: LoRABatch
    groups: frozenset[str]


# Positions whose logits a prompt-logprobs pass holds at once: 512 rows of a 128k vocabulary
# are 256 MB in float32, where a 4k-token prompt's all at once would be 2 GB.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class PrefillSeq:
    """One prompt (or a chunk of one) inside a packed prefill: tokens[start:start+length]
    go to KV row `row` at positions pos..pos+length-1. pos > 0 is a later chunk of a
    chunked prefill: positions 0..pos-1 of the row already hold the prompt's earlier tokens.

    Running example, a 20-token prompt in chunks of 8: PrefillSeq(row, start, 8, pos=0),
    then (.., 8, pos=8), then (.., 4, pos=16); only the last one's logits are sampled."""

    row: int
    start: int
    length: int
    pos: int = 0


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], float32, computed as transformers does (its llama3,
    linear and dynamic scaling incl.)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv
    if s["rope_type"] == "linear":  # positions divided by the factor
        return inv / s["factor"]
    if s["rope_type"] == "dynamic":
        # Dynamic NTK scaling changes the frequencies only past max_position_embeddings, and the
        # engine caps every sequence there (ModelConfig.max_position_embeddings).
        return inv
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: BaseWeights, kv: KVCache, lora=None,
                 kernel_backend: str = "auto", fused_ops: bool | None = None, triton_gemm: bool | None = None):
        """`lora` is an adapters.LoRABuffers (or None for a base-only engine). `fused_ops`:
        the server/ops kernels for the small ops; `triton_gemm`: kernels.linear for the
        projections of steps up to TRITON_GEMM_MAX_TOKENS rows (None: each on CUDA devices
        only, the GEMM only with the Triton backend on devices with PDL, `_overlaps`)."""
        self.cfg = cfg
        self.w = weights
        self.kv = kv
        self.lora = lora
        self.backend = kernel_backend
        self.device = weights.embed.device
        self.fused_ops = self.device.type == "cuda" if fused_ops is None else fused_ops
        if triton_gemm is None:
            triton_gemm = self.device.type == "cuda" and kernel_backend != "torch" and _overlaps(self.device)
        self.triton_gemm = triton_gemm
        # With the fused ops, prefill attention as ops.prefill_attention (all prompts in one
        # launch per layer) rather than SDPA per prompt.
        self.prefill_kernel = True
        self.dtype = weights.embed.dtype
        self.scale = cfg.head_dim ** -0.5
        # RoPE tables [max_len, head_dim], float32 like transformers, cast at use.
        pos = torch.arange(kv.max_len, dtype=torch.float32)
        freqs = pos[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device)
        self.sin = emb.sin().to(self.device)
        self.qkv_slices = (cfg.q_size, cfg.kv_size, cfg.kv_size)

    # -- building blocks -------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # One fused kernel on CUDA (float32 accumulation inside); the same formula as HF's.
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, heads + kv_heads, d] for the step, built once and used by every layer.
        The attention scale 1/sqrt(d) is folded into q's rows: (s*q).k == s*(q.k)."""
        cfg = self.cfg
        head_scale = torch.ones(cfg.num_heads + cfg.num_kv_heads, 1, device=self.device)
        head_scale[: cfg.num_heads] = self.scale
        # rotate_half(x) * sin == roll(x, d/2) * sin_signed, with sin's first half negated.
        half = cfg.head_dim // 2
        sign = torch.ones(cfg.head_dim, device=self.device)
        sign[:half] = -1.0
        cos = (self.cos[positions].unsqueeze(1) * head_scale).to(dtype)
        sin = (self.sin[positions].unsqueeze(1) * head_scale * sign).to(dtype)
        return cos, sin

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: int, group: str, lora: StepLoRA | None) -> torch.Tensor:
        """y = x @ W.T (+ bias) for all rows (one base GEMM), then each row's adapter term."""
        if self._uses_gemm(x.shape[0]) and bias is None:
            linear = _triton_linear()
            if lora is None or group not in lora.groups:
                return linear.gemm(x, weight)
            g = self.lora.layers[layer][group]
            return linear.lora_linear(x, weight, g.a, g.b, g.scaling, lora.batch, ranks=self.lora.group_ranks[group],
                                      output_slices=g.slices if len(g.slices) > 1 else None)
        y = F.linear(x, weight, bias)
        if lora is None or group not in lora.groups:
            return y
        g = self.lora.layers[layer][group]
        return add_lora(y, x, g.a, g.b, g.scaling, lora.batch, ranks=self.lora.group_ranks[group],
                        backend=self.backend, output_slices=g.slices if len(g.slices) > 1 else None)

    def _mlp(self, x: torch.Tensor, i: int, lora: StepLoRA | None) -> torch.Tensor:
        lw = self.w.layers[i]
        gate_up = self._linear(x, lw.gate_up, None, i, "gate_up", lora)
        if self.fused_ops:
            from .ops import silu_mul

            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self._linear(act, lw.down, None, i, "down", lora)

    def _qkv(self, h: torch.Tensor, i: int, rope: tuple[torch.Tensor, torch.Tensor], lora: StepLoRA | None):
        """q [T, heads, d] (pre-scaled by 1/sqrt(d)), k and v [T, kv_heads, d]; RoPE on q and k
        in one pass over the fused q|k columns."""
        cfg, lw = self.cfg, self.w.layers[i]
        qkv = self._linear(h, lw.qkv, lw.qkv_bias, i, "qkv", lora)
        t, nq, nkv, d = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk = qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d)
        cos, sin = rope
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
        v = qkv[:, (nq + nkv) * d:].view(t, nkv, d)
        return qk[:, :nq], qk[:, nq:], v

    def _step_lora(self, token_slots: torch.Tensor, max_adapters: int | None,
                   lora_groups: int | None) -> StepLoRA | None:
        """The step's LoRA work: batch metadata, `max_adapters` as LoRABatch.build takes it
        (None: up to every slot; 0: base only, no LoRA work at all), and the groups to run
        (`lora_groups`, an adapters.group_mask; None: all). None when there is nothing to do."""
        if isinstance(max_adapters, bool):
            raise TypeError("max_adapters is a count of distinct adapters (0: base only), not a flag")
        if max_adapters == 0 or self.lora is None or lora_groups == 0:
            return None
        groups = frozenset(g for i, g in enumerate(GROUPS)
                           if g in self.lora.groups and (lora_groups is None or lora_groups >> i & 1))
        return StepLoRA(LoRABatch.build(token_slots, self.lora.num_slots, max_adapters=max_adapters), groups)

    def _uses_gemm(self, num_tokens: int) -> bool:
        return self.triton_gemm and num_tokens <= TRITON_GEMM_MAX_TOKENS

    def gemm_key(self, num_tokens: int) -> tuple | None:
        """What kernels.linear's GEMM compiles for a step of `num_tokens` rows (one
        configuration per projection); None when the step runs cuBLAS."""
        if not self._uses_gemm(num_tokens):
            return None
        lw = self.w.layers[0]
        return tuple(_triton_linear().gemm_config(num_tokens, w) for w in (lw.qkv, lw.o, lw.gate_up, lw.down))

    def lora_launch_key(self, num_tokens: int, max_adapters: int) -> tuple | None:
        """What the LoRA kernels compile for a step of `num_tokens` rows and at most
        `max_adapters` distinct adapters: every LoRA group's launch configuration (less its span,
        a runtime argument), the rows per block, and the GEMM's configurations where the step
        runs kernels.linear. Steps with equal keys compile nothing for each other. None when
        no Triton kernel runs (no adapters, or the torch backend)."""
        if self.lora is None or max_adapters <= 0 or self.device.type != "cuda" or self.backend == "torch":
            return None
        from loraplex.kernels.batch import default_block_m, max_blocks
        from loraplex.kernels.configs import sgmv_config  # imports triton

        block_m = default_block_m(num_tokens)
        blocks = max_blocks(num_tokens, min(max_adapters, self.lora.num_slots), block_m)
        configs = tuple(
            dataclasses.replace(sgmv_config(blocks, block_m, g.a.shape[2], g.slices, g.b.shape[2], g.a.dtype,
                                            self.device), span=0)
            for g in self.lora.layers[0].values())
        return block_m, configs, self.gemm_key(num_tokens)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(h, self.w.norm), self.w.lm_head).float()

    # -- prefill ---------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, token_slots: torch.Tensor, seqs: list[PrefillSeq],
                max_adapters: int | None = None, prompt_logprobs: dict[int, int] | None = None,
                lora_groups: int | None = None):
        """tokens int64 [T] (prompts packed back to back), token_slots int32 [T].
        Returns float32 logits [len(seqs), vocab] of each prompt's last token.

        With `prompt_logprobs` ({index into seqs: k}, the prompts that want them) returns
        (logits, {index: logprobs}) instead, logprobs as `_prompt_logprobs` gives them; the
        other prompts cost nothing more. Prompt logprobs need the whole prompt in this call
        (pos 0): the engine never chunks a prompt that asks for them.

        A sequence with pos > 0 (a later chunk) attends to its row's cached keys 0..pos-1 as
        well as causally within the chunk."""
        cfg = self.cfg
        if prompt_logprobs and any(seqs[i].pos for i in prompt_logprobs):
            raise ValueError("prompt logprobs need the whole prompt in one prefill (pos 0)")
        lora = self._step_lora(token_slots, max_adapters, lora_groups)
        # With the fused ops, one K/V write and one attention launch per layer for every prompt
        # (ops/prefill_attention.py), not one SDPA call and two writes per prompt.
        plan = None
        if self.fused_ops and self.prefill_kernel:
            from .ops import PrefillPlan

            plan = PrefillPlan.build([(s.start, s.length, s.pos, s.row) for s in seqs],
                                     cfg.num_heads // cfg.num_kv_heads, self.device)
            positions = plan.positions
        else:
            positions = torch.cat([torch.arange(s.pos, s.pos + s.length, device=self.device) for s in seqs])
        x = self._prefill_layers(tokens, positions, lora, plan, seqs)
        last = to_device([s.start + s.length - 1 for s in seqs], torch.int64, self.device)
        logits = self._logits(x[last])
        if prompt_logprobs is None:
            return logits
        return logits, self._prompt_logprobs(x, tokens, seqs, prompt_logprobs)

    @torch.inference_mode()
    def prefill_planned(self, tokens: torch.Tensor, token_slots: torch.Tensor, last: torch.Tensor, plan,
                        max_adapters: int | None = None, lora_groups: int | None = None) -> torch.Tensor:
        """`prefill` with its inputs on the device already, for a CUDA graph to capture
        (prefill_graphs.py): `plan` an ops.PrefillPlan (padded, maybe), `last` int64 [n] the
        packed index of each prompt's last token. Logits float32 [n, vocab]. The fused
        prefill attention only; no prompt logprobs."""
        lora = self._step_lora(token_slots, max_adapters, lora_groups)
        x = self._prefill_layers(tokens, plan.positions, lora, plan, None)
        return self._logits(x[last])

    def _prefill_layers(self, tokens: torch.Tensor, positions: torch.Tensor, lora: StepLoRA | None, plan,
                        seqs: list[PrefillSeq] | None) -> torch.Tensor:
        """The hidden states [T, hidden] after the last layer: attention by `plan` (the
        fused kernel), else SDPA per prompt of `seqs`."""
        cfg = self.cfg
        x = self.w.embed[tokens]
        rope = self._rope_tables(positions, x.dtype)
        for i, lw in enumerate(self.w.layers):
            h = self._rms_norm(x, lw.input_norm)
            q, k, v = self._qkv(h, i, rope, lora)
            if plan is not None:
                attn = self._prefill_attention_fused(q, k, v, i, plan)
            else:
                attn = self._prefill_attention_torch(q, k, v, i, seqs)
            x = x + self._linear(attn.reshape(x.shape[0], cfg.q_size), lw.o, lw.o_bias, i, "o", lora)
            x = x + self._mlp(self._rms_norm(x, lw.post_norm), i, lora)
        return x

    def _prefill_attention_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                                 plan) -> torch.Tensor:
        """Write the step's K/V into their rows, then attend every prompt in one launch."""
        from .ops import prefill_attention

        kc, vc = self.kv.k[layer], self.kv.v[layer]
        kc[plan.rows_index, :, plan.positions] = k
        vc[plan.rows_index, :, plan.positions] = v
        return prefill_attention(q, kc, vc, plan)

    def _prefill_attention_torch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                                 seqs: list[PrefillSeq]) -> torch.Tensor:
        """Per prompt: write its K/V into its row, then SDPA. A later chunk (or a prompt after a
        cached prefix) reads the row's keys 0..end-1: query i (position pos + i) sees key j iff
        j <= pos + i, the causal triangle aligned bottom right (is_causal aligns it top left).
        As a CausalBias, not a mask tensor: SDPA with an explicit mask and GQA has no fused
        kernel and falls back to its math backend, which builds the [heads, n, pos + n] scores
        in float32 (2.3 GB for a 1,024-token chunk after 16,384 tokens); lower right, it runs
        the flash kernel of a whole prefill on CUDA (the same math as the mask elsewhere)."""
        cfg = self.cfg
        gqa = cfg.num_heads != cfg.num_kv_heads
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        attn = torch.empty_like(q)
        for s in seqs:
            sl = slice(s.start, s.start + s.length)
            ks, vs = k[sl].transpose(0, 1), v[sl].transpose(0, 1)  # [kv_heads, n, d]
            end = s.pos + s.length
            kc[s.row, :, s.pos: end] = ks
            vc[s.row, :, s.pos: end] = vs
            qs = q[sl].transpose(0, 1).unsqueeze(0)
            if s.pos == 0:
                out = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True,
                                                     scale=1.0, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(qs, kc[s.row, :, :end].unsqueeze(0),
                                                     vc[s.row, :, :end].unsqueeze(0),
                                                     attn_mask=causal_lower_right(s.length, end), scale=1.0,
                                                     enable_gqa=gqa)
            attn[sl] = out[0].transpose(0, 1)
        return attn

    def _prompt_logprobs(self, x: torch.Tensor, tokens: torch.Tensor, seqs: list[PrefillSeq],
                         wanted: dict[int, int]) -> dict[int, list[TokenLogprobs | None]]:
        """Per wanted prompt, one entry per token: None for the first (nothing predicts it),
        then each token's logprob given the tokens before it, its rank there and the k most
        likely there. Prompt [1, 7, 9], k = 1 -> [None, (lp(7 | 1), top 1, rank), (lp(9 | 1 7), ...)].

        x [T, hidden] the last layer's output. Position p scores token p + 1: log_softmax in
        float32 over the logits of every position but the last, of the wanted prompts only,
        PROMPT_LOGPROBS_CHUNK positions at a time; one copy to the host at the end."""
        order = sorted(wanted)
        host = [p for i in order for p in range(seqs[i].start, seqs[i].start + seqs[i].length - 1)]
        k = max(wanted.values(), default=0)
        chosen, ranks, top_v, top_i = [], [], [], []
        if host:
            positions = torch.tensor(host, device=self.device)
            for c in range(0, len(host), PROMPT_LOGPROBS_CHUNK):
                rows = positions[c:c + PROMPT_LOGPROBS_CHUNK]
                lp = torch.log_softmax(self._logits(x[rows]), dim=-1)  # [chunk, vocab]
                picked = lp.gather(1, tokens[rows + 1][:, None])
                chosen.append(picked[:, 0])
                ranks.append((lp >= picked).sum(dim=-1))  # vLLM's rank: tokens at least as likely
                if k:
                    top = lp.topk(k, dim=-1)  # sorted, most likely first
                    top_v.append(top.values)
                    top_i.append(top.indices)
            chosen = torch.cat(chosen).tolist()
            ranks = torch.cat(ranks).tolist()
            top_v = torch.cat(top_v).tolist() if k else [[]] * len(host)
            top_i = torch.cat(top_i).tolist() if k else [[]] * len(host)
        out, j = {}, 0
        for i in order:
            n = wanted[i]
            entries: list[TokenLogprobs | None] = [None]
            for _ in range(seqs[i].length - 1):
                entries.append(TokenLogprobs(chosen[j], tuple(zip(top_i[j][:n], top_v[j][:n])), ranks[j]))
                j += 1
            out[i] = entries
        return out

    # -- decode ----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
               kv_len: int, max_adapters: int | None = None, lora_groups: int | None = None) -> torch.Tensor:
        """One token for each KV row 0..B-1: tokens int64 [B], positions int64 [B] (where the
        token goes; it attends to positions 0..p of its row), token_slots int32 [B].
        kv_len (> max position) bounds the keys read. Returns float32 logits [B, vocab]."""
        lora = self._step_lora(token_slots, max_adapters, lora_groups)
        x = self.w.embed[tokens]
        if self.fused_ops:
            h = self._decode_fused(x, positions, kv_len, lora)
        else:
            h = self._decode_torch(x, positions, kv_len, lora)
        return F.linear(h, self.w.lm_head).float()

    def _decode_torch(self, x: torch.Tensor, positions: torch.Tensor, kv_len: int,
                      lora: StepLoRA | None) -> torch.Tensor:
        """The decode layers as torch ops; returns the final-normed hidden states [B, hidden]."""
        cfg = self.cfg
        b = x.shape[0]
        groups = cfg.num_heads // cfg.num_kv_heads
        rows = torch.arange(b, device=self.device)
        # [B, 1, 1, kv_len]: True for keys past the row's position.
        keys = torch.arange(kv_len, device=self.device)
        future = (keys[None, :] > positions[:, None]).view(b, 1, 1, kv_len)
        rope = self._rope_tables(positions, x.dtype)
        for i, lw in enumerate(self.w.layers):
            h = self._rms_norm(x, lw.input_norm)
            q, k, v = self._qkv(h, i, rope, lora)
            kc, vc = self.kv.k[i], self.kv.v[i]
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            # Grouped-query attention as two batched GEMVs over strided cache views:
            # q [B, kv_heads, groups, d] x K^T [B, kv_heads, d, kv_len] -> [B, kv_heads, groups, kv_len]
            qg = q.reshape(b, cfg.num_kv_heads, groups, cfg.head_dim)
            scores = torch.matmul(qg, kc[:b, :, :kv_len].transpose(-1, -2))
            # softmax accumulates in float32 inside, for bfloat16 input too
            probs = torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1)
            attn = torch.matmul(probs, vc[:b, :, :kv_len])  # [B, kv_heads, groups, d]
            x = x + self._linear(attn.reshape(b, cfg.q_size), lw.o, lw.o_bias, i, "o", lora)
            x = x + self._mlp(self._rms_norm(x, lw.post_norm), i, lora)
        return self._rms_norm(x, self.w.norm)

    def _decode_fused(self, x: torch.Tensor, positions: torch.Tensor, kv_len: int,
                      lora: StepLoRA | None) -> torch.Tensor:
        """The decode layers with the server/ops kernels: each residual add is fused with the
        RMSNorm after it (the next layer's input norm, or the final norm). Same result as
        `_decode_torch` up to rounding; returns the final-normed hidden states [B, hidden]."""
        from .ops import add_rms_norm, decode_attention, rms_norm, rope_and_cache_write

        cfg, layers, eps = self.cfg, self.w.layers, self.cfg.rms_norm_eps
        b = x.shape[0]
        rows = torch.arange(b, device=self.device)
        h = rms_norm(x, layers[0].input_norm, eps)
        for i, lw in enumerate(layers):
            kc, vc = self.kv.k[i], self.kv.v[i]
            qkv = self._linear(h, lw.qkv, lw.qkv_bias, i, "qkv", lora)
            q = rope_and_cache_write(qkv, self.cos, self.sin, kc, vc, rows, positions, self.scale)
            attn = decode_attention(q, kc, vc, positions, kv_len)  # [B, heads, d]
            o = self._linear(attn.view(b, cfg.q_size), lw.o, lw.o_bias, i, "o", lora)
            x, h = add_rms_norm(x, o, lw.post_norm, eps)
            down = self._mlp(h, i, lora)
            x, h = add_rms_norm(x, down, layers[i + 1].input_norm if i + 1 < len(layers) else self.w.norm, eps)
        return h
