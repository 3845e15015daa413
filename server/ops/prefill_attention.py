"""Prefill attention: every prompt of a prefill step against its own KV row, in one launch.

    q        [T, heads, d]                 the step's tokens, prompts back to back, RoPE'd and
                                           pre-scaled by 1/sqrt(d)
    k_cache  [rows, kv_heads, max_len, d]  holding each prompt's keys 0..pos+n-1 (its cached
                                           prefix or earlier chunks, and this step's, written
                                           before the call)
    out      [T, heads, d]                 token i of a prompt at `pos` (position pos + i)
                                           attends to its row's keys 0..pos + i

That is the causal triangle aligned bottom right: a prompt after a cached prefix of `pos`
tokens, or a later chunk, reads the prefix's keys whole. The torch path runs one SDPA call
per prompt per layer: a step that admits 30 requests after a cached system prompt made ~1,000
attention calls and as many K/V writes per forward, launches that left the GPU waiting
(bench/results/prefix_h200_notes.md). Here one program takes BLOCK_M tokens of one prompt
and one kv head, with all ``heads / kv_heads`` query heads of that kv head as rows of its
tile, so each K and V block is read once for the group; the softmax is online in float32;
a program reads keys only up to its last token's position (the triangle's blocks above it
are skipped).

`PrefillPlan` holds a step's prompts (start in the packed tokens, length, pos, KV row) and
its programs' (prompt, first token) on the device, built once per step for every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import check_dense_rows, check_dtype, check_launchable

# Tile rows (tokens x heads of a group) per program, and keys per inner step.
TILE_ROWS = 64
BLOCK_N = 64


@dataclass(frozen=True)
class PrefillPlan:
    """A prefill step's prompts and programs, on the device (int32).

    A padded plan (`layout` with room to spare, for a CUDA graph of a fixed size: see
    server/prefill_graphs.py) has more tokens, prompts and programs than the step: the
    spare prompts have length 0, the spare programs take one of them (they write nothing),
    and the spare tokens write their K/V at `scratch` (a row, and the cache's last
    position, which no sequence uses); `prefill_attention` zeroes their output."""

    seqs: torch.Tensor  # [S, 4]: start in q, length, pos, KV row
    programs: torch.Tensor  # [P, 2]: prompt index, first token of the block
    tokens: int  # T, the packed tokens
    rows_index: torch.Tensor  # int64 [T]: each token's KV row
    positions: torch.Tensor  # int64 [T]: each token's position
    block_m: int
    padded: bool = False

    @staticmethod
    def block_m_for(groups: int) -> int:
        """Tokens per program for `groups` query heads per kv head."""
        return max(1, TILE_ROWS // triton.next_power_of_2(groups))

    @staticmethod
    def layout(seqs: Sequence[tuple[int, int, int, int]], block_m: int, tokens: int | None = None,
               num_seqs: int | None = None, programs: int | None = None,
               scratch: tuple[int, int] = (0, 0)) -> list[int]:
        """The plan as one int64 list, [seqs 4*S | programs 2*P | rows T | positions T], padded
        to `tokens`, `num_seqs` (plus one spare prompt, when padding) and `programs` where
        given (each at least what `seqs` needs; `scratch`: the (row, position) of spare tokens)."""
        progs = [(i, m0) for i, (_, n, _, _) in enumerate(seqs) for m0 in range(0, n, block_m)]
        rows = [row for _, n, _, row in seqs for _ in range(n)]
        positions = [p for _, n, pos, _ in seqs for p in range(pos, pos + n)]
        seq_rows = [list(s) for s in seqs]
        if tokens is not None:
            if tokens < len(rows) or num_seqs < len(seqs) or programs < len(progs):
                raise ValueError(f"a plan of {len(rows)} tokens, {len(seqs)} prompts and {len(progs)} programs "
                                 f"does not fit {tokens}, {num_seqs} and {programs}")
            seq_rows += [[0, 0, 0, 0]] * (num_seqs + 1 - len(seqs))  # spare prompts: length 0
            progs += [(num_seqs, 0)] * (programs - len(progs))
            rows += [scratch[0]] * (tokens - len(rows))
            positions += [scratch[1]] * (tokens - len(positions))
        return [x for s in seq_rows for x in s] + [x for p in progs for x in p] + rows + positions

    @classmethod
    def from_flat(cls, flat: torch.Tensor, num_seqs: int, programs: int, tokens: int, block_m: int,
                  padded: bool = False) -> "PrefillPlan":
        """The plan over `flat`, a device copy of `layout` (num_seqs counting a spare prompt)."""
        a, b = 4 * num_seqs, 4 * num_seqs + 2 * programs
        return cls(flat[:a].view(-1, 4).to(torch.int32), flat[a:b].view(-1, 2).to(torch.int32), tokens,
                   flat[b:b + tokens], flat[b + tokens:b + 2 * tokens], block_m, padded)

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, int, int]], groups: int, device: torch.device) -> "PrefillPlan":
        """`seqs`: (start, length, pos, row) of each prompt, starts back to back from 0;
        `groups`: heads per kv head. One copy to the device."""
        block_m = cls.block_m_for(groups)
        flat = cls.layout(seqs, block_m)
        tokens = sum(n for _, n, _, _ in seqs)
        programs = (len(flat) - 4 * len(seqs) - 2 * tokens) // 2
        host = torch.tensor(flat, dtype=torch.int64).pin_memory() if device.type == "cuda" else \
            torch.tensor(flat, dtype=torch.int64)
        return cls.from_flat(host.to(device, non_blocking=True), len(seqs), programs, tokens, block_m)


@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [T, heads, d]
    q_ptr,  # [T, heads, d]
    k_ptr,  # [rows, kv_heads, max_len, d]
    v_ptr,
    seqs_ptr,  # int32 [S, 4]: start, length, pos, row
    programs_ptr,  # int32 [P, 2]: prompt, first token
    GROUPS,
    HEAD_DIM,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ot,
    stride_oh,
    BLOCK_M: tl.constexpr,  # tokens per program
    BLOCK_G: tl.constexpr,  # >= GROUPS, a power of two; BLOCK_M * BLOCK_G rows
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Semantics, as the plain loop it computes::

        for program (prompt s, first token m0), kv head j:     # grid (P, kv_heads)
            for token i in m0 : m0 + BLOCK_M (< length), head h of group j:
                keys = 0 .. pos + i of row
                out[start + i, h] = softmax(q[start + i, h] @ k[row, j, keys].T) @ v[row, j, keys]
    """
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(programs_ptr + 2 * pid)
    m0 = tl.load(programs_ptr + 2 * pid + 1)
    start = tl.load(seqs_ptr + 4 * s).to(tl.int64)
    length = tl.load(seqs_ptr + 4 * s + 1)
    pos = tl.load(seqs_ptr + 4 * s + 2)
    row = tl.load(seqs_ptr + 4 * s + 3).to(tl.int64)

    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = m0 + offs_r // BLOCK_G  # token of each tile row, within the prompt
    head = kvh * GROUPS + offs_r % BLOCK_G
    r_mask = (tok < length) & (offs_r % BLOCK_G < GROUPS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = pos + tok  # each row sees keys 0..q_pos
    hi = pos + tl.minimum(m0 + BLOCK_M, length)  # one past the last key any row sees
    k_row = k_ptr + row * stride_kb + kvh * stride_kh
    v_row = v_ptr + row * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Key 0 is seen by every row, so each row's max is finite after the first block.
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_row + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [rows, BLOCK_N]
        scores = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_row + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = out_ptr + (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    # A spare program of a padded plan (a prompt of length 0) saw no key: l_i 0, nothing stored.
    l_i = tl.where(l_i > 0, l_i, 1.0)
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """A new [T, heads, d] tensor in q's dtype: each prompt's tokens attending to their row's
    keys, bottom-right causal (module docstring). No host synchronisation."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [T, heads, d] and both caches [rows, kv_heads, max_len, d], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: head_dim must agree "
                         "and heads be a multiple of kv_heads")
    if head_dim < 16:
        raise ValueError(f"head_dim {head_dim} < 16 is not supported (tl.dot's smallest tile)")
    if tokens != plan.tokens:
        raise ValueError(f"q holds {tokens} tokens, the plan's prompts {plan.tokens}")
    check_dtype("q", q)
    check_dtype("k_cache", k_cache, q.dtype)
    check_dtype("v_cache", v_cache, q.dtype)
    check_dense_rows(q=q, k_cache=k_cache, v_cache=v_cache)
    check_launchable(q, k_cache, v_cache, plan.seqs)
    # A padded plan's spare tokens belong to no prompt: zeros, not whatever memory held.
    out = (torch.zeros_like if plan.padded else torch.empty_like)(q, memory_format=torch.contiguous_format)
    groups = heads // kv_heads
    if tokens == 0:
        return out
    _prefill_attention_kernel[(plan.programs.shape[0], kv_heads)](
        out, q, k_cache, v_cache, plan.seqs, plan.programs, groups, head_dim,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        BLOCK_M=plan.block_m, BLOCK_G=triton.next_power_of_2(groups), BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(head_dim), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    return out
