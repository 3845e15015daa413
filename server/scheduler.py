"""The scheduler: a waiting queue in front of the running batch.

Every step, finished and aborted requests leave the batch (their KV rows and adapter
references are freed) and waiting requests join it while KV rows are free, up to a budget
of prompt tokens per step. Which waiting requests go first is an `AdmissionPolicy`, a small
strategy object (first come, first served by default), testable without a model.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from .kv_cache import KVCache
from .request import Request, State


class AdmissionPolicy(Protocol):
    def select(self, waiting: deque[Request], free_rows: int, token_budget: int) -> list[Request]:
        """Requests to admit now (removed from `waiting` by the caller)."""


class FcfsPolicy:
    """First come, first served: admit in arrival order until rows or the prompt-token budget
    run out; the queue's head is always admitted when a row is free, however long its prompt,
    so a long prompt cannot starve."""

    def select(self, waiting: deque[Request], free_rows: int, token_budget: int) -> list[Request]:
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


class Scheduler:
    def __init__(self, kv: KVCache, max_prefill_tokens: int, policy: AdmissionPolicy | None = None):
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self.policy = policy or FcfsPolicy()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # KV row -> request

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def find(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        for req in self.running.values():
            if req.request_id == request_id:
                return req
        return None

    def admit(self, ready_slots: dict[str, int] | None = None) -> list[Request]:
        """Move the policy's pick from waiting to running, each with a KV row.

        `ready_slots` ({adapter: slot} of the resident adapters, from the adapter cache): a
        request whose adapter is not in it is still loading and stays in the queue, not the
        batch; the others get their slot. None: every adapter is resident."""
        waiting = self.waiting
        if ready_slots is not None:
            waiting = deque(r for r in waiting if r.adapter is None or r.adapter in ready_slots)
            for req in waiting:
                if req.adapter is not None:
                    req.slot = ready_slots[req.adapter]
        picked = self.policy.select(waiting, self.kv.num_free, self.max_prefill_tokens)
        chosen = set(map(id, picked))
        self.waiting = deque(r for r in self.waiting if id(r) not in chosen)
        for req in picked:
            req.row = self.kv.alloc()
            req.state = State.RUNNING
            self.running[req.row] = req
        return picked

    def remove(self, req: Request) -> None:
        """Take a finished (or aborted) request out of the queue or the batch."""
        if req.row >= 0 and self.running.get(req.row) is req:
            del self.running[req.row]
            self.kv.free(req.row)
            req.row = -1
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
