"""API keys, read and checked with the standard library alone: the server's (api/auth.py puts
them in front of its routes) and the node agent's (node_agent/auth.py), which imports no
FastAPI and no torch.

    keys = APIKeys(api_key="sk-admin", keys_file="/etc/loraplex/api-keys/keys.json")
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


class APIKeys:
    """The keys a server takes. Keys are compared by their sha256 digests, in constant time for
    the admin key, so the time of a refusal tells nothing of a key."""

    def __init__(self, api_key: str | None = None, keys_file: str | Path | None = None,
                 clock=time.monotonic):
        self._admin = key_digest(api_key) if api_key else None
        self.keys_file = Path(keys_file) if keys_file else None
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[bytes, str] = {}
        self._seen: tuple[int, int, int] | None = None
        self._looked = float("-inf")
        if self.keys_file is not None:
            self._tenants = read_keys_file(self.keys_file)
            self._seen = self._stamp()
            self._looked = clock()

    @classmethod
    def from_settings(cls, settings) -> "APIKeys":
        return cls(settings.api_key, settings.api_keys_file)

    @property
    def enabled(self) -> bool:
        return self._admin is not None or self.keys_file is not None

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller an `Authorization` header names; OPEN when no key is needed; None when
        the header names no key this server takes."""
        if not self.enabled:
            return OPEN
        token = bearer_token(authorization)
        if token is None:
            return None
        digest = key_digest(token)
        if self._admin is not None and hmac.compare_digest(digest, self._admin):
            return OPEN
        tenant = self._tenant_map().get(digest)
        if tenant is None:
            return None
        return OPEN if tenant == ADMIN else Caller(tenant)

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.keys_file)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _tenant_map(self) -> dict[bytes, str]:
        """The keys file's map, re-read when the file changed (looked at every RELOAD_SECONDS).
        A file that is gone or no longer parses keeps the last good map, with an error logged."""
        if self.keys_file is None:
            return self._tenants
        now = self._clock()
        with self._lock:
            if now - self._looked < RELOAD_SECONDS:
                return self._tenants
            self._looked = now
            stamp = self._stamp()
            if stamp is None or stamp == self._seen:
                return self._tenants
            try:
                self._tenants = read_keys_file(self.keys_file)
                log.info("API keys re-read from %s: %d keys", self.keys_file, len(self._tenants))
            except ValueError as e:
                log.error("%s; keeping the keys read before", e)
            self._seen = stamp
            return self._tenants
