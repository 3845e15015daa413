"""Adapter names where they enter the server: POST /v1/load_lora_adapter, --lora-modules and
the operator's plan refuse a name that would break the endpoint picker's routing (a comma in
vllm:lora_requests_info), a path under --adapter-cache-dir or a /v1/adapters/{name} URL; a
refused name changes nothing on disk, least of all outside the cache directory."""

from __future__ import annotations


import httpx
import pytest

from loraplex.server.adapter_names import MAX_ADAPTER_NAME_LENGTH, InvalidAdapterName, check_adapter_name
from loraplex.server.adapter_sources import AdapterLoadError
from loraplex.server.api.app import create_app
from loraplex.server.cli import main as server_main
from loraplex.server.engine import LLMEngine
from loraplex.server.settings import ServerSettings
from loraplex.server.slot_table import CachedAdapter

from .conftest import LiveServer
from .test_adapter_cache import _Files, make_cache, write_adapter

BAD_NAMES = [
    "a,b",  # vllm:lora_requests_info joins names with commas; the picker splits on them
    "a/b", "../escape", "/abs", "a\\b",  # paths
    ".hidden", "..", ".", "-flag",  # hidden files, path parts, a flag
    "a b", " a", "a\n", "a\t",  # whitespace
    "café", "a%2Fb",  # non-ASCII, percent-encoding
    "x" * (MAX_ADAPTER_NAME_LENGTH + 1),
    "",
]
GOOD_NAMES = ["sql", "SQL-v2", "a.b_c@1+2", "0", "x" * MAX_ADAPTER_NAME_LENGTH,
              "my-adapter.v1"]  # a Kubernetes object name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_rule_refuses_with_a_reason(name):
    with pytest.raises(InvalidAdapterName, match="adapter name"):
        check_adapter_name(name)


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_the_rule_takes_kubernetes_and_vllm_style_names(name):
    assert check_adapter_name(name) == name


def test_a_comma_is_refused_with_the_routing_reason():
    with pytest.raises(InvalidAdapterName, match="lora_requests_info"):
        check_adapter_name("sql,poet")


@pytest.fixture
def server(tmp_path):
    write_adapter(tmp_path / "disk" / "a", seed=1)
    settings = ServerSettings(dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64,
                              max_loras=2, max_lora_rank=8, cuda_graphs=False, served_model_name="tiny",
                              adapter_cache_dir=str(tmp_path / "cache"))
    engine = LLMEngine.from_settings(settings)
    with LiveServer(create_app(engine)) as s:
        s.engine = engine
        s.adapter = tmp_path / "disk" / "a"
        yield s


@pytest.mark.parametrize("name", ["a,b", "a/b", "../escape", ".hidden", "a b", "café", "x" * 254])
def test_load_lora_adapter_refuses_a_bad_name_with_a_400(server, name):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(server.adapter)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "lora_name" and err["code"] == "invalid_adapter_name"
        assert "adapter name" in err["message"]
        assert name not in {m["id"] for m in client.get("/v1/models").json()["data"]}
        # Nor does a request for it reach an adapter.
        assert client.post("/v1/completions", json={"model": name, "prompt": [1, 2], "max_tokens": 1}).status_code \
            in (404, 400)


