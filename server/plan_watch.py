"""Follow the operator's plan file: re-read it when it changes, without a restart.

The plan is a mounted ConfigMap key (operator/plan.py writes it), e.g.
`/etc/loraplex/plan/plan.json`. The kubelet updates such a mount by swapping a symlink
(`..data -> ..2026_05_01_08_00_00.123`), so the file's inode changes while its path does
not: a cheap `stat` (following links) about every second sees (inode, mtime, size) move.
A new plan is parsed, its shape checked, and handed to `apply` (AdapterCache.apply_plan). A
plan that does not parse, or whose fields are not of their shape, is logged and skipped
whole; the last good one stays in force. A good plan whose `apply` fails is tried again at
each check until it is applied, also at start (the server starts serving meanwhile). A plan
file not there yet is waited for (a ConfigMap mounted late); one that cannot be read
(permission denied, a path through a regular file, a folder where the file should be) is
looked at again at each check, and the server serves meanwhile, with the last plan or none:
each of these is said once, with its reason, and again only when the reason changes, never
as a traceback per check. The loop runs in one daemon thread, logs its own failures, and
never dies of one (`last_error` shows it).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from .plan_file import check_plan, decode_plan  # plain or gzipped (the operator gzips a large plan)

log = logging.getLogger(__name__)


class PlanWatcher:
    def __init__(self, path: str | Path, apply: Callable[[dict], None], interval: float = 1.0):
        self.path = Path(path)
        self.apply = apply
        self.interval = interval
        self.applied = 0  # plans applied so far
        self.last_error: str | None = None
        self._seen: tuple[int, int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """Apply the plan if it changed since the last check; True if one was applied."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._seen is not None:
                log.warning("plan file %s is gone; keeping the last plan", self.path)
            self._seen = None
            return False
        except OSError as e:  # PermissionError, NotADirectoryError, a symlink loop...
            self._unreadable(e)
            return False
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return False
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:  # gone since the stat (a mount's swap): the next check reads what replaced it
            self._seen = None
            return False
        except OSError as e:  # a folder at the path, permission denied: not a plan's content
            self._unreadable(e)
            return False
        self._seen = key
        try:
            plan = decode_plan(raw)
            check_plan(plan)  # all of it, before any of it is applied
        except ValueError as e:
            self.last_error = f"{type(e).__name__}: {e}"
            log.error("plan file %s: %s; keeping the last plan", self.path, self.last_error)
            return False
        try:
            self.apply(plan)
        except Exception as e:  # noqa: BLE001 - the plan is good: try it again at the next check
            self._seen = None  # (a plan applied in part is applied again whole: apply_plan is idempotent)
            error = f"{type(e).__name__}: {e}"
            if error != self.last_error:  # once, not every second
                log.exception("applying plan %s failed; trying again every %gs", self.path, self.interval)
            self.last_error = error
            return False
        self.applied += 1
        self.last_error = None
        return True

    def _unreadable(self, e: OSError) -> None:
        """The plan file is there but cannot be read: looked at again at the next check (a fix,
        a chmod say, need not move its mtime); said once per reason, as a warning."""
        self._seen = None
        error = f"{type(e).__name__}: {e}"
        if error != self.last_error:
            log.warning("plan file %s cannot be read (%s); %s, looking again every %gs", self.path, error,
                        "keeping the last plan" if self.applied else "serving without a plan until it can be",
                        self.interval)
        self.last_error = error

    def start(self) -> None:
        self.check()  # the first plan before serving, when there is one
        self._thread = threading.Thread(target=self._run, name="loraplex-plan-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - a bad plan must not stop the watcher
                error = f"{type(e).__name__}: {e}"
                if error != self.last_error:  # once, not every second
                    log.exception("following plan %s failed", self.path)
                self.last_error = error
