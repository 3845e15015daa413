"""Sources by URI scheme: URL building, error reasons, and no signature in any message."""

from __future__ import annotations

import aiohttp
import pytest

from loraplex.node_agent.sources import HTTPSource, LocalSource, SourceError, open_source
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError

from .helpers import make_adapter

URLS = [
    ("https://bucket.example/adapters/sql-v2/", "adapter_config.json",
     "https://bucket.example/adapters/sql-v2/adapter_config.json"),
    ("https://bucket.example/adapters/sql-v2", "adapter_model.safetensors",
     "https://bucket.example/adapters/sql-v2/adapter_model.safetensors"),
    ("http://h:9000/a/b?token=abc&x=1", "adapter_config.json", "http://h:9000/a/b/adapter_config.json?token=abc&x=1"),
]


@pytest.mark.parametrize("uri,filename,url", URLS)
def test_http_file_urls_keep_the_query(uri, filename, url):
    assert HTTPSource(uri, session=None).url(filename) == url


@pytest.mark.parametrize("uri,kind,reason", [
    ("/mnt/adapters/a", LocalSource, None), ("file:///mnt/adapters/a", LocalSource, None),
    ("https://h/a/", HTTPSource, None), ("s3://bucket/a", None, "Unsupported"),
    ("relative/path", None, "Unsupported"),
])
async def test_open_source_by_scheme(uri, kind, reason):
    async with aiohttp.ClientSession() as session:
        if reason is None:
            assert isinstance(open_source(uri, session), kind)
        else:
            with pytest.raises(SourceError) as err:
                open_source(uri, session)
            assert err.value.reason == reason


async def test_errors_never_show_the_query_string(object_store):
    async with aiohttp.ClientSession() as session:
        source = open_source(object_store.source("missing") + "?X-Signature=s3cr3t", session)
        with pytest.raises(SourceError) as err:
            async with source.open("adapter_config.json"):
                pass
    assert err.value.reason == "NotFound" and "s3cr3t" not in str(err.value)


async def test_api_listing_hides_the_query_string(tmp_path, object_store):
    object_store.add("a", tmp_path)
    async with aiohttp.ClientSession() as session:
        store = AdapterStore(tmp_path / "cache", 10**9, session=session)
        staged = await store.stage(AdapterRef("a", object_store.source("a") + "?token=s3cr3t",
                                              object_store.adapters["a"].sha256))
    assert "s3cr3t" not in str(staged.as_json()) and staged.as_json()["source"].endswith("/a/?…")


async def test_local_source_streams_the_whole_file(tmp_path):
    make_adapter(tmp_path / "a")
    want = (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    source = open_source(str(tmp_path / "a"), None)
    async with source.open("adapter_model.safetensors") as fetch:
        got = b"".join([c async for c in fetch.chunks])
    assert fetch.size == len(want) and got == want
    with pytest.raises(SourceError) as err:
        async with source.open("nope.json"):
            pass
    assert err.value.reason == "NotFound"


async def test_a_local_source_whose_file_is_a_folder_or_whose_folder_is_a_file_is_not_found(tmp_path):
    """A weights path that is a folder (or a source path that is a file) answered Unreachable,
    as if the mount were down: it holds no adapter, which is NotFound."""
    (tmp_path / "a" / "adapter_model.safetensors").mkdir(parents=True)
    (tmp_path / "f").write_text("not a folder")
    for uri, filename in ((tmp_path / "a", "adapter_model.safetensors"), (tmp_path / "f", "adapter_config.json")):
        with pytest.raises(SourceError) as err:
            async with open_source(str(uri), None).open(filename):
                pass
        assert err.value.reason == "NotFound" and "not a file" in str(err.value)


@pytest.mark.parametrize("uri", ["http://[::1/adapters/a/", "https://[bad/x", "http:///adapters/a/", "https://"])
async def test_a_malformed_source_url_is_refused_as_such(tmp_path, uri):
    """A source URL that does not parse, or names no host, is a bad request (400, not retried),
    not a disk fault (500, logged with a traceback and retried by the plan loop for ever) or
    an unreachable host (502, retried)."""
    async with aiohttp.ClientSession() as session:
        with pytest.raises(SourceError) as err:
            open_source(uri, session)
        assert err.value.reason == "InvalidRequest" and "URL" in str(err.value)
        store = AdapterStore(tmp_path / "cache", 10**9, session=session)
        with pytest.raises(StoreError) as err:
            await store.stage(AdapterRef("a", uri, None))
    assert err.value.reason == "InvalidRequest" and err.value.status == 400
    assert store.metrics.failures.labels("DiskError")._value.get() == 0


@pytest.fixture
async def redirector():
    """/loop/<f> redirects to itself; /away/<f> redirects to a signed URL on a closed port."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def loop(request):
        raise web.HTTPFound(str(request.url))

    async def away(request):
        raise web.HTTPFound("http://127.0.0.1:1/elsewhere/file?X-Amz-Signature=0th3r")

    app = web.Application()
    app.router.add_get("/loop/{f}", loop)
    app.router.add_get("/away/{f}", away)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.mark.parametrize("path,says", [("loop", "redirect"), ("away", "Cannot connect")])
async def test_a_redirect_that_fails_never_shows_a_signature(tmp_path, redirector, path, says):
    """A presigned source that redirects for ever (or to a host that does not answer): the
    error used to carry aiohttp's own text, the full signed URL in it (\"0, message='',
    url='http://…?X-Signature=s3cr3t'\"), into the log, the API answer and the CR's status."""
    async with aiohttp.ClientSession() as session:
        store = AdapterStore(tmp_path / "cache", 10**9, session=session)
        with pytest.raises(StoreError) as err:
            await store.stage(AdapterRef("a", f"{redirector}/{path}/?X-Signature=s3cr3t", None))
    message = str(err.value)
    assert err.value.reason == "Unreachable" and says in message
    assert "s3cr3t" not in message and "0th3r" not in message, message


@pytest.fixture
async def compressing_store(tmp_path):
    """Serves an adapter compressed: as a web server or CDN that gzips what the client accepts
    ("accepts"), or one whose objects are stored gzipped and sent so whatever is asked ("always")."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE

    sha = make_adapter(tmp_path / "src" / "a", seed=3)
    files = {f: (tmp_path / "src" / "a" / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE)}
    asked = []

    async def handle(request):
        asked.append(request.headers.get("Accept-Encoding"))
        resp = web.Response(body=files[request.match_info["file"]])
        if request.match_info["how"] == "always":
            resp.enable_compression(web.ContentCoding.gzip)
        else:
            resp.enable_compression()
        return resp

    app = web.Application()
    app.router.add_get("/{how}/a/{file}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), sha, files, asked
    await server.close()


@pytest.mark.parametrize("how", ["accepts", "always"])
async def test_a_source_that_compresses_its_answers_is_staged(tmp_path, compressing_store, how):
    """aiohttp asks for gzip by default and decodes it, but the agent compared the decoded
    bytes with the Content-Length, which counts the encoded ones: every adapter from a
    source that compresses (a CDN, nginx with gzip on for JSON) failed as Truncated, retried
    for ever. The agent now asks for the file as it is, and takes a compressed answer's
    size as unknown (the budget then grows with the bytes)."""
    from loraplex.node_agent.adapter_files import WEIGHTS_FILE

    url, sha, files, asked = compressing_store
    async with aiohttp.ClientSession() as session:
        store = AdapterStore(tmp_path / "cache", 10**9, session=session)
        staged = await store.stage(AdapterRef("a", f"{url}/{how}/a/", sha))
    assert (tmp_path / "cache" / "a" / WEIGHTS_FILE).read_bytes() == files[WEIGHTS_FILE]
    assert staged.bytes == sum(len(b) for b in files.values())
    assert set(asked) == {"identity"}


@pytest.mark.parametrize("uri", ["/mnt/adapters/a\x00b", "file:///mnt/a\x00", "file:relative/a", "file://"])
async def test_a_source_path_that_cannot_name_a_directory_is_refused(tmp_path, uri):
    """A path with a NUL byte made open() raise ValueError inside the download: a 500
    DiskError with a traceback, retried by the plan loop for ever. A file: URI without an
    absolute path was read relative to wherever the agent runs (file:// itself: its working
    directory). Both are bad requests (400)."""
    async with aiohttp.ClientSession() as session:
        store = AdapterStore(tmp_path / "cache", 10**9, session=session)
        with pytest.raises(StoreError) as err:
            await store.stage(AdapterRef("a", uri, None))
    assert err.value.reason == "InvalidRequest" and err.value.status == 400, err.value
    assert store.metrics.failures.labels("DiskError")._value.get() == 0
