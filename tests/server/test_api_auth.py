"""API keys and the tenant check over real HTTP: without a key nothing under /v1/ answers but a
401; a tenant's key sees and uses the base and its own adapters (and untenanted ones) only,
another tenant's adapter being a 404 as if unknown; admin endpoints need an admin key; the
keys file is re-read when it changes; probes and metrics stay open."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from loraplex.server import api_keys
from loraplex.server.api_keys import APIKeys, Caller, read_key_file, read_keys_file

from .test_adapter_cache import write_adapter
from .test_adapter_cache_http import serve  # noqa: F401 - the fixture
from .test_adapter_cache_http import disk  # noqa: F401 - the fixture

ADMIN, ACME, GLOBEX = "sk-admin-1", "sk-acme-1", "sk-globex-1"
# "c" is in the plan with no tenant: anyone's.
PLAN = {"adapters": [{"name": "a", "tenant": "acme"}, {"name": "b", "tenant": "globex"}, {"name": "c"}],
        "pinned": [], "prefetch": []}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(c: httpx.Client, model: str, key: str | None) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0},
                  headers=bearer(key) if key else {})


@pytest.fixture
def keyed(serve, disk, tmp_path_factory):  # noqa: F811 - pytest's fixture by name
    folder = tmp_path_factory.mktemp("keys")
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps({ACME: "acme", GLOBEX: "globex", "sk-ops": "*"}))
    plan = folder / "plan.json"
    plan.write_text(json.dumps(PLAN))
    server = serve(api_key=ADMIN, api_keys_file=str(keys_file), plan_file=str(plan))
    server.keys_file = keys_file
    return server


def test_every_v1_route_needs_a_key_and_the_probes_do_not(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/adapters"), ("POST", "/v1/load_lora_adapter"),
                             ("POST", "/v1/adapters/a/pin"), ("POST", "/v1/sessions")):
            for headers, said in (({}, "No API key"), (bearer("sk-wrong"), "Incorrect API key"),
                                  ({"Authorization": ADMIN}, "No API key"), ({"Authorization": "Basic eDp5"}, "No")):
                r = c.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert err["message"].startswith(said) and r.headers["www-authenticate"] == "Bearer"
        for path in ("/healthz", "/readyz", "/metrics"):
            assert c.get(path).status_code == 200, path
        assert complete(c, "tiny", ADMIN).status_code == 200
        assert complete(c, "tiny", "sk-ops").status_code == 200  # a "*" key in the file is an admin's
        r = c.get("/v1/models", headers={"authorization": f"bearer {ACME}"})  # the scheme in any case
        assert r.status_code == 200


def test_a_tenant_sees_and_uses_its_own_adapters_only(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        models = {key: {m["id"] for m in c.get("/v1/models", headers=bearer(key)).json()["data"]}
                  for key in (ADMIN, ACME, GLOBEX)}
        assert {"tiny", "a", "b", "c"} <= models[ADMIN]
        assert {"tiny", "a", "c"} <= models[ACME] and "b" not in models[ACME]
        assert {"tiny", "b", "c"} <= models[GLOBEX] and "a" not in models[GLOBEX]

        assert complete(c, "a", ACME).status_code == 200
        assert complete(c, "tiny", ACME).status_code == 200
        assert complete(c, "c", ACME).status_code == 200
        for r in (complete(c, "b", ACME), c.get("/v1/models/b", headers=bearer(ACME)),
                  c.post("/v1/chat/completions", headers=bearer(ACME),
                         json={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                  c.post("/v1/adapters/b/prefetch", headers=bearer(ACME)),
                  c.post("/v1/sessions", headers=bearer(ACME), json={"model": "b"})):
            # Another tenant's adapter is, to this key, one that does not exist: the same answer.
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found"
            assert r.json()["error"] == complete(c, "nonexistent", ACME).json()["error"] | {
                "message": r.json()["error"]["message"]}
        assert complete(c, "b", GLOBEX).status_code == 200
        assert complete(c, "b", ADMIN).status_code == 200
        rows = c.get("/v1/adapters", headers=bearer(ACME)).json()["data"]
        assert {r["name"] for r in rows} >= {"a", "c"} and "b" not in {r["name"] for r in rows}
        assert {r["name"]: r["tenant"] for r in c.get("/v1/adapters", headers=bearer(ADMIN)).json()["data"]
                if r["name"] in "ab"} == {"a": "acme", "b": "globex"}
        assert c.post("/v1/sessions", headers=bearer(ACME), json={"model": "a"}).status_code == 200


def test_tokenize_and_detokenize_need_a_key_and_keep_other_tenants_adapters_unknown(keyed):
    """vLLM leaves /tokenize and /detokenize open; here they need a key as /v1/ does, since
    their `model` is checked: another tenant's adapter is a 404 there too."""
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert c.post(path, json=body).status_code == 401
            assert c.post(path, json=body, headers=bearer("sk-wrong")).status_code == 401
            own = c.post(path, json={**body, "model": "a"}, headers=bearer(ACME))
            other = c.post(path, json={**body, "model": "b"}, headers=bearer(ACME))
            assert own.status_code != 404 and other.status_code == 404, (own.text, other.text)
            assert other.json()["error"]["code"] == "model_not_found"
            assert c.post(path, json={**body, "model": "b"}, headers=bearer(ADMIN)).status_code != 404


