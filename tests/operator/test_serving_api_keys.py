"""A BaseModel's serving.apiKeys: the Secrets its servers' API keys come from, as the
Deployment gives them (both files of one projected volume, for --api-key-file and
--api-keys-file), read by
the server's own command line and auth middleware; and the specs refused because they would
give the keys another way."""

from __future__ import annotations

import json

import pytest

from loraplex.operator.specs import API_KEY_ENV, ApiKeys, BaseModelSpec, SecretKey, SpecError
from loraplex.operator.workloads import ADMIN_KEY_FILE, API_KEYS_FILE, deployment, needs_update

from .test_manifests import validator


def body(serving=None) -> dict:
    spec = {"source": "/models/llama-3-8b", "maxLoraRank": 16, "memory": {"slots": 8}}
    if serving is not None:
        spec["serving"] = serving
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
            "metadata": {"name": "llama-3-8b", "namespace": "ml"}, "spec": spec}


BOTH = {"apiKeys": {"adminKeySecret": {"name": "llama-keys", "key": "admin-key"},
                    "tenantKeysSecret": {"name": "tenant-keys"}}}


def _container(base: BaseModelSpec) -> tuple[dict, dict]:
    pod = deployment(base, 8)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container, pod


def test_api_keys_parse_with_the_schemas_defaults():
    assert validator("BaseModel").is_valid(body(BOTH))
    base = BaseModelSpec.from_body(body(BOTH))
    assert base.serving.api_keys == ApiKeys(admin_key_secret=SecretKey("llama-keys", "admin-key"),
                                            tenant_keys_secret=SecretKey("tenant-keys", "keys.json"))
    assert BaseModelSpec.from_body(body()).serving.api_keys == ApiKeys()
    assert BaseModelSpec.from_body(body({"apiKeys": {"adminKeySecret": {"name": "k"}}})).serving.api_keys == \
        ApiKeys(admin_key_secret=SecretKey("k", "api-key"))


