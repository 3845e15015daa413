"""--node-agent-url, checked where the README promises: one line and exit 2 at start.

Without --adapter-cache-dir the URL was ignored without a word (the server can stage through
the agent only into the agent's cache, which it must be told of): every plan adapter was
fetched by the server itself, or failed as 'scheme not supported without the node agent',
while the operator of the server believed it went through the agent. A URL that is no
http(s) URL failed only at the first load, as 'node agent at notaurl unreachable'.
"""

from __future__ import annotations

import pytest

from loraplex.server.cli import main
from loraplex.server.settings import ServerSettings


@pytest.mark.parametrize("args, words", [
    (["--node-agent-url", "http://127.0.0.1:8081"], "--adapter-cache-dir"),
    (["--node-agent-url", "127.0.0.1:8081", "--adapter-cache-dir", "/var/lib/loraplex/adapters"], "http"),
])
def test_a_node_agent_url_that_cannot_work_is_one_line(args, words, capsys):
    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loraplex-server: --node-agent-url") and words in err, err


def test_the_operators_node_agent_url_passes():
    s = ServerSettings(dummy_weights="tiny", node_agent_url="http://10.0.0.7:8081",
                       adapter_cache_dir="/var/lib/loraplex/adapters")
    assert s.node_agent_url == "http://10.0.0.7:8081"
