"""A source's secrets (a query string's token or signature, a user:password) never reach the
node's cache directory: it is a host path that every serving pod on the node mounts, of
every namespace, so one tenant's pod would read another's credentials there. The agent
still tells versions of a digest-less adapter apart by their whole source."""

from __future__ import annotations

import pytest

from loraplex.node_agent.sources import redact
from loraplex.node_agent.store import AdapterRef, AdapterStore, is_version


def files_under(root):
    return [p for p in root.rglob("*") if p.is_file()]


async def test_no_token_or_password_is_written_under_the_cache(tmp_path, object_store, session):
    src = object_store.add("sql", tmp_path).replace("http://", "http://robot:pa55word@") + "?sig=t0ken"
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    staged = await store.stage(AdapterRef("sql", src, None))
    for f in files_under(tmp_path / "cache"):
        data = f.read_bytes()
        assert b"t0ken" not in data and b"pa55word" not in data, f
    assert "t0ken" not in staged.as_json()["source"] and "pa55word" not in staged.as_json()["source"]
    # A restart reads the version back; the same source is the same version (no download) ...
    again = AdapterStore(tmp_path / "cache", 10**9, session=session)
    assert is_version(again.get("sql"), AdapterRef("sql", src, None))
    await again.stage(AdapterRef("sql", src, None))
    assert object_store.gets["sql/adapter_model.safetensors"] == 1
    # ... and another source (a new token names new content) is a new version, as before.
    assert not is_version(again.get("sql"), AdapterRef("sql", src.replace("t0ken", "other"), None))


@pytest.mark.parametrize("url, shown", [
    ("https://robot:pa55@host:8443/a/b/?sig=x", "https://host:8443/a/b/?…"),
    ("https://host/a", "https://host/a"),
    ("/mnt/adapters/a", "/mnt/adapters/a"),
])
def test_redact_drops_the_query_and_the_user_info(url, shown):
    assert redact(url) == shown
