"""`loraplex-node-agent` refuses settings it cannot work with, in one line, exit 2."""

from __future__ import annotations

import pytest

from loraplex.node_agent.cli import Settings, main


@pytest.mark.parametrize("argv", [
    ["--server-url", "localhost:8000"],  # no scheme: read as scheme 'localhost'
    ["--server-url", "127.0.0.1:8000"],
    ["--server-url", "http//host:8000"],
    ["--server-url", "http://"],
    ["--server-url", "http://[::1:8000"],
    ["--kube-api-url", "kubernetes.default.svc"],
])
def test_a_url_setting_that_is_not_an_http_url_is_refused(argv):
    """A --server-url without its scheme (an easy slip: 127.0.0.1:8000) was taken as it was;
    every readiness check of it then failed on an invalid URL, which the warmer reads as
    'not ready': the server was never warmed, and nothing said why."""
    with pytest.raises(ValueError, match=f"{argv[0]} .*http") as err:
        Settings.from_env_and_args(argv, {})
    assert argv[1] in str(err.value)


def test_the_refusal_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["--server-url", "127.0.0.1:8000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex-node-agent: --server-url") and err.count("\n") == 1


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://srv.example:8443/", "http://[::1]:8000"])
def test_good_server_urls_are_taken(url):
    assert Settings.from_env_and_args(["--server-url", url], {}).server_url == [url]


def test_the_servers_api_key_comes_from_the_environment_or_the_flag_and_is_never_shown():
    s = Settings.from_env_and_args([], {"LORAPLEX_SERVER_API_KEY": "sk-env"})
    assert s.server_api_key == "sk-env" and s.agent_config().server_api_key == "sk-env"
    assert Settings.from_env_and_args(["--server-api-key", "sk-flag"], {"LORAPLEX_SERVER_API_KEY": "sk-env"}) \
        .server_api_key == "sk-flag"
    assert Settings.from_env_and_args([], {}).server_api_key is None
    assert "sk-env" not in repr(s) and "sk-env" not in repr(s.agent_config())


def test_the_servers_api_key_file_is_checked_at_start_and_replaces_the_key(tmp_path, capsys):
    key_file = tmp_path / "server-api-key"
    key_file.write_text("sk-file\n")
    s = Settings.from_env_and_args(["--server-api-key-file", str(key_file)], {"LORAPLEX_SERVER_API_KEY": "sk-env"})
    assert s.server_api_key is None and s.agent_config().server_api_key_file == key_file
    with pytest.raises(ValueError, match="not both"):
        Settings.from_env_and_args(["--server-api-key-file", str(key_file), "--server-api-key", "sk-flag"], {})
    key_file.write_text("")
    with pytest.raises(ValueError, match="--server-api-key-file .*empty"):
        Settings.from_env_and_args(["--server-api-key-file", str(key_file)], {})
    assert main(["--server-api-key-file", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("loraplex-node-agent: --server-api-key-file")


def test_the_servers_keys_folder_is_checked_at_start(tmp_path, capsys):
    s = Settings.from_env_and_args(["--server-api-keys-dir", str(tmp_path), "--server-api-key", "sk-ops"], {})
    assert s.agent_config().server_api_keys_dir == tmp_path and s.server_api_key == "sk-ops"
    assert main(["--server-api-keys-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("loraplex-node-agent: --server-api-keys-dir")


def test_the_agents_own_api_key_comes_from_the_environment_or_the_flag_and_is_never_shown():
    """--api-key, else LORAPLEX_NODE_AGENT_API_KEY (from a Secret), the flag winning; apart
    from --server-api-key (the servers' key, which the agent sends), and in no repr."""
    env = {"LORAPLEX_NODE_AGENT_API_KEY": "sk-agent-env", "LORAPLEX_SERVER_API_KEY": "sk-server"}
    s = Settings.from_env_and_args([], env)
    assert s.api_key == "sk-agent-env" and s.agent_config().api_key == "sk-agent-env"
    assert s.server_api_key == "sk-server" and s.agent_config().server_api_key == "sk-server"
    assert Settings.from_env_and_args(["--api-key", "sk-agent-flag"], env).api_key == "sk-agent-flag"
    assert Settings.from_env_and_args([], {}).api_key is None
    assert Settings.from_env_and_args([], {"LORAPLEX_NODE_AGENT_API_KEY": ""}).api_key is None  # set but empty: none
    assert Settings.from_env_and_args([], {"LORAPLEX_SERVER_API_KEY": "sk-server"}).api_key is None
    assert "sk-agent-env" not in repr(s) and "sk-agent-env" not in repr(s.agent_config())


def test_stage_plan_adapters_only_is_an_on_off_flag():
    assert Settings.from_env_and_args([], {}).agent_config().stage_plan_adapters_only is False
    assert Settings.from_env_and_args(["--stage-plan-adapters-only"], {}).agent_config().stage_plan_adapters_only
    assert not Settings.from_env_and_args(["--no-stage-plan-adapters-only"], {}).stage_plan_adapters_only
