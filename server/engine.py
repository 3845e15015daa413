"""The engine: the step loop (`LLMEngine.step`) and its asyncio face (`AsyncEngine`).

One step::

    aborted/finished requests leave the batch     (KV rows and adapter refs freed)
    scheduler admits waiting requests             (each gets a KV row)
    prefill the admitted prompts                  -> first token of each (and prompt logprobs: echo)
      (--enable-chunked-prefill: at most max_prefill_tokens of them, a long prompt in chunks
       over several steps; only its last chunk samples its first token)
    decode every running row, one token each      (CUDA graph on the GPU)
    penalise, sample, logprobs (one host sync), detokenize, check stops -> RequestOutputs

`AsyncEngine` runs steps in one background thread; requests, aborts and adapter installs
reach it through a command queue and are applied between steps, so the model's buffers are
only touched by that thread. Outputs go back to each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import queue
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter_format import CONFIG_FILE as ADAPTER_CONFIG_FILE
from .adapter_format import AdapterError, BaseSpec
from .adapter_cache import AdapterCache
from .adapters import LoRABuffers, slot_groups
from .batch import DecodeRunner, LookAhead, adapter_bucket, pack_prefill, warm_up_prefill
from .cache_metrics import CacheMetrics
from .config import ModelConfig, named_shape
from .kv_cache import KVCache
from .metrics import EngineMetrics
from .model import LlamaModel
from .prefill_graphs import PrefillGraphs
from .prefix_cache import PrefixCache
from .prefix_store import HostPrefixStore
from .plan_watch import PlanWatcher
from .request import Request, RequestOutput, State
from .sampling import Sampled, Sampler, SamplingParams, to_device
from .scheduler import Scheduler
from .settings import ServerSettings
from .slot_sizing import memory_budget, resolve_max_loras
from .structured import Grammars, GrammarState
from .tokenizer import Tokenizer, check_tokenizer
from .weights import check_checkpoint, dummy_weights, load_weights

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# The engine loop shares the GIL with adapter-load workers and HTTP threads. When a step
# comes back from the GPU it asks for the GIL, and a thread holding it may run for up to
# the switch interval (5 ms by default, most of a 7 ms decode step) before it lets go.
GIL_SWITCH_INTERVAL_S = 0.0005


def freeze_start_up_objects() -> None:
    """Put every object alive now out of the garbage collector's walks (`gc.freeze`), once a
    server has started: the engine, its model and compiled kernels, the web app and the
    libraries it imported live as long as the process. Left in, a full collection walks them
    all, and any burst of allocations can trigger one, on whichever thread allocates, the
    decode loop's included. Measured on the CPU (bench/results/disk_read_cpu.json: a process
    that has imported the engine, 170,500 objects): a full collection 106 ms, 0 ms once
    frozen. Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()


class RequestError(ValueError):
    """A request the engine cannot take (prompt too long, bad parameters)."""


class UnknownModelError(KeyError):
    """The request names an adapter that is known nowhere (no slot, host copy, disk or source)."""


class RequestFailedError(RuntimeError):
    """A queued request ended with an error (its adapter failed to load; its structured
    output's grammar allowed no next token); others go on. `code` names which."""

    def __init__(self, message: str, code: str = "adapter_load_failed"):
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> int:
        """The client's error (400) where its own grammar dead-ended; else the server's (500)."""
        return 400 if self.code == "grammar_dead_end" else 500


class EngineStoppedError(RuntimeError):
    """The engine loop crashed while the request was queued or running: the server serves
    nothing more (503 until it is restarted; /healthz says so)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: not a device (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device here (torch {torch.__version__}); use cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_settings(settings: ServerSettings) -> None:
    """The checks `LLMEngine.from_settings` (or the first request) would fail on, made before
    anything loads, so the CLI answers a wrong device, kernel backend, model folder (no
    config.json, no readable safetensors), dummy shape or adapter path, or buffers larger than
    the device's memory, with one line (ValueError) instead of a failed server start."""
    device = resolve_device(settings.device)
    if settings.kernel_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        # add_lora would raise at the first adapter request, inside a step: the engine would stop.
        raise ValueError("--kernel-backend triton on the CPU runs only under the Triton interpreter: set "
                         "TRITON_INTERPRET=1 in the environment, or use --kernel-backend auto or torch")
    if settings.model:
        cfg = ModelConfig.from_dir(settings.model)
        check_tokenizer(settings.model)
        if not settings.dummy_weights:
            check_checkpoint(settings.model)
    else:
        cfg = named_shape(settings.dummy_weights)
    for item in settings.lora_modules:
        name, path = item.split("=", 1)
        if not (Path(path) / ADAPTER_CONFIG_FILE).is_file():
            raise ValueError(f"--lora-modules {name}={path}: no {ADAPTER_CONFIG_FILE} there")
    check_memory(settings, cfg, resolve_dtype(settings.dtype, device),
                 device_memory(device, settings.gpu_memory_utilization),
                 by_utilization=device.type == "cuda" and settings.gpu_memory_utilization is not None)


