"""The last tier of the adapter cache: bring an adapter that is not on local disk onto it.

    fetch_adapter("sql", "s3://bucket/sql-v2", sha, cache_dir, node_agent_url)
      with a node agent:  POST <agent>/v1/stage {"name", "source", "sha256", "dtype"}; the agent
                          downloads, verifies, writes a copy of F32 weights in the slots' dtype
                          and renames into <cache_dir>/sql/ (node_agent/store.py)
      without one:        a local path or file:// source is read in place (sha256 checked);
                          http(s) is downloaded here into <cache_dir>/sql/ (temporary folder,
                          sha256 check, rename: a crash never leaves a half adapter that looks whole;
                          a crash's temporary folder is removed once idle, sweep_abandoned_fetches)

Every failure of a load, here or later (reading, checking, copying), becomes one
`AdapterLoadError` with a clear message and a one-word `reason` for the metrics:
missing, corrupt, mismatch, oom, fetch or other (`load_error`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter_format import (CONFIG_FILE, STAGED_META_FILE, WEIGHTS_FILE, AdapterError, file_digest, fsync_dir,
                             read_config, read_safetensors_header)
from .adapter_names import InvalidAdapterName, check_adapter_name

log = logging.getLogger(__name__)


# The reasons a load fails for (AdapterLoadError.reason): the label values of
# loraplex_adapter_load_failures_total, each series there from the start at 0.
LOAD_FAILURE_REASONS = ("missing", "fetch", "corrupt", "mismatch", "oom", "other")


class AdapterLoadError(RuntimeError):
    """A load failed; only the requests for that adapter fail. `reason` is one word for metrics."""

    def __init__(self, name: str, reason: str, message: str):
        super().__init__(f"adapter {name!r} failed to load: {message}")
        self.adapter = name
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Fetched:
    """An adapter a staging brought onto local disk for its next load (stage first, then a
    slot: AdapterLoader.stage): the version fetched (CachedAdapter.version), its folder (the
    node's cache, or a local source read in place) and the fetch's seconds, which the load's
    time from the "source" tier includes."""

    version: tuple[str, str | None]
    path: Path
    seconds: float


class FetchThreads:
    """Up to `n` daemon threads that run fetch jobs in the order given. A fetch in flight does
    not hold up the server's exit, as a ThreadPoolExecutor's threads would (the interpreter
    joins them): `stop` sets `stopping`, which a direct download sees at its next chunk (it
    ends and removes its temporary folder), waits `grace` seconds for the jobs to end, and
    leaves the rest (a POST to the node agent waits for its answer up to 10 minutes; the
    agent goes on staging) to end with the process. Jobs not started by then never start."""

    def __init__(self, n: int, name: str):
        self.n = max(1, n)
        self.name = name
        self.stopping = threading.Event()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._unfinished = 0  # jobs given and not ended

    def submit(self, fn: Callable[..., None], *args) -> None:
        """Run fn(*args) on one of the threads (it handles its own errors)."""
        if self.stopping.is_set():
            return
        with self._lock:
            self._jobs.put((fn, args))
            self._unfinished += 1
            if self._unfinished > len(self._threads) < self.n:  # started as needed, as an executor's
                t = threading.Thread(target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self.stopping.is_set():
                return
            fn, args = job
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a job's own failure must not end the thread
                log.exception("%s: a fetch job failed", self.name)
            with self._lock:
                self._unfinished -= 1

    def stop(self, grace: float = 2.0) -> None:
        self.stopping.set()
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        deadline = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


def redact(uri: str | None) -> str | None:
    """A source without its query string (tokens, signatures) and its user info (a password)
    for logs, the API and the version record of a fetch."""
    if not uri:
        return uri
    head = uri.split("?", 1)[0]
    scheme, sep, rest = head.partition("://")
    if not sep:
        return head
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"


def fetch_adapter(name: str, source: str | None, sha256: str | None, cache_dir: Path | None,
                  node_agent_url: str | None, missing: Path | None = None, dtype: str | None = None,
                  namespace: str | None = None, stop: threading.Event | None = None,
                  agent_token_file: Path | None = None) -> Path:
    """The adapter's directory on local disk, fetched from `source` (see the module docstring).
    `missing`: where it was looked for, for the error message when there is no source;
    `dtype`: the slots' (the node agent also stages a copy of F32 weights in it); `namespace`:
    the server's Kubernetes namespace (the agent stages it in its folder for that namespace,
    which is `cache_dir` as this server sees it); `stop`: once set (the server stops), a
    download here ends at its next chunk, its temporary folder removed; `agent_token_file`: a
    service-account token sent to the node agent (read now: the kubelet rotates it).
    A name that is not an adapter name (`adapter_names`: "../x", "/abs", "a/b") is refused
    before any path is made of it: `<cache_dir>/<name>` must stay inside `cache_dir`."""
    try:
        check_adapter_name(name)
    except InvalidAdapterName as e:
        raise AdapterLoadError(name, "fetch", str(e)) from None
    if not source:
        where = missing or (cache_dir / name if cache_dir else None)
        raise AdapterLoadError(name, "missing", f"no adapter files at {where} and no source to fetch from")
    if node_agent_url and cache_dir is not None:
        return _stage_through_agent(name, source, sha256, cache_dir, node_agent_url, dtype, namespace,
                                    agent_token_file)
    return _fetch_direct(name, source, sha256, cache_dir, stop)


def _stage_through_agent(name: str, source: str, sha256: str | None, cache_dir: Path, url: str,
                         dtype: str | None = None, namespace: str | None = None,
                         token_file: Path | None = None) -> Path:
    import httpx

    body = ({"name": name, "source": source, "sha256": sha256} | ({"dtype": dtype} if dtype else {})
            | ({"namespace": namespace} if namespace else {}))
    headers = {}
    if token_file is not None:
        try:
            headers["Authorization"] = "Bearer " + token_file.read_text().strip()
        except OSError as err:
            raise AdapterLoadError(name, "fetch", f"cannot read --node-agent-token-file {token_file}: {err}") from None
    try:
        r = httpx.post(f"{url.rstrip('/')}/v1/stage", timeout=600, json=body, headers=headers)
    except httpx.HTTPError as err:
        raise AdapterLoadError(name, "fetch", f"node agent at {url} unreachable: {err}") from None
    if r.status_code != 200:
        raise AdapterLoadError(name, "fetch", f"node agent could not stage it (HTTP {r.status_code}): "
                               f"{r.text[:300]}")
    path = cache_dir / name
    if not (path / CONFIG_FILE).is_file():
        raise AdapterLoadError(name, "fetch", f"node agent staged it, but {path} holds no {CONFIG_FILE} "
                               f"(is --adapter-cache-dir the agent's cache?)")
    return path


# A download here writes its temporary folder at least every FETCH_READ_TIMEOUT seconds, or
# fails and removes it. One untouched for ABANDONED_FETCH_SECONDS was left by a process that
# died mid-fetch (killed, OOM, the node rebooted): nothing will ever finish or remove it.
FETCH_READ_TIMEOUT = 60.0
ABANDONED_FETCH_SECONDS = 600.0
# tempfile.mkdtemp(prefix=".<name head>.")'s names: eight of its random characters after it.
_FETCH_TMP = re.compile(r"\.[a-z0-9][a-z0-9.-]*\.[a-z0-9_]{8}")


def sweep_abandoned_fetches(cache_dir: Path, now: float | None = None,
                            idle_seconds: float = ABANDONED_FETCH_SECONDS) -> list[str]:
    """Remove the temporary folders of direct fetches into `cache_dir` that nothing has
    written for `idle_seconds` (left by a process that died mid-fetch; each holds up to a
    whole adapter's bytes). Another process's fetch in flight writes more often than that,
    and the node agent's folders are not named so. Returns the names removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        children = list(cache_dir.iterdir())
    except FileNotFoundError:
        return removed
    for child in children:
        if not _FETCH_TMP.fullmatch(child.name) or child.is_symlink() or not child.is_dir():
            continue
        try:
            touched = max([child.stat().st_mtime, *(f.stat().st_mtime for f in child.iterdir())])
        except FileNotFoundError:  # finished or removed meanwhile
            continue
        if now - touched >= idle_seconds:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    if removed:
        log.warning("removed %d abandoned fetch folder(s) from %s: %s", len(removed), cache_dir, ", ".join(removed))
    return removed


def _fetch_direct(name: str, source: str, sha256: str | None, cache_dir: Path | None,
                  stop: threading.Event | None = None) -> Path:
    src = source[len("file://"):] if source.startswith("file://") else source
    if "://" not in src:
        path = Path(src)
        if not (path / CONFIG_FILE).is_file():
            raise AdapterLoadError(name, "missing", f"source {path} holds no {CONFIG_FILE}")
        if sha256 and file_digest(path / WEIGHTS_FILE) != sha256:
            raise AdapterLoadError(name, "corrupt", f"{path / WEIGHTS_FILE} does not match sha256 {sha256}")
        return path
    if not src.startswith(("http://", "https://")):
        raise AdapterLoadError(name, "fetch", f"source {redact(src)}: scheme not supported without the node "
                               f"agent (--node-agent-url)")
    if cache_dir is None:
        raise AdapterLoadError(name, "fetch", "fetching an http(s) source needs --adapter-cache-dir")
    import httpx

    cache_dir.mkdir(parents=True, exist_ok=True)
    sweep_abandoned_fetches(cache_dir)
    # The name's head only: ".<name>.<random>" of a 253-character name is past NAME_MAX (255).
    tmp = Path(tempfile.mkdtemp(prefix=f".{name[:64]}.", dir=cache_dir))
    try:
        prefix, _, query = src.partition("?")
        for filename in (CONFIG_FILE, WEIGHTS_FILE):
            url = f"{prefix.rstrip('/')}/{filename}" + (f"?{query}" if query else "")
            with httpx.stream("GET", url, timeout=FETCH_READ_TIMEOUT, follow_redirects=True) as r:
                if r.status_code != 200:
                    raise AdapterLoadError(name, "fetch", f"GET {redact(url)}: HTTP {r.status_code}")
                with (tmp / filename).open("wb") as f:
                    for chunk in r.iter_bytes():  # as they come: a stop is seen at the next one
                        if stop is not None and stop.is_set():
                            raise AdapterLoadError(name, "fetch", f"the server stopped during the download of "
                                                   f"{redact(url)}")
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
        digest = file_digest(tmp / WEIGHTS_FILE)
        if sha256 and digest != sha256:
            raise AdapterLoadError(name, "corrupt", f"download of {redact(src)} does not match sha256 {sha256}")
        # Whole files only, as the node agent checks them: a body cut short that announced no
        # length (read to the connection's close) ends with no error, and without a sha256
        # nothing else would catch it; renamed into place, it would be taken as the adapter.
        try:
            read_config(tmp)
            if not read_safetensors_header(tmp / WEIGHTS_FILE):
                raise AdapterError(f"{WEIGHTS_FILE}: no tensors")
        except AdapterError as err:
            raise AdapterLoadError(name, "fetch", f"download of {redact(src)} is not a whole adapter (cut short?): {err}") from None
        # The version, as the node agent records it: a later load finds out whether it is the plan's.
        meta = {"name": name, "sha256": digest, "source": redact(src)}
        with (tmp / STAGED_META_FILE).open("w") as f:
            f.write(json.dumps(meta))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)  # the files' bytes and names durable before the rename makes them the adapter
        dest = cache_dir / name
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        fsync_dir(cache_dir)
        log.info("adapter %s fetched from %s", name, redact(src))
        return dest
    except httpx.HTTPError as err:
        raise AdapterLoadError(name, "fetch", f"fetching {redact(src)}: {err}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_error(name: str, err: BaseException) -> AdapterLoadError:
    """A load's exception as one clear message and a one-word reason."""
    if isinstance(err, AdapterLoadError):
        return err
    if isinstance(err, (FileNotFoundError, NotADirectoryError)):
        return AdapterLoadError(name, "missing", f"missing file: {err}")
    msg = str(err)
    if isinstance(err, AdapterError):
        # read_adapter: files missing, a cut or garbled safetensors file, or weights that do not fit
        if msg.endswith((f"no {WEIGHTS_FILE}", f"no {CONFIG_FILE}", "not a directory")) or f"no {WEIGHTS_FILE} (" in msg:
            return AdapterLoadError(name, "missing", msg)
        # (a config that is JSON but no object, or the node agent's serving copy cut or
        # garbled, is broken too: its name is not WEIGHTS_FILE's)
        broken = msg.startswith(f"{WEIGHTS_FILE}:") or any(
            w in msg for w in ("holds no", "invalid JSON", "not a JSON object", "not a safetensors file"))
        return AdapterLoadError(name, "corrupt" if broken else "mismatch", msg)
    if isinstance(err, torch.OutOfMemoryError) or "out of memory" in msg.lower():
        return AdapterLoadError(name, "oom", f"out of memory: {msg}")
    if isinstance(err, RuntimeError) and "shape" in msg:
        return AdapterLoadError(name, "mismatch", f"tensor shapes do not match the header: {msg}")
    return AdapterLoadError(name, "other", f"{type(err).__name__}: {msg}")
