"""A BaseModel's serving.apiKeys: the Secrets its servers' API keys come from, as the
Deployment gives them (env from a secretKeyRef, a Secret volume for --api-keys-file), read by
the server's own command line and auth middleware; and the specs refused because they would
give the keys another way."""

from __future__ import annotations

import json

import pytest

from loraplex.operator.specs import API_KEY_ENV, ApiKeys, BaseModelSpec, SecretKey, SpecError
from loraplex.operator.workloads import API_KEYS_FILE, deployment, needs_update

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
    env = {e["name"]: e for e in container["env"]}
    assert env["LORAPLEX_API_KEY"] == {"name": "LORAPLEX_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "llama-keys", "key": "admin-key"}}}
    assert [e["name"] for e in container["env"]][:3] == ["NODE_IP", "TRITON_CACHE_DIR", "LORAPLEX_API_KEY"]
    # The keys file: the Secret's key as keys.json in a folder mount (not subPath, which the
    # kubelet never updates), so a changed Secret reaches the server, which re-reads it.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/loraplex/api-keys", "readOnly": True}
    assert "subPath" not in mount
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume == {"name": "api-keys", "secret": {"secretName": "tenant-keys",
                                                     "items": [{"key": "keys.json", "path": "keys.json"}]}}
    assert f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}" == API_KEYS_FILE
    args = container["args"]
    assert args[args.index("--api-keys-file") + 1] == API_KEYS_FILE
    assert "--api-key" not in args  # never a key on the command line
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


def test_the_server_reads_the_keys_as_the_deployment_gives_them(tmp_path, monkeypatch):
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
    keys_file = tmp_path / "keys.json"  # the Secret volume's file, in the test's folder
    keys_file.write_text(json.dumps({"sk-acme": "acme"}))
    args = [str(keys_file) if a == API_KEYS_FILE else a.replace("$(NODE_IP)", "10.0.0.5") for a in container["args"]]
    # What the kubelet puts in the environment from llama-keys' admin-key.
    assert [e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})] == ["LORAPLEX_API_KEY"]
    monkeypatch.setenv("LORAPLEX_API_KEY", "sk-admin")
    settings = settings_module.ServerSettings.from_env_and_args(args)
    assert (settings.api_key, settings.api_keys_file) == ("sk-admin", str(keys_file))

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
