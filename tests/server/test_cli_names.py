"""The base's served name and the adapters' names on the command line.

`--served-model-name poet --lora-modules poet=...` (or a model folder named like one of its
adapters) served two models called "poet": /v1/models listed it twice and every request for
it went to the base, the adapter unreachable. POST /v1/load_lora_adapter already refuses an
adapter with the base's name; the command line now does too, with one line and exit code 2
before anything loads. With --demo the same held for the demo's own adapter names, which
were added after the checks ran.
"""

from __future__ import annotations

import pytest

from loraplex.server.cli import main


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loraplex-server: "), err
    return err


def test_an_adapter_named_as_the_served_base_is_refused(tmp_path, capsys):
    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--served-model-name", "poet",
                 "--lora-modules", f"poet={tmp_path}"]) == 2
    assert "'poet'" in one_line(capsys)


def test_an_adapter_named_as_the_model_folder_is_refused(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "sql"), "--device", "cpu", "--lora-modules", f"sql={tmp_path}"]) == 2
    assert "'sql'" in one_line(capsys)


def test_an_adapter_named_as_the_dummy_shape_is_refused(tmp_path, capsys):
    assert main(["--dummy-weights", "tiny", "--device", "cpu", "--lora-modules", f"tiny={tmp_path}"]) == 2
    assert "'tiny'" in one_line(capsys)


@pytest.mark.parametrize("args, name", [(["--served-model-name", "poet"], "'poet'"),
                                        (["--lora-modules", "pirate=/elsewhere"], "'pirate'")])
def test_the_demo_checks_its_own_names_too(tmp_path, capsys, args, name):
    assert main(["--demo", "--demo-dir", str(tmp_path), "--port", "0", *args]) == 2
    assert name in one_line(capsys)


def test_distinct_names_still_pass():
    from loraplex.server.settings import ServerSettings

    s = ServerSettings(dummy_weights="tiny", served_model_name="base", lora_modules=["a=/x", "b=/y"])
    assert s.lora_modules == ["a=/x", "b=/y"]
