"""`loraplex-node-agent`: settings, flags and the process.

One dataclass holds every setting; each field's docstring (the string under it) gives its
unit and default and is the flag's help, so flags and fields map one to one
(`cache_dir` <-> `--cache-dir`). The environment is read only in `Settings.from_env_and_args`:
NODE_NAME for --node-name, POD_NAMESPACE for --namespace and --plan-namespace,
LORAPLEX_SERVER_API_KEY for --server-api-key (unless --server-api-key-file is given),
LORAPLEX_NODE_AGENT_API_KEY for --api-key, and the
in-cluster API address (KUBERNETES_SERVICE_HOST/PORT) for finding this node's server pods and
reporting staging.

    loraplex-node-agent --cache-dir /var/lib/loraplex/adapters --budget-bytes 200000000000 \\
        --plan-file /etc/loraplex/plan/plan.json --port 8081
    loraplex-node-agent --plan-selector loraplex.io/plan-mirror=true   # every BaseModel's plan, found
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from loraplex.node_agent.app import AgentConfig, create_app
from loraplex.server.adapter_names import is_namespace
from loraplex.server.api_keys import read_key_file
from loraplex.server.settings import field_docs  # stdlib only: shared with the server's flags

log = logging.getLogger("loraplex.node_agent")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass
class Settings:
    cache_dir: Path = Path("/var/lib/loraplex/adapters")
    """Local adapter cache (the host path the server pods mount). Default: /var/lib/loraplex/adapters."""

    budget_bytes: int = 50 * 1024**3
    """Most bytes of staged adapters kept on local disk. Default: 53687091200 (50 GiB)."""

    max_concurrent_downloads: int = 4
    """Adapter downloads running at once, at most. Default: 4."""

    download_stall_seconds: float = 60.0
    """A download whose source sends fewer than --download-stall-bytes in this many seconds
    of waiting on it (or no HTTP answer's headers in as long) fails as Stalled, and is
    retried: a source that trickles would hold a download slot for ever. Default: 60.0."""

    download_stall_bytes: int = 64 * 1024
    """The least bytes a download's source sends in each --download-stall-seconds (the
    default pair is about 1 KiB/s, far below a real link; 0: only a source silent that long
    stalls). Default: 65536."""

    plan_file: Path | None = None
    """The operator's plan (the ConfigMap <base>-plan, key plan.json, mounted), e.g.
    /etc/loraplex/plan/plan.json. Default: none (stage on request only)."""

    plan_configmap: list[str] = field(default_factory=list)
    """NAMESPACE/NAME of a plan ConfigMap (<base>-plan), read through the Kubernetes API
    instead of --plan-file (a DaemonSet cannot mount a ConfigMap of another namespace);
    repeatable, one for each BaseModel whose plan the agent follows. Default: none."""

    plan_selector: str | None = None
    """A label selector, e.g. loraplex.io/plan-mirror=true: every ConfigMap of --plan-namespace
    it finds is a plan followed, from when it appears until it goes, as a --plan-configmap of
    the plan its annotation loraplex.io/plan-of names (NAMESPACE/NAME: the operator's mirrors
    of its BaseModels' plans, which it writes into its mirror namespace); listed every
    --poll-seconds. A plan that goes leaves as its adapters would leave it: off the disk (but
    what another followed plan of its namespace lists), its pins released (one gone while
    the agent was down: at its next start). Beside
    --plan-configmap (a plan named there is not followed twice). Default: none."""

    plan_namespace: str | None = None
    """The namespace where --plan-selector finds plans. Default: $POD_NAMESPACE (the agent's own)."""

    server_api_key: str | None = field(default=None, repr=False)
    """The servers' admin API key, sent as 'Authorization: Bearer KEY' when the agent warms
    them (prefetch, pin, unpin); never sent to an adapter's source. Give it as
    LORAPLEX_SERVER_API_KEY from a Secret rather than on the command line. Default: none."""

    server_api_key_file: str | None = None
    """A file that holds the servers' admin API key (a Secret's value mounted as a file), in
    place of --server-api-key: read when the agent warms a server, re-read when it changes, so
    the key rotates without a restart (the chart's nodeAgent.serverApiKeySecret). Default: none."""

    server_api_keys_dir: str | None = None
    """A folder of the servers' admin keys, one file per key (a Secret mounted whole, the
    chart's nodeAgent.serverApiKeysSecret): a server of BaseModel B in namespace N is sent the
    key of file 'N.B', else of file 'N', else the one of --server-api-key-file or
    --server-api-key. Each file is re-read when it changes, and one taken out stops being
    sent. Default: none."""

    api_key: str | None = field(default=None, repr=False)
    """This agent's own API key: GET /v1/adapters and POST /v1/sessions (every endpoint under
    /v1/ but /v1/stage) then need 'Authorization: Bearer KEY'; /v1/stage (the servers call it,
    and hold no agent key), /healthz and /metrics stay open. Give it as
    LORAPLEX_NODE_AGENT_API_KEY from a Secret rather than on the command line. Default: none
    (the API is open)."""

    stage_plan_adapters_only: bool = False
    """POST /v1/stage stages only adapters a followed plan lists (the servers' own requests):
    any other name is a 403 NotInPlan unless the request sends this agent's --api-key. Without
    it, any pod that reaches the port may have the agent fetch any source onto the node's disk
    (within its budget). For agents that follow every plan of their servers (the chart's
    plan discovery); a new BaseModel's adapters are taken once its plan is found. Default: off."""

    stage_token_audience: str | None = None
    """POST /v1/stage needs a Kubernetes service-account token of this audience as
    'Authorization: Bearer TOKEN' (the operator mounts one into each server pod, which sends
    it with each staging), reviewed by the API (TokenReview), and stages only
    for the token's namespace: a server stages its own namespace's adapters, no other
    tenant's, and a pod without a token none (401; another namespace: 403). This agent's
    --api-key passes too. Needs the Kubernetes API; the chart sets loraplex-node-agent.
    Default: none (open)."""

    port: int = 8081
    """TCP port of the agent's HTTP API. Default: 8081."""

    host: str = ""
    """Address to listen on; empty: every address of both families, IPv4 and IPv6 (the
    serving pods call the hostPort at the node's IP, whichever family the cluster gives it;
    0.0.0.0 is IPv4's only). Default: empty."""

    node_name: str | None = None
    """This node's name, to find the server pods on it. Default: $NODE_NAME."""

    namespace: str | None = None
    """Namespace of the plan's LoRAAdapters, whose status.nodes.<node> this agent reports,
    and whose folder of the cache it stages them in (with --plan-configmap, each plan's
    ConfigMap's namespace; with --plan-selector, each found plan's, from its annotation).
    Default: $POD_NAMESPACE."""

    server_url: list[str] = field(default_factory=list)
    """Server base URLs to warm instead of finding pods through the API, e.g.
    http://127.0.0.1:8000 (repeatable). Default: none."""

    kube_api_url: str | None = None
    """Kubernetes API base URL. Default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    when running in a pod."""

    poll_seconds: float = 1.0
    """How often the plan file is checked for a change, in seconds. Default: 1.0."""

    server_poll_seconds: float = 2.0
    """How often the node's server pods are listed, in seconds. Default: 2.0."""

    log_level: str = "INFO"
    """Logging level: DEBUG, INFO, WARNING or ERROR. Default: INFO."""

    def validate(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"--budget-bytes must be positive, got {self.budget_bytes}")
        if self.max_concurrent_downloads <= 0:
            raise ValueError(f"--max-concurrent-downloads must be positive, got {self.max_concurrent_downloads}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1..65535, got {self.port}")
        if not (0 < self.poll_seconds < math.inf and 0 < self.server_poll_seconds < math.inf):  # nan too
            raise ValueError("--poll-seconds and --server-poll-seconds must be positive and finite")
        if not 0 < self.download_stall_seconds < math.inf:
            raise ValueError(f"--download-stall-seconds must be positive and finite, got {self.download_stall_seconds}")
        if self.download_stall_bytes < 0:
            raise ValueError(f"--download-stall-bytes must not be negative, got {self.download_stall_bytes}")
        if self.plan_file is not None and (self.plan_configmap or self.plan_selector is not None):
            raise ValueError("give --plan-file or the plans of the API (--plan-configmap, --plan-selector), not both")
        for item in self.plan_configmap:
            ns, _, name = item.partition("/")
            if not ns or not name or "/" in name:
                raise ValueError(f"--plan-configmap must be NAMESPACE/NAME, got {item!r}")
        if len(set(self.plan_configmap)) != len(self.plan_configmap):
            raise ValueError("--plan-configmap names one plan twice")
        if self.stage_token_audience is not None and (not self.stage_token_audience.strip() or self.kube_api_url is None):
            raise ValueError("--stage-token-audience needs an audience and the Kubernetes API (--kube-api-url, "
                             "or run in a pod), which reviews the tokens")
        if self.plan_configmap and self.kube_api_url is None:
            raise ValueError("--plan-configmap needs the Kubernetes API (--kube-api-url, or run in a pod)")
        if self.plan_selector is not None:
            if not self.plan_selector.strip() or any(ch.isspace() for ch in self.plan_selector.strip()):
                raise ValueError(f"--plan-selector must be a label selector such as key=value, got {self.plan_selector!r}")
            if self.kube_api_url is None:
                raise ValueError("--plan-selector needs the Kubernetes API (--kube-api-url, or run in a pod)")
            if self.plan_namespace is None:
                raise ValueError("--plan-selector needs --plan-namespace (or $POD_NAMESPACE)")
        if self.plan_namespace is not None and not is_namespace(self.plan_namespace):
            raise ValueError(f"--plan-namespace {self.plan_namespace!r} is not a Kubernetes namespace name")
        for url in self.server_url:
            _check_http_url("--server-url", url)
        if self.kube_api_url is not None:
            _check_http_url("--kube-api-url", self.kube_api_url)
        if self.server_api_key_file is not None:
            if self.server_api_key is not None:
                raise ValueError("give --server-api-key or --server-api-key-file, not both")
            read_key_file(self.server_api_key_file, "--server-api-key-file")  # said now, not at the first warm-up
        if self.server_api_keys_dir is not None and not Path(self.server_api_keys_dir).is_dir():
            raise ValueError(f"--server-api-keys-dir {self.server_api_keys_dir}: no such folder")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"--log-level {self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")

    @classmethod
    def from_env_and_args(cls, argv: list[str] | None = None, env: typing.Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        args = vars(build_parser().parse_args(argv))
        settings = cls(**{k: v for k, v in args.items() if v is not None})
        if settings.node_name is None:
            settings.node_name = env.get("NODE_NAME") or None
        if settings.namespace is None and len(settings.plan_configmap) == 1 and "/" in settings.plan_configmap[0]:
            settings.namespace = settings.plan_configmap[0].split("/", 1)[0]
        if settings.namespace is None:
            settings.namespace = env.get("POD_NAMESPACE") or None
        if settings.plan_selector is not None and settings.plan_namespace is None:
            settings.plan_namespace = env.get("POD_NAMESPACE") or None
        if settings.server_api_key is None and settings.server_api_key_file is None:
            settings.server_api_key = env.get("LORAPLEX_SERVER_API_KEY") or None
        if settings.api_key is None:
            settings.api_key = env.get("LORAPLEX_NODE_AGENT_API_KEY") or None
        if settings.kube_api_url is None and env.get("KUBERNETES_SERVICE_HOST"):
            host = env["KUBERNETES_SERVICE_HOST"]
            host = f"[{host}]" if ":" in host else host
            settings.kube_api_url = f"https://{host}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"
        settings.validate()
        return settings

    def agent_config(self) -> AgentConfig:
        in_cluster = self.kube_api_url is not None and (SERVICE_ACCOUNT / "token").exists()
        return AgentConfig(
            cache_dir=self.cache_dir,
            budget_bytes=self.budget_bytes,
            max_concurrent_downloads=self.max_concurrent_downloads,
            download_stall_seconds=self.download_stall_seconds,
            download_stall_bytes=self.download_stall_bytes,
            plan_file=self.plan_file,
            plan_configmaps=tuple(self.plan_configmap),
            server_urls=tuple(self.server_url),
            node_name=self.node_name,
            namespace=self.namespace,
            kube_api_url=self.kube_api_url,
            kube_token_file=SERVICE_ACCOUNT / "token" if in_cluster else None,
            kube_ca_file=SERVICE_ACCOUNT / "ca.crt" if in_cluster else None,
            poll_seconds=self.poll_seconds,
            server_poll_seconds=self.server_poll_seconds,
            plan_selector=self.plan_selector.strip() if self.plan_selector is not None else None,
            plan_namespace=self.plan_namespace,
            server_api_key=self.server_api_key,
            server_api_key_file=Path(self.server_api_key_file) if self.server_api_key_file else None,
            server_api_keys_dir=Path(self.server_api_keys_dir) if self.server_api_keys_dir else None,
            api_key=self.api_key,
            stage_plan_adapters_only=self.stage_plan_adapters_only,
            stage_token_audience=self.stage_token_audience,
        )


def _check_http_url(flag: str, url: str) -> None:
    """An http(s) URL with a host, or ValueError naming the flag: 127.0.0.1:8000 without its
    scheme parses as scheme '127.0.0.1', and every request to it then fails for good."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # a bad port is a bad URL
    except ValueError as e:
        raise ValueError(f"{flag} {url!r} is not a URL ({e}); give http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r} is not an http(s) URL with a host; give http://HOST:PORT")


def build_parser() -> argparse.ArgumentParser:
    """One flag per Settings field; every default is None so unset flags keep the field's."""
    parser = argparse.ArgumentParser(
        prog="loraplex-node-agent",
        description="Stages LoRA adapters on this node's disk and warms this node's servers.")
    docs = field_docs(Settings)
    hints = typing.get_type_hints(Settings)
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if typing.get_origin(hint) is list:
            parser.add_argument(flag, dest=f.name, action="append", type=str, help=docs[f.name])
        elif base is bool:  # --flag / --no-flag
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=docs[f.name])
        else:
            parser.add_argument(flag, dest=f.name, type=base, help=docs[f.name])
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        settings = Settings.from_env_and_args(argv)
    except ValueError as e:
        sys.stderr.write(f"loraplex-node-agent: {e}\n")
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("node agent on %s port %d, cache %s, budget %d bytes, node %s", settings.host or "every address",
             settings.port, settings.cache_dir, settings.budget_bytes, settings.node_name or "(unset)")
    web.run_app(create_app(settings.agent_config()), host=settings.host, port=settings.port,
                print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
