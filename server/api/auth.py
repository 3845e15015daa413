"""API keys and the tenant check: who may call the API, and which adapters each caller sees.

    --api-key KEY            (or LORAPLEX_API_KEY) an admin key, as vLLM's --api-key
    --api-keys-file FILE     {"KEY": "TENANT", ...}: tenants' keys ("*": an admin key), re-read
                             when the file changes (a mounted Secret is updated in place)

With neither, the API is open, as vLLM's without --api-key. With either, every request under
/v1/ sends `Authorization: Bearer KEY`, or is answered 401 `invalid_api_key` (OpenAI's
answer, with `WWW-Authenticate: Bearer`); /healthz, /readyz and /metrics stay open for the
kubelet's probes and Prometheus.

The tenant check (the request path of DESIGN.md: HTTP -> tenant check -> scheduler): a
tenant's key may use the base and the adapters the plan gives that tenant (the LoRAAdapter's
`spec.tenant`; `AdapterCache.tenant_of`) or gives to no tenant (loaded by an admin, or found on
disk with no plan). Any other adapter is, to that key, a model that does not exist: 404
`model_not_found`, listed nowhere, so one tenant cannot learn another's adapter names. The
admin endpoints (load and unload, pin and unpin) need an admin key: 403 `admin_key_required`.
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

from fastapi import Request

from .errors import APIError, error_body

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


def _digest(key: str) -> bytes:
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
    return {_digest(key): tenant for key, tenant in keys.items()}


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
        self._admin = _digest(api_key) if api_key else None
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
        digest = _digest(token)
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


class Authenticate:
    """Pure ASGI middleware: every request under /v1/ names a key `keys` takes, or gets a 401;
    the caller it names is kept in the request's state (`caller`)."""

    def __init__(self, app, keys: APIKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization")
        header = header.decode("latin-1") if header is not None else None
        who = self.keys.caller(header)
        if who is None:
            said = "No API key provided" if bearer_token(header) is None else "Incorrect API key provided"
            body = json.dumps(error_body(401, f"{said}. Send it as 'Authorization: Bearer KEY'.",
                                         type="invalid_request_error", code="invalid_api_key")).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"www-authenticate", b"Bearer")]})
            return await send({"type": "http.response.body", "body": body})
        scope.setdefault("state", {})["caller"] = who
        await self.app(scope, receive, send)


def get_caller(request: Request) -> Caller:
    return getattr(request.state, "caller", OPEN)


def require_admin(caller: Caller, what: str) -> None:
    if not caller.admin:
        raise APIError(403, f"{what} needs an admin API key (--api-key, or a key of tenant {ADMIN!r} in "
                            f"--api-keys-file); this key is tenant {caller.tenant!r}'s",
                       type="permission_error", code="admin_key_required")
