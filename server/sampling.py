"""Per-request sampling for a whole batch at once: greedy, temperature, top-k, top-p, seed.

Randomness is counter-based: the noise for row r, vocabulary entry v at output step n is a
hash of (request seed, n, v). A seeded request therefore draws the same tokens whichever
batch it shares, on any device, and no generator state lives between steps. Sampling uses
the Gumbel-max form: token = argmax(log p_masked + g) with g = -log(-log u) (exactly a draw
from p_masked), so masks never renumber the noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_M32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0  # 0 or -1 = all tokens
    seed: int | None = None  # None: the engine draws one per request
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 or positive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1), float32 [n, vocab], a pure function of (seed, counter, vocab index).

    seeds, counters: int64 [n] (seeds any non-negative 64-bit value)."""
    key = _fmix32((seeds & _M32) ^ 0x9E3779B9)
    key = _fmix32(key ^ ((seeds >> 32) & _M32))
    key = _fmix32(key ^ (counters & _M32))
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _fmix32(key[:, None] ^ ((idx * 0x9E3779B1) & _M32)[None, :])
    h = _fmix32(h ^ 0x5BD1E995)
    # 24 high bits -> float32 exactly, centred in its bucket: never 0, never 1.
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k then top-p drop. logits float32 [n, V] (already divided by
    the temperature), top_k int64 [n] (<= 0 = off), top_p float32 [n]. Returns a new tensor."""
    n, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first one always stays.
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Sampler:
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               counters: list[int], rows: list[int] | None = None) -> list[int]:
        """One token per request (one host synchronisation for the whole batch).

        logits float32 [n, V]; request i reads row rows[i] (default i); `seeds` and
        `counters` (the request's output-token index) feed the noise."""
        rows = list(range(len(params))) if rows is None else rows
        tokens = logits.argmax(dim=-1)
        picked = [i for i, p in enumerate(params) if not p.greedy]
        if picked:
            device = logits.device
            idx = torch.tensor([rows[i] for i in picked], device=device)
            sub = logits[idx]
            temps = torch.tensor([params[i].temperature for i in picked], device=device, dtype=torch.float32)
            sub = sub / temps[:, None]
            if any(params[i].top_k > 0 or params[i].top_p < 1 for i in picked):
                top_k = torch.tensor([params[i].top_k for i in picked], device=device, dtype=torch.int64)
                top_p = torch.tensor([params[i].top_p for i in picked], device=device, dtype=torch.float32)
                sub = apply_top_k_top_p(sub, top_k, top_p)
            u = uniform_noise(torch.tensor([seeds[i] for i in picked], device=device, dtype=torch.int64),
                              torch.tensor([counters[i] for i in picked], device=device, dtype=torch.int64),
                              logits.shape[-1])
            gumbel = -torch.log(-torch.log(u))
            tokens[idx] = (torch.log_softmax(sub, dim=-1) + gumbel).argmax(dim=-1)
        out = tokens.tolist()
        return [out[r] for r in rows]
