"""A --plan-file that is there but cannot be read (permission denied, a path through a regular
file, a symlink loop, a folder at its path): the server starts and serves, as it does while a
plan file is not there yet or does not parse (README, --plan-file: "followed as it changes
without a restart"), with one warning that names the file and the reason, and another only
when the reason changes; never a traceback, at start or once a second. Once the file can be
read, its plan is applied."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from loraplex.server.plan_watch import PlanWatcher

from .conftest import serve_tiny_llama

PLAN = {"pinned": [], "adapters": [], "prefetch": []}
LOGGER = "loraplex.server.plan_watch"


def under_a_file(tmp_path: Path, monkeypatch) -> tuple[Path, str, Callable[[], None]]:
    (tmp_path / "plan").write_text("not a folder")
    path = tmp_path / "plan" / "plan.json"

    def fix():
        (tmp_path / "plan").unlink()
        (tmp_path / "plan").mkdir()
        path.write_text(json.dumps(PLAN))
    return path, "NotADirectoryError", fix


def a_symlink_loop(tmp_path: Path, monkeypatch) -> tuple[Path, str, Callable[[], None]]:
    path = tmp_path / "plan.json"
    path.symlink_to(path.name)

    def fix():
        path.unlink()
        path.write_text(json.dumps(PLAN))
    return path, "Too many levels of symbolic links", fix


def a_folder(tmp_path: Path, monkeypatch) -> tuple[Path, str, Callable[[], None]]:
    """--plan-file naming the ConfigMap's mount folder instead of its key: stat works, read not."""
    path = tmp_path / "plan.json"
    path.mkdir()

    def fix():
        path.rmdir()
        path.write_text(json.dumps(PLAN))
    return path, "IsADirectoryError", fix


def permission_denied(tmp_path: Path, monkeypatch) -> tuple[Path, str, Callable[[], None]]:
    """A folder above the file that the server's user may not search. (The tests run as root,
    whom no mode stops: the refusal os.stat gives that user is made here, for that path.)"""
    path = tmp_path / "secret" / "plan.json"
    path.parent.mkdir()
    path.write_text(json.dumps(PLAN))
    real_stat, denied = os.stat, [True]

    def stat(p, *a, **kw):
        if denied[0] and os.fspath(p) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(p, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)

    def fix():
        denied[0] = False
    return path, "PermissionError", fix


CASES = [under_a_file, a_symlink_loop, a_folder, permission_denied]


def watcher_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_an_unreadable_plan_file_is_one_warning_and_is_followed_once_readable(tmp_path, monkeypatch, caplog, case):
    path, words, fix = case(tmp_path, monkeypatch)
    applied = []
    watcher = PlanWatcher(path, applied.append, interval=0.005)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        watcher.start()  # no exception into the server's start
        try:
            time.sleep(0.3)  # some 60 checks, each finding the same error
            records = watcher_records(caplog)
            assert len(records) == 1, [r.getMessage() for r in records]
            (record,) = records
            assert record.levelno == logging.WARNING and record.exc_info is None  # no traceback
            assert str(path) in record.getMessage() and words in record.getMessage()
            assert "serving without a plan" in record.getMessage()
            assert words in (watcher.last_error or "") and applied == []
            fix()  # the mount fixed: no new mtime is needed for it to be read
            wait_for(lambda: applied == [PLAN])
            assert watcher.last_error is None and watcher.applied == 1
        finally:
            watcher.stop()


def test_a_new_reason_is_said_again_and_the_last_plan_kept(tmp_path, caplog):
    """Unreadable, then fixed and applied, then unreadable for another reason: one warning per
    reason, the second saying the last plan stays."""
    mount = tmp_path / "mount"
    mount.mkdir()
    path = mount / "plan.json"
    path.mkdir()  # a folder where the file should be
    applied = []
    watcher = PlanWatcher(path, applied.append)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(5):
            assert not watcher.check()
        path.rmdir()
        path.write_text(json.dumps(PLAN))
        assert watcher.check() and applied == [PLAN]
        path.unlink()
        path.symlink_to(path.name)  # now a symlink loop
        for _ in range(5):
            assert not watcher.check()
    messages = [r.getMessage() for r in watcher_records(caplog)]
    assert len(messages) == 2, messages
    assert "IsADirectoryError" in messages[0] and "serving without a plan" in messages[0]
    assert "symbolic links" in messages[1] and "keeping the last plan" in messages[1]
    assert applied == [PLAN]


def test_a_server_whose_plan_file_cannot_be_read_starts_and_serves(hf_llama, tmp_path, caplog):
    """Its start used to end in a traceback (the watcher's first check, in the app's start-up):
    no server."""
    (tmp_path / "plan").write_text("not a folder")
    plan_file = tmp_path / "plan" / "plan.json"
    with caplog.at_level(logging.WARNING, logger=LOGGER), \
            serve_tiny_llama(hf_llama, {}, lora_modules=[], plan_file=str(plan_file)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/readyz").status_code == 200
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1, 5, 6], "max_tokens": 2})
        assert r.status_code == 200, r.text
    messages = [r.getMessage() for r in watcher_records(caplog)]
    assert len(messages) == 1 and "NotADirectoryError" in messages[0] and str(plan_file) in messages[0], messages