def test_the_deployment_gives_the_keys_from_their_secrets():
    container, pod = _container(BaseModelSpec.from_body(body(BOTH)))
    assert not {e["name"] for e in container["env"]} & API_KEY_ENV  # files, not variables read once
    # Both keys as files in a folder mount (not subPath, which the kubelet never updates), so
    # a changed Secret reaches the server, which re-reads them: a key rotates without a restart.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/loraplex/api-keys", "readOnly": True}
    assert "subPath" not in mount
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume == {"name": "api-keys", "projected": {"sources": [
        {"secret": {"name": "llama-keys", "items": [{"key": "admin-key", "path": "admin-key"}]}},
        {"secret": {"name": "tenant-keys", "items": [{"key": "keys.json", "path": "keys.json"}]}}]}}
    files = [f"{mount['mountPath']}/{src['secret']['items'][0]['path']}" for src in volume["projected"]["sources"]]
    assert files == [ADMIN_KEY_FILE, API_KEYS_FILE]
    args = container["args"]
    assert args[args.index("--api-key-file") + 1] == ADMIN_KEY_FILE
    assert args[args.index("--api-keys-file") + 1] == API_KEYS_FILE
    assert "--api-key" not in args  # never a key on the command line
    # One Secret alone: its file alone.
    container, pod = _container(BaseModelSpec.from_body(body({"apiKeys": {"adminKeySecret": {"name": "k"}}})))
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["projected"]["sources"] == [{"secret": {"name": "k", "items": [{"key": "api-key",
                                                                                  "path": "admin-key"}]}}]
    assert "--api-key-file" in container["args"] and "--api-keys-file" not in container["args"]
    # The probes stay on the open paths.
    assert {container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == \
        {"/healthz", "/readyz"}


def test_without_api_keys_the_deployment_has_none_and_taking_them_out_is_a_change():
    plain = BaseModelSpec.from_body(body())
    container, pod = _container(plain)
    assert "--api-keys-file" not in container["args"]
    assert not {e["name"] for e in container["env"]} & API_KEY_ENV
    assert "api-keys" not in {v["name"] for v in pod["volumes"]}
    assert needs_update(deployment(BaseModelSpec.from_body(body(BOTH)), 8), deployment(plain, 8))
    assert needs_update(deployment(plain, 8), deployment(BaseModelSpec.from_body(body(BOTH)), 8))


def test_the_server_reads_the_keys_as_the_deployment_gives_them(tmp_path):
    """The container's command line and environment, as the kubelet gives them from the two
    Secrets, into the server's settings and its auth middleware: /v1/ needs the admin or a
    tenant's key, the probes' paths and /metrics need none."""
    settings_module = pytest.importorskip("loraplex.server.settings")
    auth = pytest.importorskip("loraplex.server.api.auth")
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    container, _ = _container(BaseModelSpec.from_body(body(BOTH)))
    # The projected volume's files, in the test's folder.
    (tmp_path / "keys.json").write_text(json.dumps({"sk-acme": "acme"}))
    (tmp_path / "admin-key").write_text("sk-admin\n")
    mounted = {API_KEYS_FILE: str(tmp_path / "keys.json"), ADMIN_KEY_FILE: str(tmp_path / "admin-key")}
    args = [mounted.get(a, a.replace("$(NODE_IP)", "10.0.0.5")) for a in container["args"]]
    settings = settings_module.ServerSettings.from_env_and_args(args)
    assert (settings.api_key_file, settings.api_keys_file) == (mounted[ADMIN_KEY_FILE], mounted[API_KEYS_FILE])

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok) for p in ("/healthz", "/readyz", "/metrics", "/v1/models")])
    client = TestClient(auth.Authenticate(app, auth.APIKeys.from_settings(settings)))
    probes = {container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    for path in [*sorted(probes), "/metrics"]:
        assert client.get(path).status_code == 200, path
    assert client.get("/v1/models").status_code == 401
    for key in ("sk-admin", "sk-acme"):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


@pytest.mark.parametrize(("serving", "says"), [
    ({"extraArgs": ["--api-key", "sk-x"]}, "serving.apiKeys"),
    ({"extraArgs": ["--api-keys-file=/mnt/keys.json"]}, "--api-keys-file"),
    ({"extraArgs": ["--api-keys", "/mnt/keys.json"]}, "--api-keys-file"),  # argparse takes a unique prefix
    ({"env": [{"name": "LORAPLEX_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
     "serving.apiKeys"),
    ({"env": [{"name": "LORAPLEX_API_KEYS_FILE", "value": "/mnt/keys.json"}]}, "LORAPLEX_API_KEYS_FILE"),
    ({"env": [{"name": "LORAPLEX_API_KEY_FILE", "value": "/mnt/admin-key"}]}, "LORAPLEX_API_KEY_FILE"),
    ({"extraArgs": ["--api-key-file", "/mnt/admin-key"]}, "--api-key-file"),
    ({"apiKeys": "llama-keys"}, "serving.apiKeys must be an object"),
    ({"apiKeys": {"adminKeySecret": "llama-keys"}}, "adminKeySecret must be an object"),
    ({"apiKeys": {"adminKeySecret": {"key": "k"}}}, "adminKeySecret.name"),
    ({"apiKeys": {"tenantKeysSecret": {"name": "Tenant_Keys"}}}, "tenantKeysSecret.name"),
    ({"apiKeys": {"tenantKeysSecret": {"name": "t", "key": "keys/json"}}}, "tenantKeysSecret.key"),
])
def test_keys_given_another_way_or_malformed_are_refused(serving, says):
    with pytest.raises(SpecError, match=says.replace("-", r"\-").replace(".", r"\.")):
        BaseModelSpec.from_body(body(serving))
    # The API server refuses them first where the schema can say so.
    if "apiKeys" in serving or "env" in serving:
        assert not validator("BaseModel").is_valid(body(serving))
