"""Where adapter bytes come from, by URI scheme.

An adapter source names a PEFT adapter *directory*; the agent fetches two files from it,
`adapter_config.json` and `adapter_model.safetensors`:

    /mnt/models/adapters/sql-v2                  a plain path on a mounted volume
    file:///mnt/models/adapters/sql-v2           the same, as a URI
    https://bucket.example/adapters/sql-v2/      public object-store prefix -> GET <prefix>/<file>
    https://host/adapters/sql-v2?token=abc       a query string is kept on every file's URL
                                                 (a token scoped to the prefix, e.g. a SAS)

A presigned URL that signs a single object cannot name a directory; such a store needs
one source per file, which the CRD does not have yet (see the node agent notes).

Every fetch is a stream of chunks with the size when the source knows it up front; errors
are `SourceError` with a short machine reason (`NotFound`, `Truncated`, `Unreachable`,
`HTTPError`, `Unsupported`, `Stalled`; `InvalidRequest` for a source that cannot name a
directory: a URL that does not parse or names no host, a NUL byte, a file: URI whose path is
not absolute) that the metrics and the HTTP API report as is.

A source that trickles (a byte a minute never trips a socket's read timeout) is `Stalled`:
each file must bring at least `Stall.min_bytes` in every `Stall.seconds` spent waiting on
it (the time its reader spends elsewhere, writing to disk or waiting for budget, is not
counted), and an HTTP answer's headers must come within `Stall.seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Stall:
    """The least a source must send: `min_bytes` in each `seconds` spent waiting on it."""

    seconds: float = 60.0
    min_bytes: int = 64 * 1024

    def guard(self, chunks: AsyncIterator[bytes], what: str) -> AsyncIterator[bytes]:
        """`chunks`, ended by SourceError("Stalled") once `seconds` of waiting on them bring
        fewer than `min_bytes` (`what`: the file, as errors name it)."""
        return _guarded(chunks, self, what)


async def _guarded(chunks: AsyncIterator[bytes], stall: Stall, what: str) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    waited, got, total = 0.0, 0, 0  # waited and got: since the last `min_bytes` came
    it = aiter(chunks)
    while True:
        t0 = loop.time()
        try:
            async with asyncio.timeout(stall.seconds - waited) as deadline:
                chunk = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not deadline.expired():  # (a timeout of the source's own)
                raise
            raise _stalled(stall, what, got, total) from None
        waited += loop.time() - t0
        got += len(chunk)
        total += len(chunk)
        if got >= stall.min_bytes:
            waited, got = 0.0, 0
        elif waited >= stall.seconds:
            raise _stalled(stall, what, got, total)
        yield chunk


def _stalled(stall: Stall, what: str, got: int, total: int) -> SourceError:
    return SourceError("Stalled", f"{what}: fewer than {stall.min_bytes} bytes in {stall.seconds:g} s"
                       f" ({got}; {total} in all): the source stalled")


class SourceError(Exception):
    """A fetch that failed; `reason` is one word for metrics and API errors."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Fetch:
    """One file being fetched: its size if known up front, and its bytes as chunks."""

    size: int | None
    chunks: AsyncIterator[bytes]


class Source(Protocol):
    uri: str

    def open(self, filename: str) -> contextlib.AbstractAsyncContextManager[Fetch]:
        """Open `filename` inside the adapter directory; raises SourceError."""


class LocalSource:
    """A directory on a local or mounted filesystem (plain path or file:// URI)."""

    def __init__(self, uri: str, root: Path, stall: Stall = Stall()) -> None:
        self.uri = uri
        self.root = root
        self.stall = stall

    @contextlib.asynccontextmanager
    async def open(self, filename: str) -> AsyncIterator[Fetch]:
        path = self.root / filename
        try:
            f = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:
            raise SourceError("NotFound", f"{path}: no such file") from None
        except (IsADirectoryError, NotADirectoryError):  # the file a folder, or the source a file
            raise SourceError("NotFound", f"{path}: not a file") from None
        except OSError as e:
            raise SourceError("Unreachable", f"{path}: {e.strerror or e}") from None
        try:
            size = await asyncio.to_thread(lambda: _fstat_size(f))
            yield Fetch(size, self.stall.guard(self._chunks(f, path, size), str(path)))
        finally:
            # In a thread: a read given up on (stalled) may still hold the file's lock, and
            # close() waits for it, which on the event loop would stop the whole agent.
            await asyncio.to_thread(f.close)

    @staticmethod
    async def _chunks(f, path: Path, size: int) -> AsyncIterator[bytes]:
        seen = 0
        while True:
            try:
                # read1: what one read(2) gives, so a file that trickles (a FIFO, a hung
                # network mount) returns what came rather than wait for a whole chunk.
                chunk = await asyncio.to_thread(f.read1, CHUNK_BYTES)
            except OSError as e:
                raise SourceError("Unreachable", f"{path}: {e.strerror or e}") from None
            if not chunk:
                break
            seen += len(chunk)
            yield chunk
        if seen != size:  # the file changed while we read it
            raise SourceError("Truncated", f"{path}: read {seen} bytes, expected {size}")


def _fstat_size(f) -> int:
    return os.fstat(f.fileno()).st_size


