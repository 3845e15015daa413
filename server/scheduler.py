"""The scheduler: a waiting queue in front of the running batch.

Every step, finished and aborted requests leave the batch (their KV rows and adapter
references are freed) and waiting requests join it while KV rows are free, up to a budget
of prompt tokens per step. Which waiting requests go first is an `AdmissionPolicy`, a small
strategy object (first come, first served by default), testable without a model.

`schedule` plans a step's prefill as `PrefillChunk`s. Without chunked prefill each is a
newly admitted request's whole prompt. With it, a step prefills at most max_prefill_tokens
prompt tokens: first the next chunks of requests admitted earlier whose prompts are not
complete (they hold their KV row and adapter but are not decoded yet), then new requests,
the last one cut to what is left of the budget. Budget 8, a running 20-token prompt with 16
done and a new 30-token one queued -> [chunk(a, pos 16, 4), chunk(b, pos 0, 4)].

With prefix caching (prefix_cache.py) a new request's row comes with the first tokens of its
prompt that another row held, and its prefill starts after them: chunk(b, pos 24, 6) for a
30-token prompt 24 of whose tokens were found. Rows record what they hold as prefills
complete and as requests leave (the prompt and every output token but the last, whose K/V
no step computed). Requests picked in one step that share most of a prompt (n choices, a
burst with one system prompt) are not prefilled side by side: the first goes, the others a
step later, copying its prefill (`_share_prefills`).
"""

from __future__ import annotations

import sys
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from .kv_cache import KVCache
from .prefix_cache import BLOCK, PrefixCache
from .request import Request, State


class AdmissionPolicy(Protocol):
    def select(self, waiting: Iterable[Request], free_rows: int, token_budget: int) -> list[Request]:
        """Requests to admit now, from `waiting` in queue order (removed from the queue by the
        caller). Read only as far as it needs: the queue may hold thousands."""


class FcfsPolicy:
    """First come, first served: admit in arrival order until rows or the prompt-token budget
    run out; the queue's head is always admitted when a row is free, however long its prompt,
    so a long prompt cannot starve."""

    def select(self, waiting: Iterable[Request], free_rows: int, token_budget: int) -> list[Request]:
        picked: list[Request] = []
        used = 0
        for req in waiting:
            if len(picked) == free_rows:
                break
            n = len(req.prompt_ids)
            if picked and used + n > token_budget:
                break
            picked.append(req)
            used += n
        return picked


@dataclass
class PrefillChunk:
    """Prompt tokens pos..pos+length-1 of one request, prefilled this step."""

    req: Request
    pos: int
    length: int

    @property
    def last(self) -> bool:
        """The chunk completes the prompt: its logits give the request's first token."""
        return self.pos + self.length == len(self.req.prompt_ids)


