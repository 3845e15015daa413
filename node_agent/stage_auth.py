"""Who may POST /v1/stage: a pod of the namespace it stages for, by its service-account token.

    --stage-token-audience loraplex-node-agent

The servers send a projected service-account token of that audience (the operator mounts one
into each server pod: `--node-agent-token-file`) as `Authorization: Bearer TOKEN`; the agent
asks the Kubernetes API who it is (a TokenReview, as the kubelet and the API server's
webhooks authenticate a token), and stages only for the token's own namespace: a server of
namespace `acme` stages `acme`'s adapters, never another tenant's folder of the cache, and a
pod with no token stages nothing. The agent's own --api-key still passes (an operator's
tooling). Without the flag /v1/stage is open, as before (bounded by the plan guards).

A review is kept for `ttl` seconds by the token's SHA-256 digest (a server stages in bursts;
projected tokens live an hour or more), at most MAX_KEPT of them.

    {"kind": "TokenReview", "spec": {"token": T, "audiences": ["loraplex-node-agent"]}}
      -> status {"authenticated": true, "audiences": [...],
                 "user": {"username": "system:serviceaccount:acme:default"}}   -> namespace "acme"
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

from .kube import KubeAPI

SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
MAX_KEPT = 1024


class TokenReviewError(RuntimeError):
    """The Kubernetes API could not review a token (unreachable, or an error status)."""


class StageAuth:
    def __init__(self, api: KubeAPI, audience: str, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.api = api
        self.audience = audience
        self.ttl = ttl
        self.clock = clock
        self._kept: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()  # digest -> (namespace, until)

    async def namespace_of(self, token: str) -> str | None:
        """The namespace of the service account whose token this is, for this audience; None
        when the API says it is no such token (unauthenticated, another audience, a user's).
        Raises TokenReviewError when the API cannot say."""
        digest = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        kept = self._kept.get(digest)
        if kept is not None and kept[1] > now:
            return kept[0]
        namespace = await self._review(token)
        self._kept[digest] = (namespace, now + self.ttl)
        self._kept.move_to_end(digest)
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)
        return namespace

    async def _review(self, token: str) -> str | None:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}}
        try:
            status, answer = await self.api.post_json("/apis/authentication.k8s.io/v1/tokenreviews", body)
        except Exception as e:  # noqa: BLE001 - unreachable, timed out, not JSON
            raise TokenReviewError(f"TokenReview failed: {type(e).__name__}: {e}") from None
        if status not in (200, 201):
            raise TokenReviewError(f"TokenReview answered HTTP {status}")
        review = (answer or {}).get("status") or {}
        if not review.get("authenticated") or self.audience not in (review.get("audiences") or [self.audience]):
            return None
        username = (review.get("user") or {}).get("username") or ""
        if not username.startswith(SERVICE_ACCOUNT_PREFIX):
            return None
        namespace, _, account = username[len(SERVICE_ACCOUNT_PREFIX):].partition(":")
        return namespace if namespace and account else None
