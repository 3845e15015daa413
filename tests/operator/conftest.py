"""Fixtures for the operator's end-to-end tests: an emulated API server on a loopback
port, a kubeconfig pointing at it, the CRDs installed, and the kopf operator running
in-process (in the test's event loop) against it over real HTTP.

What these tests cannot prove is listed in emulator.py's docstring: the API server's schema
validation and defaulting, RBAC, admission, and pods ever running.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import pathlib
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import kmock
import kopf
import pytest
import yaml

from loraplex.operator.kube import KubeClient, Resource

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILES = sorted((ROOT / "crds").glob("*.yaml"))
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")


def _load_emulator() -> Any:
    """tests/ is not a package: load emulator.py by path, once."""
    name = "loraplex_tests_operator_emulator"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name("emulator.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


emulator_module = _load_emulator()


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "") -> Any:
    """Poll `check` until it returns something truthy (and return that), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(AssertionError, KeyError, TypeError):
            last = await check()
            if last:
                return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last: {last!r}")


@pytest.fixture()
def eventually_() -> Callable[..., Awaitable[Any]]:
    return eventually


@pytest.fixture()
async def emulator() -> AsyncIterator[Any]:
    async with emulator_module.Emulator() as handler, kmock.Server(handler) as server:
        handler.base_url = str(server.url).rstrip("/")
        yield handler


@pytest.fixture()
def kubeconfig(emulator: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": emulator.base_url}}],
        "users": [{"name": "tester", "user": {"token": "not-checked"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                      "namespace": "default"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


@pytest.fixture()
async def api(emulator: Any) -> AsyncIterator[KubeClient]:
    client = KubeClient(kopf.ConnectionInfo(server=emulator.base_url), timeout=10)
    yield client
    await client.close()


@pytest.fixture()
async def crds(api: KubeClient) -> None:
    for path in CRD_FILES:
        await api.create(CRDS.path(None), yaml.safe_load(path.read_text()))


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # The emulator ends a watch after timeoutSeconds, like the API server; the client
    # timeout is the backstop if a stream hangs anyway.
    settings.watching.server_timeout = 30
    settings.watching.client_timeout = 45
    settings.watching.connect_timeout = 5
    settings.networking.request_timeout = 10
    settings.queueing.idle_timeout = 1.0
    settings.queueing.exit_timeout = 2.0
    return settings


async def settle(emulator: Any, quiet: float = 0.3, timeout: float = 3.0) -> None:
    """Wait until the API has had no request for `quiet` seconds (at most `timeout`).

    Stopping kopf while events are still queued can respawn a daemon after kopf's daemon
    killer ran; kopf then waits 5 s before cancelling it. Settling first avoids that.
    """
    deadline = time.monotonic() + timeout
    seen, since = len(emulator._requests), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        await asyncio.sleep(0.05)
        if len(emulator._requests) != seen:
            seen, since = len(emulator._requests), time.monotonic()


@contextlib.asynccontextmanager
async def running_operator(emulator: Any, namespaces: tuple[str, ...] = (), *, mirror_namespace: str | None = None,
                           mirror_sweep_seconds: float | None = None) -> AsyncIterator[None]:
    """kopf in its own thread and event loop, as `kopf.operator(...)`: the whole cluster, or
    only `namespaces` (as `loraplex-operator --namespace`); plans mirrored into
    `mirror_namespace` (`--plan-mirror-namespace`), swept every `mirror_sweep_seconds`.

    Not in the test's loop: on exit kopf cancels every task of its loop that it did not
    find at start, which would include the emulator's request handlers.
    """
    import loraplex.operator  # noqa: F401  (registers the handlers)

    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(clusterwide=not namespaces, namespaces=namespaces, standalone=True,
                                      settings=operator_settings(), stop_flag=stop, ready_flag=ready,
                                      memo=kopf.Memo(plan_mirror_namespace=mirror_namespace,
                                                     mirror_sweep_seconds=mirror_sweep_seconds)))
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 10), "the operator did not start in 10s"
        yield
        await settle(emulator)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        assert not thread.is_alive(), "the operator did not stop in 20s"
    if errors:
        raise errors[0]


@pytest.fixture()
def settled(emulator: Any) -> Callable[[], Awaitable[None]]:
    """`await settled()`: wait until the operator stopped writing (kopf's own annotations too)."""
    return lambda: settle(emulator)


@pytest.fixture()
def operator_runner(emulator: Any) -> Callable[[], contextlib.AbstractAsyncContextManager[None]]:
    """Start (and restart) the operator within a test: `async with operator_runner(): ...`,
    `operator_runner(("ml",))` for one namespace, `operator_runner(mirror_namespace="lp")`
    to mirror the plans."""
    return lambda namespaces=(), **kwargs: running_operator(emulator, namespaces, **kwargs)


@pytest.fixture()
async def operator(emulator: Any, kubeconfig: pathlib.Path, crds: None) -> AsyncIterator[None]:
    async with running_operator(emulator):
        yield
