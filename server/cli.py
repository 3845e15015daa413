"""`loraplex-server`: serve a base model and its adapters over the OpenAI API.

    loraplex-server --model DIR --host 0.0.0.0 --port 8000 --lora-modules sql=/adapters/sql
    loraplex-server --dummy-weights llama-3-8b --device cuda        # random weights, for benchmarks
    loraplex-server --demo                                          # tiny random model + adapters, no downloads
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from .api_keys import APIKeys, read_key_file
from .settings import ServerSettings

log = logging.getLogger("loraplex.server")

# (model, prompt); None is the base, by its served name ("base" unless --served-model-name).
DEMO_PROMPTS = [(None, "The quick brown fox"), ("sql-expert", "SELECT name FROM"),
                ("poet", "Shall I compare thee"), ("pirate", "Ahoy matey")]
# A structured output the demo asks of an adapter when the grammar engine is installed.
DEMO_SCHEMA = {"type": "object", "properties": {"table": {"enum": ["users", "orders", "items"]},
                                                "limit": {"enum": [10, 100]}, "desc": {"type": "boolean"}},
               "required": ["table", "limit", "desc"], "additionalProperties": False}


def main(argv: list[str] | None = None) -> int:
    try:
        settings = ServerSettings.from_env_and_args(argv)
    except ValueError as e:
        sys.stderr.write(f"loraplex-server: {e}\n")
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if settings.demo:
        try:
            _prepare_demo(settings)
            settings.validate()  # the demo's own base and adapter names against the command line's
        except OSError as e:  # a --demo-dir that cannot be written (read-only, under a file, full)
            sys.stderr.write(f"loraplex-server: --demo-dir: cannot write the demo's files: {e}\n")
            return 2
        except ValueError as e:
            sys.stderr.write(f"loraplex-server: --demo: {e}\n")
            return 2
    from .engine import check_settings

    try:
        check_settings(settings)
        APIKeys.from_settings(settings)  # a keys file that does not parse: said now, not at the first request
        _check_listen(settings.host, settings.port)
    except ValueError as e:  # a wrong device, model folder, dummy shape, adapter path or address
        sys.stderr.write(f"loraplex-server: {e}\n")
        return 2
    try:
        asyncio.run(_serve(settings))
    except KeyboardInterrupt:
        pass
    return 0


def _check_listen(host: str, port: int) -> None:
    """ValueError unless `host:port` can be listened on. The server binds only once the model
    is loaded and warmed up (minutes on a GPU): a port in use, or a --host that is no address
    here, is said now instead. Bound as uvicorn binds (SO_REUSEADDR), then let go."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            shown = f"[{host}]" if ":" in host else host
            raise ValueError(f"--host/--port {shown}:{port}: cannot listen there: "
                             f"{e.strerror or e}") from None


def _prepare_demo(settings: ServerSettings) -> None:
    from pathlib import Path

    from .demo import build_demo, default_demo_dir

    root = Path(settings.demo_dir) if settings.demo_dir else default_demo_dir()
    base, adapters = build_demo(root)
    settings.model = str(base)
    settings.served_model_name = settings.served_model_name or "base"
    settings.lora_modules = [f"{name}={path}" for name, path in adapters.items()] + settings.lora_modules
    if settings.device == "auto":
        settings.device = "cpu"


async def _serve(settings: ServerSettings) -> None:
    import uvicorn

    from .api.app import create_app_from_settings

    app = create_app_from_settings(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    tasks = [asyncio.create_task(server.serve())]
    if settings.demo:
        tasks.append(asyncio.create_task(_demo_requests(server, settings)))
    await tasks[0]
    for t in tasks[1:]:
        t.cancel()


async def _demo_requests(server, settings: ServerSettings) -> None:
    """Once the server listens: one request per demo model, all at once (one mixed batch);
    then, with the grammar engine installed, one held to a JSON schema."""
    import httpx

    from .structured import available as structured_outputs_available

    while not server.started:
        await asyncio.sleep(0.1)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else settings.port
    host = settings.host or "127.0.0.1"  # "": every address, loopback among them
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    url = f"http://{host}:{port}"
    # With API keys on, the demo's requests send the admin key (a tenants' file alone gives it none).
    admin = settings.api_key or (read_key_file(settings.api_key_file) if settings.api_key_file else None)
    auth = {"Authorization": f"Bearer {admin}"} if admin else {}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=auth) as client:
        async def one(model: str, prompt: str, **extra) -> tuple[str, str, str]:
            r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                          "temperature": 0, **extra})
            if r.is_error:  # the server's own reason, not httpx's "Client error ... for url"
                try:
                    why = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    why = r.text[:300]
                raise httpx.HTTPStatusError(f"model {model!r}: HTTP {r.status_code}: {why}",
                                            request=r.request, response=r)
            return model, prompt, r.json()["choices"][0]["text"]

        try:
            results = await asyncio.gather(*(one(m or settings.served_model_name, p) for m, p in DEMO_PROMPTS))
        except httpx.HTTPError as e:
            log.error("demo requests failed: %s", e)
            results = None
        if results is not None:
            log.info("demo: a random tiny model answered four requests in one batch (gibberish is expected):")
            for model, prompt, text in results:
                log.info("  model=%-10s prompt=%r -> %r", model, prompt, text)
        if results is not None and structured_outputs_available():
            fmt = {"type": "json_schema", "json_schema": {"name": "query", "schema": DEMO_SCHEMA}}
            try:
                _, _, text = await one("sql-expert", "SELECT name FROM", response_format=fmt, max_tokens=100)
                log.info("demo: the same adapter held to a JSON schema (response_format) -> %s", text)
            except httpx.HTTPError as e:
                log.error("demo structured output failed: %s", e)
    keyed = settings.api_key or settings.api_key_file or settings.api_keys_file
    key = " -H 'Authorization: Bearer <your API key>'" if keyed else ""
    log.info("try it:  curl %s/v1/completions%s -H 'Content-Type: application/json' "
             "-d '{\"model\": \"poet\", \"prompt\": \"Shall I\", \"max_tokens\": 16, \"stream\": true}'", url, key)
    log.info("models:  curl %s/v1/models%s   (Ctrl-C stops the server)", url, key)
