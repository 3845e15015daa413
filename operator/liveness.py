"""The operator's liveness endpoint on every address of both families, IPv4 and IPv6.

kopf's own endpoint (`--liveness http://HOST:PORT/PATH`) binds the one address in the URL:
0.0.0.0 answers an IPv4 pod's probes only, [::] an IPv6 pod's only (asyncio binds it
IPv6-only), and an empty host means 127.0.0.1 to kopf. The kubelet probes the pod's IP, of
whichever family the cluster gives it, so the chart asks for an empty host
(`http://:8080/healthz`), which this module serves instead of kopf: each family the kernel
has, as `web.TCPSite(runner, "", port)` binds them. It answers 200 while the operator's event
loop runs, as kopf's endpoint does when no `kopf.on.probe` handler is registered (none is).
"""

from __future__ import annotations

import urllib.parse

from aiohttp import web


async def serve(url: str) -> web.AppRunner:
    """Serve GET <path of url> -> 200 {} on every address, at the URL's port; the runner to clean up."""
    parts = urllib.parse.urlsplit(url)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get(parts.path or "/", healthz)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "", parts.port or 80).start()
    return runner
