"""LORAPLEX_<FIELD> in a Kubernetes pod.

Kubernetes gives every pod of a namespace variables for each Service there (service links,
on by default): a Service named `loraplex` puts `LORAPLEX_PORT=tcp://10.96.0.12:8000`,
`LORAPLEX_SERVICE_HOST`, ... into the server's pod. `LORAPLEX_PORT` is also the server's
variable for --port: read as one, it stopped a server started without --port (exit 2,
"not an integer") in a crash loop, for a name the user had every reason to pick.
"""

from __future__ import annotations

import pytest

from loraplex.server.cli import main
from loraplex.server.settings import ServerSettings

SERVICE_LINKS = {  # what a Service `loraplex` on port 8000 puts into a pod
    "LORAPLEX_PORT": "tcp://10.96.0.12:8000",
    "LORAPLEX_SERVICE_HOST": "10.96.0.12",
    "LORAPLEX_SERVICE_PORT": "8000",
    "LORAPLEX_PORT_8000_TCP": "tcp://10.96.0.12:8000",
    "LORAPLEX_PORT_8000_TCP_PROTO": "tcp",
    "LORAPLEX_PORT_8000_TCP_PORT": "8000",
    "LORAPLEX_PORT_8000_TCP_ADDR": "10.96.0.12",
}


def test_a_service_named_loraplex_does_not_set_the_port(monkeypatch):
    for k, v in SERVICE_LINKS.items():
        monkeypatch.setenv(k, v)
    assert ServerSettings.from_env_and_args(["--model", "/m"]).port == 8000
    assert ServerSettings.from_env_and_args(["--model", "/m", "--port", "9000"]).port == 9000


@pytest.mark.parametrize("link", ["udp://10.0.0.1:53", "sctp://[fd00::1]:8000"])
def test_other_service_link_protocols_too(monkeypatch, link):
    monkeypatch.setenv("LORAPLEX_PORT", link)
    assert ServerSettings.from_env_and_args(["--model", "/m"]).port == 8000


def test_a_port_given_in_the_environment_still_counts(monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_PORT", "8080")
    assert ServerSettings.from_env_and_args(["--model", "/m"]).port == 8080
    monkeypatch.setenv("LORAPLEX_PORT", "http://10.0.0.1:8000")  # no service link: a mistake, said so
    assert main(["--model", "/m"]) == 2
    assert "LORAPLEX_PORT" in capsys.readouterr().err
