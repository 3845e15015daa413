"""The node agent's own API key: who may list this node's adapters and start sessions on it.

    --api-key KEY   (or LORAPLEX_NODE_AGENT_API_KEY)

Without it the API is open. With it, every request under /v1/ but /v1/stage sends
`Authorization: Bearer KEY` (the scheme in any case), or is answered 401 `InvalidAPIKey` in
the API's error shape, with `WWW-Authenticate: Bearer`, as the servers answer a request
without their key. So `GET /v1/adapters` (every namespace's staged adapter names) and
`POST /v1/sessions` (which the agent warms into the node's servers with their admin key) are
the key holder's alone; a path this module does not name is guarded too, so an endpoint
added under /v1/ later is not open by mistake.

Not guarded here, with a key as without one: `POST /v1/stage`, which the servers call when a
request finds its adapter missing and who hold no agent key. With --stage-token-audience it
takes their service-account tokens instead (stage_auth.py, or this key: `holds_key`);
without, it is open (for a name a followed plan lists, it stages the plan's version alone:
Warmer.stage_refusal; with --stage-plan-adapters-only, other names need the key). And
`/healthz` and `/metrics`, for the kubelet's probe and Prometheus.

The key is compared by its SHA-256 digest, in constant time, so the time of a refusal tells
nothing of the key.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from loraplex.server.api_keys import bearer_token, key_digest  # stdlib only, as the server checks keys

OPEN_PATHS = frozenset({"/v1/stage"})  # under /v1/, taken without the key


def needs_key(path: str) -> bool:
    return path.startswith("/v1/") and path not in OPEN_PATHS


def holds_key(request: web.Request, api_key: str | None) -> bool:
    """Whether `request` sends `api_key` (False when there is none to send)."""
    token = bearer_token(request.headers.get("Authorization"))
    return bool(api_key) and token is not None and hmac.compare_digest(key_digest(token), key_digest(api_key))


def authenticate(api_key: str | None):
    """aiohttp middleware: a request `needs_key` names `api_key`, or gets a 401. With no key,
    every request goes through."""
    wanted = key_digest(api_key) if api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if wanted is None or not needs_key(request.path):
            return await handler(request)
        token = bearer_token(request.headers.get("Authorization"))
        if token is not None and hmac.compare_digest(key_digest(token), wanted):
            return await handler(request)
        said = "No API key provided" if token is None else "Incorrect API key provided"
        return web.json_response(
            {"error": {"reason": "InvalidAPIKey",
                       "message": f"{said}. Send the node agent's key (its --api-key) as 'Authorization: Bearer KEY'."}},
            status=401, headers={"WWW-Authenticate": "Bearer"})

    return middleware
