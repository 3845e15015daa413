"""The one way the node agent starts background loops: guarded, logged, visible in /healthz.

    tasks = TaskGuard(metrics)
    tasks.spawn(warmer.run(), "warmer")
    ...
    tasks.crashed   # {"warmer": "ValueError: ..."} once a loop has died
    await tasks.close()

A loop that raises is logged with its traceback, counted in the task-crash metric and
recorded; /healthz then answers 500 so the kubelet restarts the agent instead of leaving
a node that silently stopped staging.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from loraplex.node_agent.metrics import Metrics

log = logging.getLogger(__name__)


class TaskGuard:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self._metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self.crashed: dict[str, str] = {}

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        name = task.get_name()
        log.error("background task %s crashed", name, exc_info=exc)
        self.crashed[name] = f"{type(exc).__name__}: {exc}"
        if self._metrics is not None:
            self._metrics.task_crashes.labels(name).inc()

    @property
    def running(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
