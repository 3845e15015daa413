"""The operator's liveness endpoint on the pod's address of either family: the kubelet probes
the pod IP, IPv4 or IPv6 as the cluster gives. The chart asks for http://:8080/healthz, an
empty host: every address of both families (kopf's own endpoint binds one address, and
0.0.0.0 left an IPv6 pod's probe unanswered: the operator was restarted over and over)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import sys

import httpx
import pytest

from loraplex.operator.cli import liveness_endpoints, parse_args

BIN = pathlib.Path(sys.executable).parent
NS = "ml"


def free_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url, kopfs, ours", [
    ("http://0.0.0.0:8080/healthz", "http://0.0.0.0:8080/healthz", None),
    ("http://[::]:8080/healthz", "http://[::]:8080/healthz", None),
    ("http://:8080/healthz", None, "http://:8080/healthz"),
    (None, None, None),
])
def test_an_empty_host_is_served_by_the_operator_not_kopf(url, kopfs, ours):
    assert liveness_endpoints(parse_args(["--liveness", url] if url else [])) == (kopfs, ours)


async def test_the_operator_answers_liveness_on_both_families(api, kubeconfig, crds, tmp_path):
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "loraplex-operator"), "--namespace", NS, "--liveness", f"http://:{port}/healthz", cwd=tmp_path,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        answered: dict[str, int] = {}
        async with httpx.AsyncClient(timeout=2) as client:
            for _ in range(200):
                for host in ("127.0.0.1", "[::1]"):
                    try:
                        answered[host] = (await client.get(f"http://{host}:{port}/healthz")).status_code
                    except httpx.HTTPError:
                        pass
                if answered == {"127.0.0.1": 200, "[::1]": 200}:
                    break
                await asyncio.sleep(0.1)
        assert answered == {"127.0.0.1": 200, "[::1]": 200}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=15)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise
