"""A step's batch: the running requests turned into the model's input tensors.

Decode inputs live in static device buffers of `max_rows` entries (the CUDA graphs read
them at fixed addresses); each step fills a pinned host copy and sends it in one
non-blocking copy per tensor. Row r of the decode batch is KV row r; rows with no request
decoded feed token 0 with slot -1 (base only), and their outputs are ignored. A free row
goes at position `KVCache.kept[row]`: 0, or just past the prefix it keeps for prefix caching
(prefix_cache.py), so its attention reads that many keys and one more, and the keys it keeps
stay (at the cache's last position, which no sequence uses, each one read the whole cache in
a graph's decode: max_len keys for every free row of the bucket). A row that a request holds
but this step does not decode (mid chunked prefill, or prefilled this step) goes at the
cache's last position, which no sequence uses (a sequence feeds positions up to max_len - 2),
so its prompt's keys stay.

Running example, max_rows 8, two requests in KV rows 0 and 2, span 3 -> bucket 4::

    tokens      [ 901,   0, 417,   0]     last sampled token of each row
    positions   [  12,   0,  40,   0]     where that token goes (free rows: KVCache.kept, here 0)
    token_slots [   3,  -1,  -1,  -1]     row 0 uses the adapter in slot 3, row 2 the base
    kv_len      2048                      keys read at most: with graphs the cache's length (kv_bucket)

`DecodeRunner.run` replays a CUDA graph per (bucket, kv_len, adapter bucket, layer groups) on
CUDA devices, captured the first time that key is seen, and calls `model.decode` eagerly
elsewhere. The layer groups are those the running adapters target (adapters.group_mask): a
batch of adapters that target q and v only runs no o, gate/up or down LoRA kernels at all. With
graphs, kv_len is the cache's whole length, one key: the attention spreads each row's own keys
over its programs whatever the bound (`kv_bucket`). The adapter bucket bounds the distinct
adapters of the running rows (0, 1, 2, 4, 8, ...): the LoRA kernels' grid is sized for that
many adapters rather than for every slot, which spreads each adapter's work over more
programs (32 adapters in 64 slots: the grid of 32, not 64). The warm-up captures the graphs
of base rows and of adapters on every group the slots hold at start (`warm_up`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from loraplex.kernels.batch import step_grids

from .model import LlamaModel, PrefillSeq
from .request import Request
from .sampling import to_device
from .scheduler import PrefillChunk

log = logging.getLogger(__name__)


def batch_buckets(max_rows: int) -> list[int]:
    """Decode batch sizes a graph is captured for: 1, 2, 4, 8, then multiples of 8 up to max_rows."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


def kv_bucket(max_position: int, kv_block: int, max_len: int, graphs: bool) -> int:
    """The bound on the keys a decode step reads: with CUDA graphs the cache's whole length
    ``max_len``, one graph key; without, max_position + 1 rounded up to whole ``kv_block``s.

    The bound is part of a graph's key, and a new key stalls every running row while its graph
    is captured (52-184 ms a graph for Llama-3-8B on an H200): as a power of two of blocks it
    was a new key each time the longest sequence doubled. The attention kernel stops at each
    row's own last key and cuts the keys a row has into its splits (ops/attention.py), so the
    bound changes nothing a step reads: a 4,096-key bound measured the same step time as one of
    256-1,024 (bench/results/engine_h200_kv_buckets_notes.md). Eager decode (CPU, no graphs)
    keeps whole blocks: its torch attention does read every key of the bound.
    """
    if graphs:
        return max_len
    blocks = (max_position + 1 + kv_block - 1) // kv_block
    return min(blocks * kv_block, max_len)


def adapter_bucket(distinct: int) -> int:
    """The bound on distinct adapters a step is run with: 0, or the next power of two."""
    return 0 if distinct <= 0 else 1 << (distinct - 1).bit_length()


def warmup_plan(buckets: list[int], num_slots: int) -> list[tuple[int, int]]:
    """The decode steps (batch bucket, adapter bucket) that between them launch every decode
    kernel configuration of a graphed decode (one KV bound, kv_bucket): each batch bucket with
    each adapter bucket it can hold (the LoRA kernels' configurations). The other ops depend
    on the batch bucket alone."""
    steps = []
    for b in buckets:
        adapters = sorted({0} | {adapter_bucket(n) for n in range(1, min(b, num_slots) + 1)})
        steps += [(b, a) for a in adapters]
    return steps


