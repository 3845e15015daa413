"""Where the node agent listens: the serving pods of its node call it at the node's IP through
its hostPort, which forwards to the agent pod's IP, IPv4 or IPv6 as the cluster gives."""

from __future__ import annotations

import socket

import pytest
from aiohttp import web

from loraplex.node_agent.cli import Settings


def free_port() -> int:
    """A TCP port free on IPv4 and IPv6 alike."""
    with socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        return s.getsockname()[1]


async def reachable(host: str, port: int) -> bool:
    import asyncio

    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except OSError:
        return False
    writer.close()
    return True


async def test_the_default_address_takes_both_families(tmp_path):
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    settings = Settings.from_env_and_args(["--cache-dir", str(tmp_path)], {})
    runner = web.AppRunner(web.Application())
    await runner.setup()
    port = free_port()
    # As main() runs it: web.run_app(app, host=settings.host, port=settings.port).
    await web.TCPSite(runner, settings.host, port).start()
    try:
        assert await reachable("127.0.0.1", port) and await reachable("::1", port)
    finally:
        await runner.cleanup()