def device_memory(device: torch.device, utilization: float | None = None) -> int:
    """Bytes the engine may allocate on `device`: the CUDA device's free memory (with
    `utilization`, --gpu-memory-utilization: that fraction of its total, less what is in use
    already), or the host's physical memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free if utilization is None else memory_budget(free, total, utilization)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(settings: ServerSettings, cfg: ModelConfig, dtype: torch.dtype, memory: int,
                 by_utilization: bool = False) -> None:
    """ValueError unless the base weights, the KV cache and (with --max-loras) the adapter
    slots fit in `memory` bytes. The cache is allocated whole at start, one row of
    max-model-len tokens per sequence of max-num-seqs (kv_cache.py): vLLM's habit of 256
    sequences of 8,192 tokens asks 275 GB of Llama-3-8B's, which would fail only after the
    weights loaded, with an out-of-memory traceback. So would slots asked beyond the memory
    (--max-loras 0 sizes them from what is left, and always fits)."""
    max_len = min(settings.max_model_len, cfg.max_position_embeddings)
    row = max_len * KVCache.bytes_per_token(cfg, dtype)
    weights = cfg.num_params() * torch.empty((), dtype=dtype).element_size()
    kv = settings.max_num_seqs * row
    slot = LoRABuffers.slot_bytes(cfg, settings.max_lora_rank, dtype, slot_groups(settings.lora_target_modules))
    slots = settings.max_loras * slot
    if weights + kv + slots <= memory:
        return
    have = (f"--gpu-memory-utilization {settings.gpu_memory_utilization} leaves {memory / 1e9:.1f} GB"
            if by_utilization else f"the device has {memory / 1e9:.1f} GB")
    if weights >= memory:
        raise ValueError(f"the base's weights need {weights / 1e9:.1f} GB in {str(dtype).removeprefix('torch.')} "
                         f"and {have}")
    if weights + kv > memory:
        raise ValueError(
            f"--max-num-seqs {settings.max_num_seqs} x --max-model-len {max_len}: the KV cache needs "
            f"{kv / 1e9:.1f} GB (allocated whole at start) besides {weights / 1e9:.1f} GB of weights, and "
            f"{have}; at most {(memory - weights) // row} rows of {max_len} tokens fit: lower --max-num-seqs "
            f"or --max-model-len")
    raise ValueError(
        f"--max-loras {settings.max_loras} x --max-lora-rank {settings.max_lora_rank}: the adapter slots need "
        f"{slots / 1e9:.1f} GB ({slot / 1e6:.1f} MB each) besides {weights / 1e9:.1f} GB of weights and "
        f"{kv / 1e9:.1f} GB of KV cache, and {have}; at most {(memory - weights - kv) // slot} slots fit: lower "
        f"--max-loras or --max-lora-rank (--max-loras 0 sizes them from free memory)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class EngineParts:
    """What an engine is built from; `from_settings` makes one from the command line."""

    cfg: ModelConfig
    model_name: str
    tokenizer: Tokenizer | None
    settings: ServerSettings


class LLMEngine:
    def __init__(self, settings: ServerSettings, cfg: ModelConfig, weights, tokenizer: Tokenizer | None,
                 model_name: str, metrics: EngineMetrics | None = None):
        self.settings = settings
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.cfg = cfg
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.max_model_len = min(settings.max_model_len, cfg.max_position_embeddings)
        self.kv = KVCache(cfg, settings.max_num_seqs, self.max_model_len, self.device, self.dtype)
        self.metrics = metrics or EngineMetrics()
        # Slots hold the layer groups of the projections this server serves (slot_groups).
        groups = slot_groups(settings.lora_target_modules)
        slots = resolve_max_loras(settings.max_loras,
                                  LoRABuffers.slot_bytes(cfg, settings.max_lora_rank, self.dtype, groups), self.device,
                                  settings.gpu_memory_utilization)
        self.lora = LoRABuffers(cfg, slots, settings.max_lora_rank, self.device, self.dtype, groups)
        # GPU slots paged over host memory, local disk and a source (adapter_cache.py).
        self.adapters = AdapterCache.from_settings(self.lora, BaseSpec(
            num_layers=cfg.num_layers, module_shapes=cfg.module_shapes(), max_rank=settings.max_lora_rank,
            allowed_modules=tuple(settings.lora_target_modules)), settings, CacheMetrics(self.metrics.registry),
            base_name=model_name)
        self.stalled = False  # the last step found only requests waiting for adapter loads
        self.model = LlamaModel(cfg, weights, self.kv, self.lora, settings.kernel_backend,
                                fused_ops=None if settings.fused_ops else False,
                                triton_gemm=None if settings.triton_gemm else False)
        self.decoder = DecodeRunner(self.model, settings.max_num_seqs, settings.kv_block, settings.cuda_graphs)
        self.metrics.describe_kv_cache(settings.kv_block, self.kv.rows, self.kv.max_len,
                                       str(self.dtype).removeprefix("torch."), settings.enable_prefix_caching)
        self.decoder.capture_guard = self.adapters.cuda_lock
        # Small prefill steps replay CUDA graphs too, in the decode graphs' memory pool.
        self.prefill_graphs = PrefillGraphs(self.model, settings.max_num_seqs, settings.max_prefill_tokens,
                                            settings.cuda_graphs)
        self.prefill_graphs.capture_guard = self.adapters.cuda_lock
        if self.prefill_graphs.use_graphs:
            self.decoder.pool = self.prefill_graphs.pool = torch.cuda.graph_pool_handle()
        # Prefix caching: a prompt's first tokens found in a KV row (of the same adapter slot
        # and load of it, or the base) are copied, not prefilled (prefix_cache.py).
        store = None
        if settings.enable_prefix_caching and settings.kv_offloading_size:
            store = HostPrefixStore(self.kv, int(settings.kv_offloading_size * 2**30))
            log.info("KV offloading: %.2f GB of host memory, %d blocks of 16 tokens", store.nbytes / 1e9,
                     store.num_blocks)
        self.prefixes = PrefixCache(self.kv, store) if settings.enable_prefix_caching else None
        self.scheduler = Scheduler(self.kv, settings.max_prefill_tokens,
                                   chunked_prefill=settings.enable_chunked_prefill, prefixes=self.prefixes,
                                   prefix_key=self.prefix_key)
        log.info("KV cache %.2f GB (%d rows x %d tokens), adapter slots %.2f GB (%d x rank %d)",
                 self.kv.nbytes() / 1e9, self.kv.rows, self.kv.max_len, self.lora.nbytes() / 1e9,
                 self.lora.num_slots, self.lora.max_rank)
        self.sampler = Sampler()
        # Each decode step launched before the last one's tokens reach the host (settings:
        # decode_look_ahead; CUDA only, where launches are asynchronous). Tests turn it on on
        # the CPU to check the bookkeeping. Steps that took a look-ahead's logits, and
        # look-aheads a step could not use (it decoded a row they did not cover).
        self.look_ahead = settings.decode_look_ahead and self.device.type == "cuda"
        self._ahead: LookAhead | None = None
        self.look_ahead_hits = self.look_ahead_misses = 0
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(eos))
        # Structured outputs' grammars over this model's vocabulary (None without a tokenizer:
        # a grammar matches text). Built on the first request that asks for one.
        self.grammars = Grammars(tokenizer, cfg.vocab_size, self.eos_ids) if tokenizer is not None else None
        self._rng = random.Random(settings.seed)
        self._ids = itertools.count()
        # Requests ended between steps (aborted, failed), queued or running: `_reap` takes them
        # out of the queue without reading all of it (a queued request ends no other way).
        self._ended: list[Request] = []

    @classmethod
    def from_settings(cls, settings: ServerSettings, metrics: EngineMetrics | None = None) -> "LLMEngine":
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        tokenizer = None
        if settings.model:
            path = Path(settings.model)
            cfg = ModelConfig.from_dir(path)
            if (path / "tokenizer.json").is_file():
                tokenizer = Tokenizer(path)
            else:
                log.warning("%s has no tokenizer.json: only token-id prompts will work", path)
            name = settings.served_model_name or path.name
        else:
            cfg = named_shape(settings.dummy_weights)
            name = settings.served_model_name or settings.dummy_weights
        t0 = time.perf_counter()
        if settings.dummy_weights or not settings.model:
            weights = dummy_weights(cfg, device, dtype, seed=settings.seed)
        else:
            weights = load_weights(settings.model, cfg, device, dtype)
        log.info("base %s: %.2f GB of %s weights on %s in %.1fs", name, weights.nbytes() / 1e9,
                 str(dtype).removeprefix("torch."), device, time.perf_counter() - t0)
        engine = cls(settings, cfg, weights, tokenizer, name, metrics)
        for item in settings.lora_modules:
            lora_name, lora_path = item.split("=", 1)
            try:
                engine.adapters.load(lora_name, lora_path)
            except AdapterError as e:  # one that does not fit is refused; the rest are served
                log.error("adapter %s (%s) refused: %s", lora_name, lora_path, e)
        if settings.warmup:
            engine.warm_up()
        return engine

    def warm_up(self) -> tuple[int, int]:
        """Compile every kernel configuration a serving step can launch, before the first
        request (CUDA only: a no-op elsewhere): the prefills of `warm_up_prefill`, then the
        decode steps of `DecodeRunner.warm_up`, which also captures their decode graphs.
        Returns (prefills, decode steps) run."""
        if self.device.type != "cuda":
            return 0, 0
        t0 = time.perf_counter()
        s = self.settings
        # A step prefills at most max_prefill_tokens, but one prompt may exceed it alone.
        longest = s.max_prefill_tokens
        if not s.enable_chunked_prefill:
            longest = max(longest, self.max_model_len - 1)
        prefills = warm_up_prefill(self.model, longest)
        steps = self.decoder.warm_up()
        graphs = self.prefill_graphs.warm_up(self.decoder.warmup_masks())
        log.info("warm-up: %d prefills and %d decode steps (every kernel compiled), %d decode and %d prefill graphs "
                 "captured, in %.1fs", prefills, steps, self.decoder.num_graphs, graphs, time.perf_counter() - t0)
        return prefills, steps

    # -- requests --------------------------------------------------------------------------

    def make_request(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None,
                     request_id: str | None = None) -> Request:
        """Check a request and hold its adapter; raises RequestError or UnknownModelError."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; this model's maximum context length is {self.max_model_len} tokens")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds this model's "
                f"maximum context length of {self.max_model_len} tokens")
        self.check_token_ids(prompt_ids)
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.cfg.vocab_size]
            if bad:
                raise RequestError(f"logit_bias token ids {sorted(bad)[:5]} are outside the vocabulary "
                                   f"(size {self.cfg.vocab_size})")
        if params.allowed_ids is not None and params.grammar is None:
            # Tokens the first step may not sample: one-token bad words, and before min_tokens
            # the stop tokens. Where they hold every allowed token, nothing is left to sample
            # (a grammar would win over them: Sampler.launch).
            never = {w[0] for w in params.bad_words_ids if len(w) == 1}
            if params.min_tokens > 0:
                never |= set(params.stop_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            if never.issuperset(params.allowed_ids.tolist()):
                raise RequestError("allowed_token_ids leaves no token to sample: each is a one-token bad word"
                                   + (", or a stop token before min_tokens" if params.min_tokens else ""))
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        # Any int64 (the API's range) as itself, and one past its ends (a seed + j of n choices)
        # wrapped around 64 bits: distinct seeds draw distinct samples.
        seed = (seed + (1 << 63)) % (1 << 64) - (1 << 63)
        req = Request.new(request_id or f"req-{next(self._ids)}", prompt_ids, params, adapter, seed, self.tokenizer)
        if params.grammar is not None:
            req.grammar = GrammarState(params.grammar, self.eos_ids + tuple(sorted(params.stop_ids)))
        if adapter is not None:
            try:
                req.slot = self.adapters.acquire(adapter)
            except KeyError:
                raise UnknownModelError(adapter) from None
        return req

    def prefix_key(self, req: Request) -> Hashable:
        """What a request's K/V is computed under, for the prefix cache: what identifies the
        weights in its adapter's slot (the files they were read from: an adapter paged out and
        back in, into any slot, finds its prefixes again), else the slot and the count of its
        writes (another adapter, or another version, loaded there since is another key);
        (-1, 0) for the base."""
        if req.slot < 0:
            return (-1, 0)
        content = self.lora.contents[req.slot]
        return content if content is not None else (req.slot, self.lora.writes[req.slot])

    def check_token_ids(self, ids: list[int]) -> None:
        """RequestError unless every id is in the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (size {self.cfg.vocab_size})")

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)
        if req.adapter is not None and req.slot < 0:
            # Its load may have failed between `make_request` (which started it) and now, and a
            # step may have taken that failure already: then fail it here (the next step reaps it).
            error = self.adapters.failed_load(req.adapter)
            if error is not None:
                req.fail(error)
                self._ended.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.scheduler.find(request_id)
        if req is not None and not req.finished:
            req.abort()
            self._ended.append(req)
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._reap() + self._fail_loads()
        # Requests whose adapter is still loading stay queued; the batch goes on without them.
        running = {r.adapter for r in self.scheduler.running.values() if r.adapter}
        # Whole prompts of the admitted requests, or (chunked prefill) chunks of them.
        store = self.prefixes.store if self.prefixes is not None else None
        looked_up = (self.prefixes.queries, self.prefixes.hits) if self.prefixes is not None else None
        moved = (store.loaded_tokens, store.saved_tokens) if store is not None else None
        chunks = self.scheduler.schedule(self.adapters.ready_slots(running))
        if looked_up is not None:  # what this step's admissions looked up and found
            self.metrics.prefix_queries.inc(self.prefixes.queries - looked_up[0])
            self.metrics.prefix_hits.inc(self.prefixes.hits - looked_up[1])
        if moved is not None:  # and what they moved to and from the host tier
            self.metrics.offload_hits.inc(store.loaded_tokens - moved[0])
            self.metrics.offload_saved.inc(store.saved_tokens - moved[1])
        for c in chunks:
            if c.pos == c.req.cached_tokens:  # its first chunk: it was admitted now
                self.metrics.queue_seconds.observe(time.monotonic() - c.req.arrival)
        # Rows mid chunked prefill have no token yet: they are not decoded.
        decoding = {row: r for row, r in self.scheduler.running.items() if r.output_ids}
        prefilled: list[Request] = []  # prompts completed this step
        launched: list[tuple[list[Request], Sampled]] = []  # sampling queued on the device, per batch
        if chunks:
            tokens, slots, seqs = pack_prefill(chunks)
            reqs = [c.req for c in chunks]
            max_adapters = adapter_bucket(len({r.slot for r in reqs if r.slot >= 0}))
            groups = self.lora.groups_of(r.slot for r in reqs)
            # echo with logprobs: those prompts' own logprobs come out of the prefill too (such a
            # prompt is never chunked: the scheduler prefills it whole).
            wanted = {i: r.params.prompt_logprobs for i, r in enumerate(reqs)
                      if r.params.prompt_logprobs is not None}
            if not wanted and self.prefill_graphs.enabled and self.prefill_graphs.takes(len(tokens), len(seqs)):
                logits, prompt_logprobs = self.prefill_graphs.run(tokens, slots, seqs, max_adapters, groups), {}
            else:
                # Sent without waiting for the device's queue: a decode step launched ahead may be in it.
                tokens_d = to_device(tokens, torch.int64, self.device)
                slots_d = to_device(slots, torch.int32, self.device)
                if wanted:
                    logits, prompt_logprobs = self.model.prefill(tokens_d, slots_d, seqs, max_adapters, wanted, groups)
                else:
                    logits, prompt_logprobs = self.model.prefill(tokens_d, slots_d, seqs, max_adapters,
                                                                 lora_groups=groups), {}
            last = [i for i, c in enumerate(chunks) if c.last]  # only these sample a first token
            self.scheduler.prefilled(chunks)
            for i in last:
                reqs[i].prefilled(prompt_logprobs.get(i))
                prefilled.append(reqs[i])
            rows = [i for i in last if not reqs[i].finished]  # max_tokens 0: done already
            if rows:
                launched.append(([reqs[i] for i in rows], self._launch_sample([reqs[i] for i in rows], logits, rows)))
            self.metrics.prompt_tokens.inc(len(tokens))
        ahead, self._ahead = self._ahead, None
        if decoding:
            if ahead is not None and ahead.covers(decoding):
                logits = ahead.logits
                self.look_ahead_hits += 1
            else:
                if ahead is not None:
                    self.look_ahead_misses += 1
                logits = self.decoder.run(decoding, self.kv.span())
            reqs = list(decoding.values())
            launched.append((reqs, self._launch_sample(reqs, logits, list(decoding))))
        if self.look_ahead and launched:
            self._ahead = self._look_ahead(launched)
        for reqs, sampled in launched:
            tokens, logprobs = sampled.result()
            for req, tok, lp in zip(reqs, tokens, logprobs):
                req.append(tok, self.eos_ids, self.max_model_len, lp)
            self.metrics.generation_tokens.inc(len(reqs))
        outputs += [r.take_output() for r in itertools.chain(prefilled, decoding.values())]
        outputs += self._reap()
        # A step that ran nothing waits for an adapter load to finish (the cache wakes the loop),
        # unless the cache is draining a slot for a starved load: the drain gives the slot up (and
        # starts that load) only at a step's ready_slots, so one more step must come.
        self.stalled = not chunks and not decoding and self.adapters.table.draining is None
        m = self.metrics
        if chunks or decoding:  # a step that ran nothing (woken while loads are awaited) is no step
            m.step_seconds.observe(time.perf_counter() - t0)
        m.running.set(len(self.scheduler.running))
        m.waiting.set(len(self.scheduler.waiting))
        return outputs

    def _launch_sample(self, reqs: list[Request], logits: torch.Tensor, rows: list[int]) -> Sampled:
        return self.sampler.launch(logits, [r.params for r in reqs], [r.seed for r in reqs],
                                   [len(r.output_ids) for r in reqs], rows, [r.output_ids for r in reqs],
                                   [r.distinct_prompt_ids if r.params.repetition_penalty != 1 else None for r in reqs],
                                   [r.banned_tokens(self.eos_ids) for r in reqs], [r.grammar for r in reqs])

    def _look_ahead(self, launched: list[tuple[list[Request], Sampled]]) -> LookAhead | None:
        """Launch the next step's decode now, on the tokens just sampled, still on the device:
        every request of `launched` one token further (a request its next token surely ends,
        by max_tokens or the context length, left out). The next step takes its logits if the
        rows it decodes are among these, each one token further, which is the case unless a
        request joined the batch some other way."""
        rows: dict[int, Request] = {}
        sampled = []
        for reqs, s in launched:
            keep = [j for j, r in enumerate(reqs)
                    if not r.finished and not r.next_token_ends_by_length(self.max_model_len)]
            if keep:
                sampled.append(([reqs[j].row for j in keep], s.tokens, [s.rows[j] for j in keep]))
                rows.update((reqs[j].row, reqs[j]) for j in keep)
        if not rows:
            return None
        positions = {row: r.position + 1 for row, r in rows.items()}
        return LookAhead(rows, positions, self.decoder.run(rows, self.kv.span(), sampled))

    def _reap(self) -> list[RequestOutput]:
        """Remove finished and aborted requests; return the final outputs of aborted ones
        (finished ones already reported theirs)."""
        done = list({id(r): r for r in itertools.chain(self._ended, self.scheduler.running.values())
                     if r.finished}.values())
        self._ended = []
        self.scheduler.remove_all(done)
        outputs = []
        for req in done:
            if req.adapter is not None:
                self.adapters.release(req.adapter)
            if req.finish_reason in ("abort", "error"):
                outputs.append(req.take_output())
                if req.finish_reason == "abort":
                    self.metrics.aborted.inc()
        return outputs

    def _fail_loads(self) -> list[RequestOutput]:
        """Queued requests whose adapter failed to load end with the load's error (only them,
        found through `Scheduler.waiting_for`: the failed adapters' requests are read, not the
        queue, which may hold 10,000 requests of other adapters)."""
        failures = self.adapters.take_failures()
        if not failures:
            return []
        for name, error in failures.items():
            for req in self.scheduler.waiting_for(name):
                if req.state is State.WAITING:  # not ended since (an abort: FINISHED)
                    req.fail(error)
                    self._ended.append(req)
        return self._reap()

    def fail_all(self, error: str) -> None:
        """The engine has stopped (its loop crashed): end every request it still holds with
        `error`, which frees their KV rows and adapter references, and set the gauges to what
        is now true (nothing runs or waits), so that /metrics, which can no longer ask the
        engine thread, does not go on showing the moment it died."""
        for req in itertools.chain(self.scheduler.waiting, self.scheduler.running.values()):
            if not req.finished:
                req.fail(error)
            self._ended.append(req)
        self._reap()
        self.metrics.refresh(self)

    def lora_state(self) -> tuple[list[str], list[str]]:
        """(running adapters, waiting adapters) by name, for the inference-extension metric:
        the scheduler's per-adapter counts, so a scrape costs O(adapters) however long the
        queue (walking it took 0.36 ms of the engine thread at 10,000 queued)."""
        return self.scheduler.lora_state()


class AsyncEngine:
    """Runs `LLMEngine.step` in a background thread and streams outputs to coroutines."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # `call`s queued and not run yet: a crash of the loop fails them (else they wait forever).
        self._calls: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self.plan_watcher: PlanWatcher | None = None
        # A finished adapter load wakes a loop that waits with only loading requests queued.
        engine.adapters.wake = lambda: self._commands.put(_noop)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.engine.settings.plan_file:  # the operator's pinned set, followed while serving
            self.plan_watcher = PlanWatcher(self.engine.settings.plan_file, self.engine.adapters.apply_plan)
            self.plan_watcher.start()
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self.plan_watcher is not None:
            self.plan_watcher.stop()
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        # Its loads, stagings and pin retries end with the engine (a pin whose load failed was
        # retried on a timer, for ever, after the server stopped).
        self.engine.adapters.close()

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                # Block while idle or stalled on adapter loads; otherwise apply whatever arrived
                # and take a step.
                if not eng.has_work() or eng.stalled:
                    self._commands.get()()
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                if eng.has_work():
                    for out in eng.step():
                        self._deliver(out)
        except BaseException as e:  # surface the crash to every waiting client and to /healthz
            log.exception("engine loop crashed")
            self.error = e
            for rid in list(self._streams):
                self._deliver(e, rid)
            stopped = RuntimeError(f"the engine has stopped: {e!r}")
            for loop, fut in list(self._calls):  # a call queued after this raises in _submit
                loop.call_soon_threadsafe(_set_exception, fut, stopped)
            try:
                eng.fail_all(str(stopped))
            except Exception:  # the crash may have left the batch half updated
                log.exception("could not release the stopped engine's requests")

    def _deliver(self, out, request_id: str | None = None) -> None:
        stream = self._streams.get(request_id or out.request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _submit(self, fn: Callable[[], None]) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine has stopped: {self.error!r}")
        self._commands.put(fn)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None,
                    request_id: str | None = None) -> "RequestStream":
        """Check the request now (RequestError, UnknownModelError), queue it, and return the
        stream of its outputs. Call from the event loop's thread."""
        req = self.engine.make_request(prompt_ids, params, adapter, request_id)
        stream = RequestStream(self, req.request_id)
        self._streams[req.request_id] = stream
        try:
            self._submit(lambda: self.engine.add_request(req))
        except RuntimeError:
            self._streams.pop(req.request_id, None)
            if adapter is not None:
                self.engine.adapters.release(adapter)
            raise
        return stream

    async def generate(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving early (client gone) aborts it."""
        async for out in self.add_request(prompt_ids, params, adapter, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        if self.error is None:
            self._commands.put(lambda: self.engine.abort(request_id))

    async def call(self, fn: Callable[[], object]):
        """Run `fn` in the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        entry = (loop, fut)

        def run() -> None:
            self._calls.discard(entry)
            try:
                result = fn()
            except BaseException as e:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._calls.add(entry)  # before the submit: a crash from now on fails it
        try:
            self._submit(run)
        except BaseException:
            self._calls.discard(entry)
            raise
        return await fut

    async def load_adapter(self, name: str, path: str) -> int:
        """Register the adapter and load it into a slot (evicting an idle one when all are taken),
        off the engine thread; decode steps go on meanwhile."""
        if self.engine.adapters.has(name):
            raise AdapterError(f"adapter {name!r} is already loaded")
        return await asyncio.to_thread(self.engine.adapters.load, name, path)

    async def unload_adapter(self, name: str) -> bool:
        return await self.call(lambda: self.engine.adapters.unload(name))


class RequestStream:
    """The outputs of one request, as an async iterator. Leaving the iteration before the
    final output (an exception, a cancelled task when the client disconnects, or `close`)
    aborts the request: the engine frees its batch row at its next step."""

    def __init__(self, owner: AsyncEngine, request_id: str):
        self.owner = owner
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await self.queue.get()
                if isinstance(out, BaseException):
                    raise EngineStoppedError(f"the engine has stopped: {out!r}")
                if out.error is not None:
                    self.finished = True
                    if self.owner.error is not None:  # ended by the crash (LLMEngine.fail_all)
                        raise EngineStoppedError(out.error)
                    raise RequestFailedError(out.error, out.error_code or "adapter_load_failed")
                self.finished = out.finished
                yield out
        finally:
            self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)
        self.owner._streams.pop(self.request_id, None)


def _noop() -> None:
    pass


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
