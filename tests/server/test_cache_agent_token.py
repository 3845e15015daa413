"""--node-agent-token-file: the server sends its service-account token to the node agent as
a Bearer token on each POST /v1/stage, read at each staging (the kubelet rotates a projected
token); a file it cannot read fails that adapter's fetch with a clear error, no other."""

from __future__ import annotations

import pytest

from loraplex.server.adapter_sources import AdapterLoadError
from loraplex.server.settings import ServerSettings

from .test_adapter_cache import _Files, make_cache, write_adapter


def test_the_token_goes_with_each_staging_as_it_is_then(tmp_path_factory):
    bucket, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text("first-token\n")
    for i, name in enumerate(("sql", "chat")):
        write_adapter(bucket / name, seed=i)
    with _Files(bucket, cache_dir) as agent:
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url, node_agent_token_file=str(token))
        cache.register("sql", source="s3://bucket/sql")
        cache.register("chat", source="s3://bucket/chat")
        cache.prefetch("sql").result(10)
        token.write_text("rotated-token")
        cache.prefetch("chat").result(10)
        assert agent.authorization == ["Bearer first-token", "Bearer rotated-token"]
        cache.register("gone", source="s3://bucket/gone")
        token.unlink()
        with pytest.raises(AdapterLoadError, match="node-agent-token-file") as err:
            cache.prefetch("gone").result(10)
        assert err.value.reason == "fetch" and len(agent.staged) == 2  # the agent was not asked
        cache.close()


def test_without_a_token_file_no_header_is_sent(tmp_path_factory):
    bucket, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(bucket / "sql", seed=1)
    with _Files(bucket, cache_dir) as agent:
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        cache.register("sql", source="s3://bucket/sql")
        cache.prefetch("sql").result(10)
        assert agent.authorization == [None]
        cache.close()


def test_the_flag_parses():
    s = ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--node-agent-url", "http://127.0.0.1:8081",
                                          "--adapter-cache-dir", "/var/lib/loraplex/adapters",
                                          "--node-agent-token-file", "/var/run/secrets/loraplex/token"])
    assert s.node_agent_token_file == "/var/run/secrets/loraplex/token"
    with pytest.raises(ValueError, match="needs --node-agent-url"):
        ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--node-agent-token-file", "/t"])
