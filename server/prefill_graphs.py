"""Prefill steps of up to PREFILL_GRAPH_MAX_TOKENS tokens, replayed as CUDA graphs.

A prefill runs eagerly: for Llama-3-8B, 32 layers of at least 16 launches each, 22 with
adapters (GEMMs, norms, RoPE, the K/V write, the attention kernel, and with adapters two LoRA
launches a projection group). A small step launches faster than Python can issue it. Measured on an H200
(bench/results/prefill_step_h200_notes.md): four 64-token questions after a cached
1,024-token system prompt took 15.6 ms base only, its kernels 9 ms, and 37 ms with four
adapters, the host issuing the LoRA calls the whole time: the time to first token of every
request that the prefix cache made cheap. So a step of at most PREFILL_GRAPH_MAX_TOKENS
tokens is padded to a bucket (16, 32, ... tokens) and replays a graph of `model.prefill_planned`
captured for that bucket, adapter bucket and layer groups (the keys of decode's graphs,
batch.py), reading its inputs from one static device buffer per bucket:

    bucket 32, two prompts (row 3: 9 tokens at 0; row 1: 6 tokens after 20 cached)
    tokens    [t0 .. t8, u0 .. u5, 0 x 17]      spare tokens: token 0
    slots     [s x 9,    -1 x 6,   -1 x 17]     slot -1: no LoRA work
    last      [8, 14, 0 ...]                    each prompt's last token; logits of 2 returned
    plan      prompts (0, 9, 0, 3), (9, 6, 20, 1), then length-0 spares; spare programs
              on a spare prompt; spare tokens' K/V at (row 0, the cache's last position),
              which no sequence uses (batch.py), their attention output zero

A step that asks for prompt logprobs, or of more tokens, runs eagerly (`model.prefill`).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .batch import adapter_bucket, capture_graph
from .model import LlamaModel, PrefillSeq
from .ops import PrefillPlan

log = logging.getLogger(__name__)

# The largest step replayed as a graph; from about there a prefill keeps the GPU busy alone.
PREFILL_GRAPH_MAX_TOKENS = 1024
MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """Padded step sizes: 16, 32, 64, ... up to the first at or past `max_tokens`, none past
    PREFILL_GRAPH_MAX_TOKENS."""
    out, b = [], MIN_BUCKET
    while b <= PREFILL_GRAPH_MAX_TOKENS:
        out.append(b)
        if b >= max_tokens:
            break
        b *= 2
    return out


class PrefillGraphs:
    """The prefill graphs of one model. `graphs=False` runs the same padded step eagerly
    (what a CPU test checks against `model.prefill`). `enabled`: whether the engine sends
    its steps here (on with graphs; a test turns it on without them, a benchmark off)."""

    def __init__(self, model: LlamaModel, max_rows: int, max_tokens: int, graphs: bool = True):
        self.model = model
        self.device = model.device
        self.max_rows = max_rows
        self.use_graphs = graphs and self.device.type == "cuda"
        self.enabled = self.use_graphs
        self.buckets = token_buckets(max_tokens)
        cfg = model.cfg
        self.block_m = PrefillPlan.block_m_for(cfg.num_heads // cfg.num_kv_heads)
        self.scratch = (0, model.kv.max_len - 1)
        self._flat: dict[int, torch.Tensor] = {}  # bucket -> its static inputs (int64)
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._logits: torch.Tensor | None = None  # every graph's output, outside the pool
        self.pool = None  # set to share the decode graphs' memory pool
        self.capture_guard = contextlib.nullcontext()  # as DecodeRunner's

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def sizes(self, bucket: int) -> tuple[int, int]:
        """(prompts, programs) a bucket's plan has room for."""
        seqs = min(bucket, self.max_rows)
        return seqs, bucket // self.block_m + seqs

    def takes(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a step of `num_tokens` tokens in `num_seqs` prompts replays a graph."""
        m = self.model
        return (m.fused_ops and m.prefill_kernel and num_tokens <= self.buckets[-1]
                and num_seqs <= self.sizes(self.bucket(num_tokens))[0])

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def run(self, tokens: list[int], slots: list[int], seqs: list[PrefillSeq], max_adapters: int,
            lora_groups: int) -> torch.Tensor:
        """Logits float32 [len(seqs), vocab] of each prompt's last token, as `model.prefill`
        gives them, for a step that `takes`. Valid until the next call."""
        b = self.bucket(len(tokens))
        num_seqs, programs = self.sizes(b)
        pad = b - len(tokens)
        flat = (tokens + [0] * pad + slots + [-1] * pad
                + [s.start + s.length - 1 for s in seqs] + [0] * (num_seqs - len(seqs))
                + PrefillPlan.layout([(s.start, s.length, s.pos, s.row) for s in seqs], self.block_m, b, num_seqs,
                                     programs, self.scratch))
        host = torch.tensor(flat, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self._inputs(b).copy_(host, non_blocking=True)
        key = (b, max_adapters, lora_groups if max_adapters else 0)
        if not self.use_graphs:
            return self._forward(b, max_adapters, lora_groups)[: len(seqs)]
        if key not in self._graphs:
            self._graphs[key] = self._capture(b, max_adapters, lora_groups)
        graph, out = self._graphs[key]
        graph.replay()
        return out[: len(seqs)]

    def warm_up(self, masks: list[int]) -> int:
        """Before the first request: capture each bucket's graph base only and, for each
        adapter bucket a step of that size can reach, with the adapters on each layer-group
        mask of `masks` (DecodeRunner.warmup_masks). Inputs all spare (K/V written at the
        scratch position only). Returns the graphs captured."""
        if not (self.use_graphs and self.model.fused_ops and self.model.prefill_kernel):
            return 0
        lora = self.model.lora
        before = self.num_graphs
        for b in self.buckets:
            num_seqs, programs = self.sizes(b)
            host = torch.tensor([0] * b + [-1] * b + [0] * num_seqs
                                + PrefillPlan.layout([], self.block_m, b, num_seqs, programs, self.scratch))
            self._inputs(b).copy_(host)
            keys = [(0, 0)]
            if lora is not None:
                adapters = sorted({adapter_bucket(n) for n in range(1, min(lora.num_slots, num_seqs) + 1)})
                keys += [(a, mask) for a in adapters for mask in masks if mask]
            for a, mask in keys:
                if (b, a, mask) not in self._graphs:
                    self._graphs[(b, a, mask)] = self._capture(b, a, mask)
        torch.cuda.synchronize(self.device)
        return self.num_graphs - before

    def _inputs(self, bucket: int) -> torch.Tensor:
        """The bucket's static input buffer: tokens, slots [b] each, last [prompts], the plan."""
        if bucket not in self._flat:
            num_seqs, programs = self.sizes(bucket)
            size = 2 * bucket + num_seqs + 4 * (num_seqs + 1) + 2 * programs + 2 * bucket
            self._flat[bucket] = torch.zeros(size, dtype=torch.int64, device=self.device)
        return self._flat[bucket]

    def _forward(self, bucket: int, max_adapters: int, lora_groups: int) -> torch.Tensor:
        """The padded step over the bucket's static inputs: logits [prompts of the bucket, vocab]."""
        flat = self._inputs(bucket)
        num_seqs, programs = self.sizes(bucket)
        tokens, slots = flat[:bucket], flat[bucket: 2 * bucket].to(torch.int32)
        last = flat[2 * bucket: 2 * bucket + num_seqs]
        plan = PrefillPlan.from_flat(flat[2 * bucket + num_seqs:], num_seqs + 1, programs, bucket, self.block_m,
                                     padded=True)
        return self.model.prefill_planned(tokens, slots, last, plan, max_adapters, lora_groups)

    def _capture(self, bucket: int, max_adapters: int, lora_groups: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the bucket's padded step on its current inputs (`capture_graph`'s two runs
        first compute what the replay will: the same K/V)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        num_seqs = self.sizes(bucket)[0]
        if self._logits is None:
            self._logits = torch.empty(self.sizes(self.buckets[-1])[0], self.model.cfg.vocab_size,
                                       dtype=torch.float32, device=self.device)
        graph = capture_graph(lambda: self._forward(bucket, max_adapters, lora_groups), self._logits[:num_seqs],
                              self.pool, self.capture_guard)
        log.debug("captured prefill graph: %d tokens, adapters %d, groups %d", bucket, max_adapters, lora_groups)
        return graph, self._logits[:num_seqs]
