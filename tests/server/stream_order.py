"""A checker of the order of copies across CUDA streams, run on the CPU.

The CPU has no streams: a test that swaps in these stand-ins for torch.cuda's streams and
events (and for Tensor.copy_) runs the code it tests eagerly, while the checker keeps, for
each copy, which stream issued it and what it had waited for (a vector clock per stream,
as events carry them), and which buffers it read and wrote. Two copies on different
streams that touch the same buffer, one of them writing, with neither ordered before the
other, are a race a GPU could run either way: `races()` lists them. What a buffer is, is
the test's to say (`label`: a tensor's buffer, or None for one not watched).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch


@dataclass
class Stream:
    name: str
    clock: dict[str, int] = field(default_factory=dict)

    def wait_event(self, event: "Event") -> None:
        for k, v in event.clock.items():
            self.clock[k] = max(self.clock.get(k, 0), v)


@dataclass
class Event:
    clock: dict[str, int] = field(default_factory=dict)

    def record(self, stream: Stream | None = None) -> None:
        self.clock = dict((stream or _current[0]).clock)

    def query(self) -> bool:
        """Never done: what the code must wait for, it waits for here."""
        return False


@dataclass
class Access:
    what: str
    stream: str
    clock: dict[str, int]
    reads: set
    writes: set


_current: list[Stream] = []


class StreamOrder:
    def __init__(self, label: Callable[[torch.Tensor], set[Hashable]]) -> None:
        self.label = label
        self.compute = Stream("compute")
        self.accesses: list[Access] = []
        self._names = itertools.count(1)

    def install(self, monkeypatch) -> None:
        """torch.cuda's current_stream, Stream, Event and stream(), and Tensor.copy_, as
        stand-ins that keep the order (the copy itself still runs, at once)."""
        _current[:] = [self.compute]
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _current[0])
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: Stream(f"side{next(self._names)}"))
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: Event())
        monkeypatch.setattr(torch.cuda, "stream", self._use)
        copy = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            self.access("copy", reads=self.label(src), writes=self.label(dst))
            return copy(dst, src)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)

    @contextlib.contextmanager
    def _use(self, stream: Stream):
        _current.insert(0, stream)
        try:
            yield
        finally:
            _current.pop(0)

    def access(self, what: str, reads=(), writes=()) -> None:
        """An op on the current stream that reads and writes these buffers."""
        stream = _current[0]
        stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
        self.accesses.append(Access(what, stream.name, dict(stream.clock), set(reads), set(writes)))

    @staticmethod
    def _before(a: Access, b: Access) -> bool:
        return a.clock[a.stream] <= b.clock.get(a.stream, 0)

    def races(self) -> list[tuple[str, str, set]]:
        out = []
        for i, a in enumerate(self.accesses):
            for b in self.accesses[i + 1:]:
                if a.stream == b.stream:
                    continue
                shared = (a.writes & (b.reads | b.writes)) | (b.writes & a.reads)
                if shared and not (self._before(a, b) or self._before(b, a)):
                    out.append((f"{a.what}@{a.stream}", f"{b.what}@{b.stream}", shared))
        return out