def test_a_slashed_name_in_an_adapter_url_is_an_openai_404(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for action in ("pin", "unpin", "prefetch"):
            r = client.post(f"/v1/adapters/acme/sql-lora/{action}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_load_lora_adapter_takes_an_upper_case_name(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "SQL-v2", "lora_path": str(server.adapter)})
        assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"model": "SQL-v2", "prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert client.post("/v1/adapters/SQL-v2/pin").json()["pinned"] is True


@pytest.mark.parametrize("name", ["a,b", "../x", "a/b", ".x"])
def test_lora_modules_refuses_a_bad_name(name, capsys):
    with pytest.raises(ValueError, match="--lora-modules"):
        ServerSettings(dummy_weights="tiny", lora_modules=[f"{name}=/adapters/x"])
    assert server_main(["--dummy-weights", "tiny", "--lora-modules", f"{name}=/adapters/x"]) == 2
    assert "adapter name" in capsys.readouterr().err


def test_a_plan_adapter_with_a_bad_name_is_left_out(tmp_path):
    write_adapter(tmp_path / "src", seed=3)
    cache = make_cache(tmp_path / "cache", slots=2)
    try:
        cache.apply_plan({"pinned": ["a,b", "good"], "prefetch": [{"name": "a,b", "start": "", "end": ""}],
                          "adapters": [{"name": "a,b", "source": str(tmp_path / "src"), "pinned": True},
                                       {"name": "../up", "source": str(tmp_path / "src")},
                                       {"name": "good", "source": str(tmp_path / "src"), "pinned": True}]})
        assert {e.name for e in cache.known()} == {"good"}
        assert not cache.has("a,b") and not cache.has("../up")
        cache.prefetch("good").result(10)
    finally:
        cache.close()


def test_a_fetch_never_writes_outside_the_cache_dir(tmp_path):
    """A name that is a path (a hand-written plan, a caller of AdapterCache.register) must not
    lead the direct http(s) fetch out of --adapter-cache-dir: `cache/../victim` would be
    deleted and replaced by the download."""
    write_adapter(tmp_path / "bucket" / "sql", seed=2)
    cache_dir = tmp_path / "cache"
    (cache_dir / "...").mkdir(parents=True)  # lets the temporary folder ".../victim.*" be made
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    with _Files(tmp_path / "bucket") as bucket:
        cache = make_cache(cache_dir, slots=2)
        try:
            # past register's check, as a caller that skips it would
            cache.table.entries["../victim"] = CachedAdapter("../victim", source=f"{bucket.url}/sql")
            with pytest.raises(AdapterLoadError, match="adapter name"):
                cache.prefetch("../victim").result(10)
        finally:
            cache.close()
    assert (victim / "keep").read_text() == "mine" and sorted(p.name for p in victim.iterdir()) == ["keep"]


def test_a_long_name_is_fetched_over_http(tmp_path):
    """A 253-character name (the longest Kubernetes name) fits its temporary folder too."""
    write_adapter(tmp_path / "bucket" / "sql", seed=2)
    name = "a" * MAX_ADAPTER_NAME_LENGTH
    with _Files(tmp_path / "bucket") as bucket:
        cache = make_cache(tmp_path / "cache", slots=2)
        try:
            cache.register(name, source=f"{bucket.url}/sql")
            cache.prefetch(name).result(10)
            assert (tmp_path / "cache" / name / "adapter_model.safetensors").is_file()
        finally:
            cache.close()


def test_an_adapter_named_as_the_base_is_refused_at_every_entry(tmp_path):
    """A request whose model is the base's name runs on the base: an adapter of that name
    would be loaded, pinned and listed, and never used."""
    write_adapter(tmp_path / "a", seed=1)
    write_adapter(tmp_path / "cache" / "tiny", seed=2)  # found by name on disk
    fields = dict(dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64,
                  max_loras=2, max_lora_rank=8, cuda_graphs=False, served_model_name="tiny",
                  adapter_cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="base model's name"):  # --lora-modules: refused at start
        ServerSettings(**fields, lora_modules=[f"tiny={tmp_path / 'a'}", f"other={tmp_path / 'a'}"])
    engine = LLMEngine.from_settings(ServerSettings(**fields, lora_modules=[f"other={tmp_path / 'a'}"]))
    try:
        assert not engine.adapters.has("tiny") and engine.adapters.has("other")
        assert "tiny" not in {row["name"] for row in engine.adapters.describe()}
        engine.adapters.apply_plan({"pinned": ["tiny"], "adapters": [
            {"name": "tiny", "source": str(tmp_path / "a"), "pinned": True}]})
        assert not engine.adapters.has("tiny")
        assert not any(e.pinned for e in engine.adapters.known())
    finally:
        engine.adapters.close()


def plan_engine(tmp_path, **kw) -> LLMEngine:
    settings = ServerSettings(dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64,
                              max_loras=2, max_lora_rank=8, cuda_graphs=False, served_model_name="tiny",
                              adapter_cache_dir=str(tmp_path / "node-cache"),
                              plan_file=str(tmp_path / "plan.json"), **kw)
    return LLMEngine.from_settings(settings)


def test_a_server_following_a_plan_finds_on_disk_only_the_plans_adapters(tmp_path):
    """The node's cache (the node agent's, one host path) holds the adapters of every base
    whose servers run on the node, of every namespace: a server of one base must not load
    another base's (or another tenant's) adapter because a request names it."""
    for i, name in enumerate(["mine", "pin-only", "theirs"]):
        write_adapter(tmp_path / "node-cache" / name, seed=i)
    engine = plan_engine(tmp_path)
    cache = engine.adapters
    try:
        assert not cache.has("theirs") and not cache.has("mine")  # no plan read yet
        cache.apply_plan({"pinned": ["pin-only"], "prefetch": [],
                          "adapters": [{"name": "mine", "source": "s3://bucket/mine", "pinned": False}]})
        assert cache.has("mine") and cache.tier_of("mine") == "disk"
        assert cache.has("pin-only")  # a plan's pin found on disk
        assert not cache.has("theirs")
        assert "theirs" not in {row["name"] for row in cache.describe()}
        with pytest.raises(KeyError):
            cache.acquire("theirs")
    finally:
        cache.close()


def test_a_server_without_a_plan_finds_any_adapter_on_disk(tmp_path):
    write_adapter(tmp_path / "node-cache" / "any", seed=1)
    settings = ServerSettings(dummy_weights="tiny", device="cpu", dtype="float32", max_model_len=64, max_loras=2,
                              max_lora_rank=8, cuda_graphs=False, adapter_cache_dir=str(tmp_path / "node-cache"))
    engine = LLMEngine.from_settings(settings)
    try:
        assert engine.adapters.has("any")
    finally:
        engine.adapters.close()


def test_an_adapter_that_leaves_the_plan_is_no_longer_served(tmp_path):
    """A LoRAAdapter deleted (or moved to another base) leaves the plan: its servers stop
    serving it, once the requests in flight finish; what the admin API loaded stays."""
    write_adapter(tmp_path / "node-cache" / "gone", seed=1)
    write_adapter(tmp_path / "adm", seed=2)
    engine = plan_engine(tmp_path)
    cache = engine.adapters
    try:
        cache.apply_plan({"pinned": ["gone"], "prefetch": [],
                          "adapters": [{"name": "gone", "source": "s3://bucket/gone", "pinned": True}]})
        cache.prefetch("gone").result(10)
        cache.load("adm", tmp_path / "adm")
        assert cache.acquire("gone") >= 0  # a request in flight
        cache.apply_plan({"pinned": [], "adapters": [], "prefetch": []})
        assert not cache.has("gone")  # no new request gets it
        cache.release("gone")  # the one in flight finishes
        assert {e.name for e in cache.known()} == {"adm"} and cache.num_free == 1
        assert "gone" not in {row["name"] for row in cache.describe()}
    finally:
        cache.close()


def test_every_character_of_the_rule_survives_the_adapter_urls(server):
    """The node agent quotes a name into /v1/adapters/{name}/pin (urllib.parse.quote): '@' and
    '+' arrive percent-encoded and must name the same adapter; a '/' (encoded or not) is no name."""
    import urllib.parse

    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a@1+2.x_y", "lora_path": str(server.adapter)})
        assert r.status_code == 200, r.text
        r = client.post(f"/v1/adapters/{urllib.parse.quote('a@1+2.x_y')}/pin")
        assert r.status_code == 200 and r.json()["name"] == "a@1+2.x_y" and r.json()["pinned"], r.text
        for path in ("/v1/adapters/a%2Fb/pin", "/v1/adapters/a/b/pin"):
            r = client.post(path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