class Scheduler:
    """The queue and the batch. A step's work here grows with what it admits and the batch's
    rows, not with the queue's length: under a burst (a benchmark sending 10,000 requests at
    once) every step used to walk the whole queue three times (about 5 ms a step at 10,000
    queued on a 2-core machine, timed by hand; on an H200's host it hid under the GPU's step,
    bench/results/engine_h200_notes.md), and each abort walked it again to find its request."""

    def __init__(self, kv: KVCache, max_prefill_tokens: int, policy: AdmissionPolicy | None = None,
                 chunked_prefill: bool = False, prefixes: PrefixCache | None = None,
                 prefix_key: Callable[[Request], Hashable] | None = None):
        self.kv = kv
        # Prefix caching (None: off); prefix_key(request): what its K/V is computed under.
        if prefixes is not None and prefix_key is None:
            raise ValueError("prefix caching needs prefix_key: what a request's K/V is computed under")
        self.prefixes = prefixes
        self.prefix_key = prefix_key
        self.max_prefill_tokens = max_prefill_tokens
        self.policy = policy or FcfsPolicy()
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # KV row -> request
        self._ids: dict[str, Request] = {}  # request id -> request, queued or running (`find`)
        # Per adapter name (base-only requests in neither): its queued requests in queue order,
        # by id() (`waiting_for`: a failed load ends them without reading the queue), and how
        # many of its requests the batch holds, e.g. {"sql": 2, "chat": 1}. Kept as requests
        # come and go, so `lora_state` (each /metrics scrape, on the engine thread) reads the
        # adapters, not the queue; a name leaves when it has no request there.
        self._waiting_adapters: dict[str, dict[int, Request]] = {}
        self._running_adapters: Counter[str] = Counter()

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self._ids[req.request_id] = req
        if req.adapter:
            self._waiting_adapters.setdefault(req.adapter, {})[id(req)] = req

    def lora_state(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting requests), each sorted by name;
        O(adapters), not O(requests). A request aborted or finished between steps counts until
        the next step takes it out (`remove_all`), as it holds its row or place until then."""
        return sorted(self._running_adapters), sorted(self._waiting_adapters)

    def find(self, request_id: str) -> Request | None:
        return self._ids.get(request_id)

    def waiting_for(self, adapter: str) -> list[Request]:
        """The queued requests of `adapter`, in queue order; O(its requests), not O(queue)."""
        return list(self._waiting_adapters.get(adapter, {}).values())

    def admit(self, ready_slots: dict[str, int] | None = None) -> list[Request]:
        """Move the policy's pick from waiting to running, each with a KV row.

        `ready_slots` ({adapter: slot} of the resident adapters, from the adapter cache): a
        request whose adapter is not in it is still loading and stays in the queue, not the
        batch; the others get their slot. None: every adapter is resident."""
        picked = self._share_prefills(
            self.policy.select(self._ready(ready_slots), self.kv.num_free, self.max_prefill_tokens))
        self._start(picked)
        return picked

    def schedule(self, ready_slots: dict[str, int] | None = None) -> list[PrefillChunk]:
        """This step's prefill (`ready_slots` as in `admit`): the whole prompts of the admitted
        requests, or with chunked prefill the chunks described in the module docstring."""
        if not self.chunked_prefill:
            return [PrefillChunk(r, r.num_computed, len(r.prompt_ids) - r.num_computed)
                    for r in self.admit(ready_slots)]
        budget = self.max_prefill_tokens
        chunks = []
        for req in self.running.values():  # in admission order (dict insertion order)
            left = len(req.prompt_ids) - req.num_computed
            if left > 0 and budget > 0:
                chunks.append(PrefillChunk(req, req.num_computed, min(left, budget)))
                budget -= chunks[-1].length
        # The policy orders the queue; the budget is cut here, chunk by chunk.
        new = []
        for req in self._share_prefills(self.policy.select(self._ready(ready_slots), self.kv.num_free, sys.maxsize)):
            n = len(req.prompt_ids)
            if req.params.prompt_logprobs is not None:
                # Never chunked (its prompt logprobs come out of one whole prefill): it waits for
                # a step with room for it, or goes alone, however long, when nothing else prefills.
                if n > budget and (chunks or new):
                    break
            else:
                n = min(n, budget)
            if n <= 0:
                break
            new.append(PrefillChunk(req, 0, n))
            budget -= n
        self._start([c.req for c in new])
        for c in new:  # a prompt's cached tokens are not prefilled (the budget counted them)
            c.pos, c.length = c.req.num_computed, min(c.length, len(c.req.prompt_ids) - c.req.num_computed)
        return chunks + new

    def _share_prefills(self, picked: list[Request]) -> list[Request]:
        """`picked` less the requests that wait a step to share an earlier one's prefill: one
        whose prompt has at least half of itself (and a block) in common with the prompt of a
        request picked before it, under the same key, more than a row (or the host tier)
        holds already. Admitted together, both would compute the common part; a step later
        the first one's row holds it, and the other's prefill copies it (n choices of one
        prompt, a burst of requests with one system prompt: the first step prefills one of
        them, not all). The first of each group goes now, so each step admits some of every
        group."""
        if self.prefixes is None or len(picked) < 2:
            return picked
        firsts: dict[tuple, Request] = {}  # (key, first block) -> the first picked request of them
        out = []
        for req in picked:
            tokens = req.prompt_ids
            if len(tokens) > BLOCK:
                key = self.prefix_key(req)
                first = firsts.setdefault((key, tuple(tokens[:BLOCK])), req)
                if first is not req and req.params.prompt_logprobs is None:
                    limit = len(tokens) - 1  # the last token is always prefilled
                    shared = _common_prefix(first.prompt_ids, tokens, limit)
                    if 2 * shared >= len(tokens) and shared >= self.prefixes.found(key, tokens, limit) + BLOCK:
                        continue
            out.append(req)
        return out

    def prefilled(self, chunks: list[PrefillChunk]) -> None:
        """This step's prefill of `chunks` is launched: their prompts' K/V is there up to each
        chunk's end, from the next queued work on (the prefix cache may match it)."""
        for c in chunks:
            c.req.num_computed = c.pos + c.length
            if self.prefixes is not None:
                self.prefixes.keep(c.req.row, c.req.prefix_key, c.req.prompt_ids[: c.req.num_computed])

    def _ready(self, ready_slots: dict[str, int] | None) -> Iterator[Request]:
        """The waiting requests whose adapter is resident, in queue order, each given its slot
        as the policy reads it."""
        for req in self.waiting:
            if req.adapter is not None and ready_slots is not None:
                if req.adapter not in ready_slots:
                    continue
                req.slot = ready_slots[req.adapter]
            yield req

    def _start(self, picked: list[Request]) -> None:
        """Move `picked` from the queue into the batch, each with a KV row. The queue is read
        only up to the last of them (the policy read that far)."""
        chosen = set(map(id, picked))
        skipped = []
        while chosen:
            req = self.waiting.popleft()
            if id(req) in chosen:
                chosen.discard(id(req))
            else:
                skipped.append(req)
        self.waiting.extendleft(reversed(skipped))
        for req in picked:
            if self.prefixes is None:
                req.row = self.kv.alloc()
            else:
                # A prompt whose every token's logprob is asked for is prefilled whole.
                req.prefix_key = self.prefix_key(req)
                req.row, n = self.prefixes.admit(req.prefix_key, req.prompt_ids,
                                                 match=req.params.prompt_logprobs is None)
                req.num_computed = req.cached_tokens = n
            req.state = State.RUNNING
            self.running[req.row] = req
        _unqueue(self._waiting_adapters, picked)
        _count(self._running_adapters, picked, 1)

    def remove(self, req: Request) -> None:
        """Take a finished (or aborted) request out of the queue or the batch."""
        self.remove_all([req])

    def remove_all(self, reqs: Iterable[Request]) -> None:
        """Take finished (or aborted) requests out of the queue or the batch; the queue is
        walked once for all of them (an abort storm between two steps costs one walk)."""
        queued = set()
        ended = []  # the requests taken out of the batch
        for req in reqs:
            if req.row >= 0 and self.running.get(req.row) is req:
                del self.running[req.row]
                if self.prefixes is not None:
                    # Every output token but the last went through a decode step: its K/V is there.
                    done = req.num_computed == len(req.prompt_ids)
                    self.prefixes.keep(req.row, req.prefix_key,
                                       req.prompt_ids[: req.num_computed] + (req.output_ids[:-1] if done else []))
                self.kv.free(req.row)
                req.row = -1
                ended.append(req)
            else:
                queued.add(id(req))
            if self._ids.get(req.request_id) is req:
                del self._ids[req.request_id]
        _count(self._running_adapters, ended, -1)
        if queued:
            # Only those found in the queue leave its counts (one given twice, or never
            # queued, counts nothing).
            kept: deque[Request] = deque()
            gone: list[Request] = []
            for r in self.waiting:
                (gone if id(r) in queued else kept).append(r)
            self.waiting = kept
            _unqueue(self._waiting_adapters, gone)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many first tokens `a` and `b` share, at most `limit`."""
    n, end = 0, min(limit, len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


def _unqueue(by_adapter: dict[str, dict[int, Request]], reqs: Iterable[Request]) -> None:
    """Take requests that left the queue out of their adapter's; a name with none left goes."""
    for req in reqs:
        queued = by_adapter.get(req.adapter) if req.adapter else None
        if queued is not None and queued.pop(id(req), None) is not None and not queued:
            del by_adapter[req.adapter]


def _count(counts: Counter, reqs: Iterable[Request], delta: int) -> None:
    """Add `delta` to the count of each request's adapter (none for a base-only request); a
    name whose count reaches 0 is dropped, so the counter holds exactly the adapters in use."""
    for req in reqs:
        if req.adapter:
            n = counts[req.adapter] + delta
            if n:
                counts[req.adapter] = n
            else:
                del counts[req.adapter]