def prefill_warmup_plan(max_tokens: int, num_slots: int,
                        launch_key: Callable[[int, int], Hashable | None]) -> list[tuple[int, int]]:
    """The prefill steps (rows, adapter bucket) that between them launch every LoRA kernel
    configuration a prefill of 1..max_tokens rows can: for each distinct `launch_key(rows,
    adapters)` (the model's `lora_launch_key`), the smallest step that has it. Only the
    grid of a step changes its configuration (kernels.batch.step_grids), so few row counts
    are asked. Steps with no key (no Triton kernel runs) are left out."""
    steps: dict[Hashable, tuple[int, int]] = {}
    for adapters in sorted({adapter_bucket(n) for n in range(1, num_slots + 1)}):
        for rows in step_grids(max_tokens, min(adapters, num_slots)).values():
            if adapters > adapter_bucket(rows):  # a step has at most one adapter a row
                continue
            key = launch_key(rows, adapters)
            if key is not None:
                steps.setdefault(key, (rows, adapters))
    return sorted(steps.values())


def warm_up_prefill(model: LlamaModel, max_tokens: int) -> int:
    """Before the first request: run `prefill_warmup_plan`'s prefills, so every LoRA kernel
    configuration a prefill can launch compiles now and not in a serving step (a new one
    stalls the step for its compile, about a second on an H200), after the base-only prefills
    of `base_warmup_rows` (the base path's own kernels). Prompts of token 0 over `adapters`
    slots, packed into KV rows from 0 up, which no request holds yet; the logits are dropped.
    Returns the prefills run."""
    length = model.kv.max_len - 1  # positions a sequence may use
    max_tokens = min(max_tokens, model.kv.rows * length)
    plan = [] if model.lora is None else prefill_warmup_plan(max_tokens, model.lora.num_slots, model.lora_launch_key)
    plan = [(rows, 0) for rows in base_warmup_rows(model, max_tokens)] + plan
    for rows, adapters in plan:
        seqs = [PrefillSeq(row=i, start=start, length=min(length, rows - start), pos=0)
                for i, start in enumerate(range(0, rows, length))]
        tokens = torch.zeros(rows, dtype=torch.int64, device=model.device)
        slots = torch.full((rows,), -1, dtype=torch.int32, device=model.device)
        if adapters:
            used = min(adapters, model.lora.num_slots)
            slots = (torch.arange(rows, device=model.device) * used // rows).to(torch.int32)
        model.prefill(tokens, slots, seqs, adapters)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return len(plan)


def base_warmup_rows(model: LlamaModel, max_tokens: int) -> list[int]:
    """Row counts of the base-only prefills a warm-up runs: 16 (the base path's own kernels),
    and one for each other configuration of kernels.linear's GEMM that a step of up to
    max_tokens rows can launch (model.gemm_key)."""
    first = min(16, max_tokens)
    seen = {model.gemm_key(first): first}
    for rows in range(1, max_tokens + 1):
        key = model.gemm_key(rows)
        if key is None and rows > first:
            break  # past the GEMM's rows: cuBLAS
        seen.setdefault(key, rows)
    return sorted(set(seen.values()))


def pack_prefill(chunks: list[PrefillChunk]) -> tuple[list[int], list[int], list[PrefillSeq]]:
    """Pack the step's prompt chunks back to back: tokens, token slots (each chunk carries its
    request's adapter slot) and the sequences, on the host."""
    tokens: list[int] = []
    slots: list[int] = []
    seqs = []
    for c in chunks:
        req = c.req
        seqs.append(PrefillSeq(row=req.row, start=len(tokens), length=c.length, pos=c.pos))
        tokens += req.prompt_ids[c.pos: c.pos + c.length]
        slots += [req.slot] * c.length
    return tokens, slots, seqs


@dataclass
class LookAhead:
    """A decode step launched before the tokens it decodes reached the host (LLMEngine.step):
    the requests of its rows, the position each row decodes at, and its logits (not read yet)."""

    rows: dict[int, Request]
    positions: dict[int, int]
    logits: torch.Tensor

    def covers(self, decoding: dict[int, Request]) -> bool:
        """A step that decodes `decoding` may take these logits: every one of its rows was
        decoded here, for the same request at the position it is at now."""
        return all(self.rows.get(row) is req and self.positions[row] == req.position for row, req in decoding.items())


def capture_graph(run: Callable[[], torch.Tensor], out: torch.Tensor, pool, guard) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `run`, its result copied into `out` (outside the graphs' `pool`, so no
    graph keeps an output of its own). `run` goes twice on a side stream first, where its
    kernels compile and its workspaces are allocated; `guard` is held while capturing."""
    device = out.device
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with guard, torch.cuda.graph(graph, pool=pool):
        out.copy_(run())
    return graph


class DecodeRunner:
    def __init__(self, model: LlamaModel, max_rows: int, kv_block: int, cuda_graphs: bool):
        self.model = model
        self.device = model.device
        self.max_rows = max_rows
        self.kv_block = kv_block
        self.buckets = batch_buckets(max_rows)
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        pin = self.device.type == "cuda"
        # Two sets of pinned input buffers, used in turn: a step's inputs are written while the
        # copy of the step before it may still wait in the stream (behind a look-ahead step:
        # LLMEngine). A set is written again only once its last copy ran (`_copied`).
        self._hosts = [{
            "tokens": torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin),
            "positions": torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin),
            "token_slots": torch.full((max_rows,), -1, dtype=torch.int32, pin_memory=pin),
        } for _ in range(2)]
        self._nps = [{k: v.numpy() for k, v in host.items()} for host in self._hosts]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._dev = {k: torch.zeros_like(v, device=self.device) for k, v in self._hosts[0].items()}
        self._graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Every graph writes its logits here (allocated at the first capture, outside the
        # graphs' pool): no graph keeps an output of its own, so capturing many costs no memory
        # beyond the graphs themselves.
        self._logits: torch.Tensor | None = None
        # Size the LoRA grid for the step's adapters (adapter_bucket), or for every slot (the
        # bench's before/after switch).
        self.bound_adapters = True
        self.pool = None
        self.last_args: tuple | None = None
        self.last_key: tuple | None = None  # the last replayed graph's key (benchmarks replay it alone)
        # Held while a graph is captured: the adapter cache's CUDA lock, so no load thread makes
        # a CUDA call (pinned alloc, event sync) that a global-mode capture forbids.
        self.capture_guard = contextlib.nullcontext()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def kv_len_for(self, max_position: int) -> int:
        return kv_bucket(max_position, self.kv_block, self.model.kv.max_len, self.use_graphs)

    def run(self, running: dict[int, Request], span: int,
            sampled: list[tuple[list[int], torch.Tensor, list[int]]] | None = None) -> torch.Tensor:
        """Logits float32 [b, vocab] for KV rows 0..b-1, b >= span (rows without a request:
        garbage). Each row of `running` decodes its request's last token at its position.

        `sampled`: a look-ahead step (LLMEngine.step), launched before the tokens it decodes
        reach the host: every request of `running` is one token further than it knows, at
        its position + 1, and the tokens are on the device: for each (rows, tokens, index),
        row rows[j] decodes tokens[index[j]] (a Sampled.tokens)."""
        b = bucket(span, self.buckets)
        turn = self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # its last copy ran long ago: two steps back
        host = self._hosts[turn]
        # numpy views of the pinned host buffers: element writes cost ~100 ns, not a torch call.
        tokens, positions, slots = (self._nps[turn][k] for k in ("tokens", "positions", "token_slots"))
        tokens[:b] = 0
        positions[:b] = self.model.kv.kept[:b]  # free rows: past what they keep for the prefix cache
        for row in self.model.kv.busy - running.keys():  # held, not decoded: keep their keys
            if row < b:
                positions[row] = self.model.kv.max_len - 1
        slots[:b] = -1
        ahead = 1 if sampled is not None else 0
        max_pos = 0
        adapters = set()
        for row, req in running.items():
            if not ahead:
                tokens[row] = req.output_ids[-1]
            positions[row] = p = req.position + ahead
            slots[row] = req.slot
            max_pos = max(max_pos, p)
            if req.slot >= 0:
                adapters.add(req.slot)
        for k, h in host.items():
            self._dev[k][:b].copy_(h[:b], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        for rows, values, index in sampled or ():
            rows_d, index_d = (to_device(v, torch.int64, self.device) for v in (rows, index))
            self._dev["tokens"].index_copy_(0, rows_d, values.index_select(0, index_d))
        kv_len = self.kv_len_for(max_pos)
        max_adapters = adapter_bucket(len(adapters))
        if max_adapters and not self.bound_adapters:
            max_adapters = None
        # The layer groups the running adapters target: a group none of them does is not launched.
        groups = self.model.lora.groups_of(adapters) if self.model.lora is not None else 0
        args = (self._dev["tokens"][:b], self._dev["positions"][:b], self._dev["token_slots"][:b], kv_len,
                max_adapters, groups)
        self.last_args = args
        if not self.use_graphs:
            return self.model.decode(*args)
        key = (b, kv_len, -1 if max_adapters is None else max_adapters, groups)
        if key not in self._graphs:
            self._graphs[key] = self._capture(args)
        graph, out = self._graphs[key]
        self.last_key = key
        graph.replay()
        return out

    def warm_up(self) -> int:
        """Before the first request, with graphs: run each of `warmup_plan`'s decode steps, so
        every decode kernel compiles now and not in a serving step (a step that compiles stalls
        every running request 0.8-2.9 s on an H200), and on CUDA capture its graph, so no
        serving step stalls for a capture either (52-184 ms each;
        bench/results/engine_h200_kv_buckets_notes.md). A capture runs its step eagerly first,
        which is where the kernels compile. Steps of adapters run once per mask of
        `warmup_masks`; a step whose adapters' groups make another mask is captured when first
        seen. The steps write K/V only at the empty rows' position. Returns the steps run."""
        if not self.use_graphs:
            return 0
        masks = self.warmup_masks()
        steps = [(b, adapters, mask) for b, adapters in warmup_plan(self.buckets, self.model.lora.num_slots)
                 for mask in (masks if adapters else [0])]
        for b, adapters, mask in steps:
            args = self._warmup_args(b, adapters, mask)
            if self.device.type != "cuda":
                self.model.decode(*args)
                continue
            key = (b, args[3], adapters, mask)
            if key not in self._graphs:
                self._graphs[key] = self._capture(args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(steps)

    def warmup_masks(self) -> list[int]:
        """The layer-group masks (adapters.group_mask) whose adapter steps a warm-up captures:
        every held group first (a step whose adapters cover them all), then the mask of each
        adapter in a slot now (those a server starts with, --lora-modules: PEFT's default, q
        and v alone, runs the q/k/v group alone), so a step of such adapters replays at once."""
        lora = self.model.lora
        masks = [lora.held_mask]
        for mask in lora.group_masks:
            if mask and mask not in masks:
                masks.append(mask)
        return masks

    def _warmup_args(self, b: int, adapters: int, mask: int) -> tuple:
        """A warm-up step's decode arguments, its inputs in the static buffers (as a graph reads
        them): token 0 on every row at the empty rows' position, the rows spread over
        min(adapters, slots) distinct slots (-1 without adapters), the groups of `mask`."""
        lora = self.model.lora
        self._dev["tokens"][:b].zero_()
        self._dev["positions"][:b].fill_(self.model.kv.max_len - 1)
        slots = self._dev["token_slots"][:b]
        if adapters:
            slots.copy_(torch.arange(b, device=self.device, dtype=torch.int32) % max(min(adapters, lora.num_slots), 1))
        else:
            slots.fill_(-1)
        kv_len = kv_bucket(0, self.kv_block, self.model.kv.max_len, True)
        return (self._dev["tokens"][:b], self._dev["positions"][:b], slots, kv_len, adapters,
                mask if adapters else 0)

    def rerun_eager(self) -> torch.Tensor:
        """The last step's decode again, eagerly (for checking graphs: it rewrites the same K/V)."""
        return self.model.decode(*self.last_args)

    def _capture(self, args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture model.decode on the current inputs. The warm-up runs compute exactly what
        this step's replay computes (same inputs, same KV writes), so they change nothing."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        b = args[0].shape[0]
        if self._logits is None:
            self._logits = torch.empty(self.max_rows, self.model.cfg.vocab_size, dtype=torch.float32,
                                       device=self.device)
        graph = capture_graph(lambda: self.model.decode(*args), self._logits[:b], self.pool, self.capture_guard)
        log.debug("captured decode graph: batch %d, kv_len %d, adapters %s", b, args[3], args[4])
        return graph, self._logits[:b]
