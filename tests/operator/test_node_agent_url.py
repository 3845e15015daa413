"""The node agent's URL the operator gives its servers, `http://$(NODE_IP):8081`, on IPv4 and
IPv6 nodes: the kubelet expands $(NODE_IP) to the node's address as it is, with no brackets,
and the server must still reach the agent there."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loraplex.operator.specs import BaseModelSpec
from loraplex.operator.workloads import deployment
from loraplex.server.settings import ServerSettings

BASE = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://models/llama-3-8b", max_lora_rank=16)


def server_settings(node_ip: str) -> ServerSettings:
    """The server's settings from the operator's args, $(NODE_IP) expanded as the kubelet does."""
    (container,) = deployment(BASE, 8)["spec"]["template"]["spec"]["containers"]
    return ServerSettings.from_env_and_args([a.replace("$(NODE_IP)", node_ip) for a in container["args"]])


@pytest.mark.parametrize("node_ip, url", [
    ("10.1.2.3", "http://10.1.2.3:8081"),
    ("fd00:10:244::5", "http://[fd00:10:244::5]:8081"),
    ("2001:db8::1:2", "http://[2001:db8::1:2]:8081"),
    ("::1", "http://[::1]:8081"),
])
def test_the_server_reads_the_node_agent_url_of_either_family(node_ip, url):
    assert server_settings(node_ip).node_agent_url == url


@pytest.mark.parametrize("given, url", [
    ("http://[fd00::5]:8081", "http://[fd00::5]:8081"),  # bracketed already
    ("http://fd00::5:8081/", "http://[fd00::5]:8081/"),
    ("https://fd00::5:9443/agent", "https://[fd00::5]:9443/agent"),
    ("http://agent.local:8081", "http://agent.local:8081"),
    ("http://127.0.0.1:8090", "http://127.0.0.1:8090"),
])
def test_a_node_agent_url_given_by_hand(given, url):
    assert ServerSettings(dummy_weights="tiny", node_agent_url=given, adapter_cache_dir="/cache").node_agent_url == url


@pytest.mark.parametrize("bad", ["fd00::5:8081", "ftp://x:1", "http://", "http://x:port", "http://fd00::zz:8081"])
def test_a_node_agent_url_that_is_no_url_is_refused_at_start(bad):
    with pytest.raises(ValueError, match="--node-agent-url"):
        ServerSettings(dummy_weights="tiny", node_agent_url=bad, adapter_cache_dir="/cache")


class _Agent(BaseHTTPRequestHandler):
    """POST /v1/stage on [::1]: records the body, answers 200 (the adapter is on disk already)."""

    staged: list = []

    def do_POST(self):  # noqa: N802
        _Agent.staged.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"adapter": {}}')

    def log_message(self, *a):
        pass


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def test_a_server_on_an_ipv6_node_stages_through_its_agent(tmp_path: Path):
    from loraplex.server.adapter_sources import fetch_adapter

    try:
        agent = _V6Server(("::1", 0), _Agent)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    threading.Thread(target=agent.serve_forever, daemon=True).start()
    try:
        settings = server_settings("::1")
        url = settings.node_agent_url.replace(":8081", f":{agent.server_address[1]}")  # the test agent's port
        (tmp_path / "sql").mkdir()
        (tmp_path / "sql" / "adapter_config.json").write_text("{}")
        path = fetch_adapter("sql", "s3://bucket/sql", None, tmp_path, url)
        assert path == tmp_path / "sql" and _Agent.staged[-1]["name"] == "sql"
    finally:
        agent.shutdown()


def free_port() -> int:
    """A TCP port free on IPv4 and IPv6 alike."""
    with socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        return s.getsockname()[1]


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_the_server_listens_on_the_pod_ip_of_either_family():
    """The kubelet probes the pod's IP, the Service sends to it: an IPv4 address on an IPv4
    cluster, an IPv6 one on an IPv6 cluster. The operator's --host must take both."""
    import asyncio

    import uvicorn

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def app(scope, receive, send):  # the smallest ASGI app: 200 to anything
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    settings = server_settings("10.1.2.3")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.01)
        assert server.started
        assert reachable("127.0.0.1", port) and reachable("::1", port)
    finally:
        server.should_exit = True
        thread.join(10)
