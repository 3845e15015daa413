"""`loraplex-server` on an address it cannot listen on.

The server binds its port only after the model is loaded and warmed up (so a probe never
reaches a server that cannot answer). A port already taken (a second `make demo`, another
server) or a --host that is no address of this machine was found only then: minutes of
weight loading and kernel compiling on a GPU, then uvicorn's error and exit code 3. As the
README says of a bad command line, it is now one line on stderr and exit code 2 before
anything loads.
"""

from __future__ import annotations

import socket

import pytest

from loraplex.server.cli import main


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_one_line_and_exit_2_before_anything_loads(taken_port, capsys, monkeypatch):
    import loraplex.server.engine as engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine.LLMEngine, "from_settings", no_load)
    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--port", str(taken_port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loraplex-server: ") and f"127.0.0.1:{taken_port}" in err, err


def test_a_host_that_is_no_address_here_is_one_line(capsys):
    with socket.socket() as s:  # a machine that binds foreign addresses (ip_nonlocal_bind) has no such host
        try:
            s.bind(("192.0.2.1", 0))
        except OSError:
            pass
        else:
            pytest.skip("this machine binds any address")
    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--host", "192.0.2.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host" in err and "192.0.2.1" in err, err
