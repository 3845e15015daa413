"""API keys, read and checked with the standard library alone: the server's (api/auth.py puts
them in front of its routes) and the node agent's (node_agent/auth.py), which imports no
FastAPI and no torch.

    keys = APIKeys(api_key_file="/etc/loraplex/api-keys/admin-key", keys_file="/etc/loraplex/api-keys/keys.json")
    keys.caller("Bearer sk-acme-1")  ->  Caller(tenant="acme"); None for a key not taken

A keys file is a JSON object {"KEY": "TENANT", ...}; a key of tenant "*" is an admin key. Keys
are compared by their SHA-256 digests (the admin key in constant time), so the time of a
refusal tells nothing of a key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ADMIN = "*"  # the tenant of an admin key in --api-keys-file
RELOAD_SECONDS = 1.0  # the keys file is looked at (a stat) at most this often


@dataclass(frozen=True)
class Caller:
    """Who sent a request: `tenant` None for an admin key, or for any caller of an open API."""

    tenant: str | None = None

    @property
    def admin(self) -> bool:
        return self.tenant is None

    def may_use(self, adapter_tenant: str | None) -> bool:
        """Whether this caller may see and use an adapter of `adapter_tenant` (None: no tenant's)."""
        return self.tenant is None or adapter_tenant is None or adapter_tenant == self.tenant


OPEN = Caller()


def key_digest(key: str) -> bytes:
    """The SHA-256 digest keys are compared by."""
    return hashlib.sha256(key.encode()).digest()


def read_keys_file(path: str | Path) -> dict[bytes, str]:
    """{sha256 of a key: its tenant} from a keys file; ValueError saying what is wrong."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: {e.strerror or e}") from None
    try:
        keys = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"--api-keys-file {path}: not JSON ({e})") from None
    if not isinstance(keys, dict):
        raise ValueError(f'--api-keys-file {path}: expected a JSON object {{"KEY": "TENANT", ...}}')
    for key, tenant in keys.items():
        if not key or not isinstance(tenant, str) or not tenant:
            raise ValueError(f"--api-keys-file {path}: every key needs a tenant name (a non-empty string, "
                             f"{ADMIN!r} for an admin key); one key has {tenant!r}")
    return {key_digest(key): tenant for key, tenant in keys.items()}


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (the scheme in any case), or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class WatchedFile:
    """A small file's parsed content, re-read when the file changes: its stat (inode, mtime,
    size) is looked at, at most every RELOAD_SECONDS, so a Secret that the kubelet updates in
    place (a new folder swapped in under the mount) reaches the reader without a restart. The
    first read raises the parser's ValueError; later, a file that is gone or no longer parses
    keeps the last good content, with an error logged."""

    def __init__(self, path: str | Path, parse, clock=time.monotonic):
        self.path = Path(path)
        self._parse = parse
        self._clock = clock
        self._lock = threading.Lock()
        self._value = parse(self.path)
        self._seen = self._stamp()
        self._looked = clock()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def get(self):
        now = self._clock()
        with self._lock:
            if now - self._looked < RELOAD_SECONDS:
                return self._value
            self._looked = now
            stamp = self._stamp()
            if stamp is None or stamp == self._seen:
                return self._value
            try:
                self._value = self._parse(self.path)
                log.info("%s re-read", self.path)
            except ValueError as e:
                log.error("%s; keeping what was read before", e)
            self._seen = stamp
            return self._value


def read_key_file(path: str | Path, flag: str = "--api-key-file") -> str:
    """The one key a key file holds (a Secret's value mounted as a file): its text, with the
    whitespace around it (a trailing newline) taken off; ValueError saying what is wrong."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    try:
        key = raw.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text") from None
    if not key:
        raise ValueError(f"{flag} {path}: the file is empty; it should hold one API key")
    if any(c.isspace() for c in key):
        raise ValueError(f"{flag} {path}: holds more than one word; it should hold one API key")
    return key


class APIKeys:
    """The keys a server takes: an admin key given as it is (`api_key`) and one read from a
    file (`api_key_file`), and the tenants' keys file. Both files are re-read when they change
    (WatchedFile), so a key rotates without a restart. Keys are compared by their sha256
    digests, in constant time for the admin keys, so the time of a refusal tells nothing of a
    key."""

    def __init__(self, api_key: str | None = None, keys_file: str | Path | None = None,
                 api_key_file: str | Path | None = None, clock=time.monotonic):
        self._admin = key_digest(api_key) if api_key else None
        self._admin_file = (WatchedFile(api_key_file, lambda p: key_digest(read_key_file(p)), clock)
                            if api_key_file else None)
        self._tenants = WatchedFile(keys_file, read_keys_file, clock) if keys_file else None

    @classmethod
    def from_settings(cls, settings) -> "APIKeys":
        return cls(settings.api_key, settings.api_keys_file, settings.api_key_file)

    @property
    def enabled(self) -> bool:
        return self._admin is not None or self._admin_file is not None or self._tenants is not None

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller an `Authorization` header names; OPEN when no key is needed; None when
        the header names no key this server takes."""
        if not self.enabled:
            return OPEN
        token = bearer_token(authorization)
        if token is None:
            return None
        digest = key_digest(token)
        for admin in (self._admin, self._admin_file.get() if self._admin_file else None):
            if admin is not None and hmac.compare_digest(digest, admin):
                return OPEN
        tenant = self._tenants.get().get(digest) if self._tenants else None
        if tenant is None:
            return None
        return OPEN if tenant == ADMIN else Caller(tenant)
