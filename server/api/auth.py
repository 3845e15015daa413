"""API keys and the tenant check: who may call the API, and which adapters each caller sees.

    --api-key KEY            (or LORAPLEX_API_KEY) an admin key, as vLLM's --api-key
    --api-key-file FILE      a file holding an admin key, re-read when it changes
    --api-keys-file FILE     {"KEY": "TENANT", ...}: tenants' keys ("*": an admin key), re-read
                             when the file changes (a mounted Secret is updated in place)

With none, the API is open, as vLLM's without --api-key. With any, every request under
/v1/ (and to /tokenize and /detokenize, KEYED_PATHS) sends `Authorization: Bearer KEY`, or is answered 401 `invalid_api_key` (OpenAI's
answer, with `WWW-Authenticate: Bearer`); /healthz, /readyz and /metrics stay open for the
kubelet's probes and Prometheus.

The tenant check (the request path of DESIGN.md: HTTP -> tenant check -> scheduler): a
tenant's key may use the base and the adapters the plan gives that tenant (the LoRAAdapter's
`spec.tenant`; `AdapterCache.tenant_of`) or gives to no tenant (loaded by an admin, or found on
disk with no plan). Any other adapter is, to that key, a model that does not exist: 404
`model_not_found`, listed nowhere, so one tenant cannot learn another's adapter names. The
admin endpoints (load and unload, pin and unpin) need an admin key: 403 `admin_key_required`.
The keys themselves are read and checked in server/api_keys.py (no FastAPI there: the node
agent checks its own key with it).
"""

from __future__ import annotations

import json

from fastapi import Request

from ..api_keys import ADMIN, OPEN, APIKeys, Caller, bearer_token
from .errors import APIError, error_body

__all__ = ["ADMIN", "OPEN", "APIKeys", "Authenticate", "Caller", "get_caller", "require_admin"]


# Paths outside /v1/ that need a key too: vLLM's /tokenize and /detokenize name a model, and
# their 404 for another tenant's adapter would say it exists.
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


class Authenticate:
    """Pure ASGI middleware: every request under /v1/ (and to KEYED_PATHS) names a key `keys` takes, or gets a 401;
    the caller it names is kept in the request's state (`caller`)."""

    def __init__(self, app, keys: APIKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in KEYED_PATHS):
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