def test_admin_endpoints_need_an_admin_key(keyed, disk):  # noqa: F811
    write_adapter(disk / "late", seed=9)
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(disk / "late")}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"}),
                           ("/v1/adapters/a/pin", None), ("/v1/adapters/a/unpin", None)):
            r = c.post(path, headers=bearer(ACME), json=body)
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "admin_key_required" and r.json()["error"]["type"] == "permission_error"
        assert "late" not in {m["id"] for m in c.get("/v1/models", headers=bearer(ADMIN)).json()["data"]}
        assert not keyed.engine.adapters.table.entries["a"].pinned
        r = c.post("/v1/load_lora_adapter", headers=bearer(ADMIN), json={"lora_name": "late",
                                                                          "lora_path": str(disk / "late")})
        assert r.status_code == 200, r.text
        assert c.post("/v1/adapters/a/pin", headers=bearer(ADMIN)).status_code == 200
        # An adapter an admin loaded belongs to no tenant: every key may use it.
        assert complete(c, "late", GLOBEX).status_code == 200


def test_the_keys_file_is_read_again_when_it_changes(keyed, monkeypatch):
    monkeypatch.setattr(api_keys, "RELOAD_SECONDS", 0.0)
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        assert complete(c, "a", ACME).status_code == 200
        # A Secret's mount is swapped, not edited: a new file renamed over the old.
        new = keyed.keys_file.with_name("keys.json.new")
        new.write_text(json.dumps({"sk-acme-2": "acme", GLOBEX: "globex"}))
        os.replace(new, keyed.keys_file)
        assert complete(c, "a", ACME).status_code == 401  # revoked
        assert complete(c, "a", "sk-acme-2").status_code == 200
        # A file that no longer parses keeps the keys read before it.
        keyed.keys_file.write_text("{not json")
        time.sleep(0.01)
        assert complete(c, "a", "sk-acme-2").status_code == 200
        assert complete(c, "tiny", ADMIN).status_code == 200  # --api-key is not in the file


def test_the_admin_key_file_rotates_the_admin_key_without_a_restart(serve, disk, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(api_keys, "RELOAD_SECONDS", 0.0)
    admin = tmp_path / "admin-key"
    admin.write_text("sk-admin-old\n")  # as `kubectl create secret --from-file` keeps a newline
    server = serve(api_key_file=str(admin))
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert complete(c, "a", "sk-admin-old").status_code == 200
        assert c.post("/v1/adapters/a/pin", headers=bearer("sk-admin-old")).status_code == 200
        assert complete(c, "a", None).status_code == 401
        new = admin.with_name("admin-key.new")
        new.write_text("sk-admin-new")
        os.replace(new, admin)
        assert complete(c, "a", "sk-admin-old").status_code == 401  # the old key is gone
        assert complete(c, "a", "sk-admin-new").status_code == 200
        assert c.post("/v1/adapters/a/unpin", headers=bearer("sk-admin-new")).status_code == 200
        # An emptied file (a Secret being rewritten) keeps the key read before it.
        admin.write_text("")
        time.sleep(0.01)
        assert complete(c, "a", "sk-admin-new").status_code == 200


@pytest.mark.parametrize("text, words", [("", "empty"), ("  \n", "empty"), ("sk-a sk-b", "more than one word"),
                                         (b"\xff", "not UTF-8")])
def test_an_admin_key_file_that_holds_no_one_key_is_refused(tmp_path, text, words):
    path = tmp_path / "admin-key"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=words):
        read_key_file(path)
    with pytest.raises(ValueError, match="--api-key-file .*No such file"):
        APIKeys(api_key_file=tmp_path / "missing")
    path.write_text("\tsk-ok\r\n")
    assert read_key_file(path) == "sk-ok"


def test_the_cli_refuses_an_admin_key_file_it_cannot_read_before_loading_anything(tmp_path, capsys):
    from loraplex.server.cli import main

    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--api-key-file", str(tmp_path / "none")]) == 2
    assert "--api-key-file" in capsys.readouterr().err


def test_an_open_server_takes_any_request_and_shows_every_adapter(serve):  # noqa: F811
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert complete(c, "a", None).status_code == 200
        assert complete(c, "a", "sk-anything").status_code == 200


@pytest.mark.parametrize("text, words", [
    ("[]", "JSON object"), ("{bad", "not JSON"), ('{"k": ""}', "tenant name"), ('{"k": 5}', "tenant name"),
    ('{"": "acme"}', "tenant name"),
])
def test_a_keys_file_that_is_not_one_is_refused_with_the_reason(tmp_path, text, words):
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=words):
        read_keys_file(path)
    with pytest.raises(ValueError, match="No such file"):
        read_keys_file(tmp_path / "missing.json")


def test_the_cli_refuses_a_keys_file_that_is_not_one_before_loading_anything(tmp_path, capsys):
    from loraplex.server.cli import main

    (tmp_path / "keys.json").write_text("[]")
    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--api-keys-file", str(tmp_path / "keys.json")]) == 2
    assert "--api-keys-file" in capsys.readouterr().err


def test_callers_and_tenants():
    keys = APIKeys("sk-x")
    assert keys.caller("Bearer sk-x") == Caller(None) and keys.caller("Bearer sk-y") is None
    assert keys.caller(None) is None and keys.caller("Bearer ") is None
    assert APIKeys().caller(None) == Caller(None)  # no keys: open
    acme = Caller("acme")
    assert acme.may_use("acme") and acme.may_use(None) and not acme.may_use("globex") and not acme.admin
    assert Caller(None).may_use("globex")