class HTTPSource:
    """An object-store prefix over HTTP(S): GET <prefix>/<filename>, streamed."""

    def __init__(self, uri: str, session: aiohttp.ClientSession, stall: Stall = Stall()) -> None:
        self.uri = uri
        self._session = session
        self.stall = stall
        self._parts = urllib.parse.urlsplit(uri)

    def url(self, filename: str) -> str:
        p = self._parts
        path = p.path.rstrip("/") + "/" + urllib.parse.quote(filename)
        return urllib.parse.urlunsplit((p.scheme, p.netloc, path, p.query, ""))

    @contextlib.asynccontextmanager
    async def open(self, filename: str) -> AsyncIterator[Fetch]:
        url = self.url(filename)
        shown = redact(url)
        try:
            # The file as stored: aiohttp asks for gzip by default and decodes it, and the
            # Content-Length of a compressed answer does not count the bytes we get.
            async with asyncio.timeout(self.stall.seconds) as deadline:
                resp = await self._session.get(url, headers={"Accept-Encoding": "identity"})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if deadline.expired():  # headers that trickle, or none
                raise SourceError("Stalled", f"GET {shown}: no answer's headers in {self.stall.seconds:g} s:"
                                  " the source stalled") from None
            raise SourceError("Unreachable", f"GET {shown}: {describe(e)}") from None
        try:
            if resp.status == 404:
                raise SourceError("NotFound", f"GET {shown}: 404 Not Found")
            if resp.status != 200:
                raise SourceError("HTTPError", f"GET {shown}: {resp.status} {resp.reason}")
            # Compressed all the same (an object stored gzipped): aiohttp decodes it (and checks
            # the encoded length itself); the decoded size is not known up front.
            size = resp.content_length if resp.headers.get("Content-Encoding", "identity") == "identity" else None
            yield Fetch(size, self.stall.guard(self._chunks(resp, shown, size), f"GET {shown}"))
        finally:
            resp.release()

    @staticmethod
    async def _chunks(resp: aiohttp.ClientResponse, shown: str, size: int | None) -> AsyncIterator[bytes]:
        seen = 0
        try:
            async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
                seen += len(chunk)
                yield chunk
        except aiohttp.ClientPayloadError as e:
            raise SourceError("Truncated", f"GET {shown}: body cut after {seen} bytes ({describe(e)})") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise SourceError("Unreachable", f"GET {shown}: {describe(e)} after {seen} bytes") from None
        if size is not None and seen != size:
            raise SourceError("Truncated", f"GET {shown}: {seen} of {size} bytes")


_QUERY = re.compile(r"\?[^\s'\"<>]*")


def describe(e: BaseException) -> str:
    """An aiohttp error in words, with no query string of any URL in it: aiohttp's text of a
    response error is `0, message='', url='<the whole URL>'`, signature and all (the URL of
    the last redirect, for too many of them)."""
    if isinstance(e, aiohttp.TooManyRedirects):
        text = f"too many redirects ({len(e.history)} followed)"
    elif isinstance(e, aiohttp.ClientResponseError):
        text = f"{type(e).__name__}: {e.status} {e.message}".rstrip()
    else:
        text = str(e) or type(e).__name__
    return _QUERY.sub("?…", text)


def redact(url: str) -> str:
    """The URL without its query string and user info: presigned signatures, tokens and
    passwords never reach logs, API answers or the node's cache directory."""
    try:
        p = urllib.parse.urlsplit(url)
    except ValueError:  # not a URL: hide everything from its query string on
        head, sep, _ = url.partition("?")
        return head + ("?…" if sep else "")
    netloc = p.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, "…" if p.query else "", ""))


def source_digest(uri: str) -> str:
    """What stands for a whole source (secrets and all) where it is kept: sha256 hex of it."""
    return hashlib.sha256(uri.encode()).hexdigest()


def open_source(uri: str, session: aiohttp.ClientSession | None, stall: Stall = Stall()) -> Source:
    """The source for `uri`: a plain absolute path, file://, http:// or https://; each of its
    files to come at `stall`'s least rate."""
    if "\x00" in uri:  # no path or URL has one; open() would raise ValueError deep in the download
        raise SourceError("InvalidRequest", f"source {redact(uri)!r} holds a NUL byte")
    if uri.startswith("/"):
        return LocalSource(uri, Path(uri), stall)
    try:
        parts = urllib.parse.urlsplit(uri)
        parts.port  # parsed here: a bad port is a bad URL, not an unreachable host
    except ValueError as e:
        raise SourceError("InvalidRequest", f"source {redact(uri)!r} is not a valid URL ({e})") from None
    scheme = parts.scheme
    if scheme == "file":
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:  # not relative to wherever the agent runs
            raise SourceError("InvalidRequest", f"source {redact(uri)!r}: a file:// URI names an absolute"
                              " path (file:///mnt/adapters/a)")
        return LocalSource(uri, Path(path), stall)
    if scheme in ("http", "https"):
        if not parts.hostname:
            raise SourceError("InvalidRequest", f"source {redact(uri)!r} is not a valid URL (no host)")
        if session is None:
            raise SourceError("Unsupported", f"{redact(uri)}: no HTTP session to fetch it")
        return HTTPSource(uri, session, stall)
    raise SourceError(
        "Unsupported", f"source {redact(uri)!r}: scheme {scheme or '(none)'!r} is not one of file, http, https,"
        " or an absolute path"
    )
