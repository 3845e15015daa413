"""The README's commands: the engine benchmark's CPU smoke run, and `loraplex-server --demo`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_engine_bench_quick_on_cpu(tmp_path):
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_bench.py"), "--shape", "tiny", "--quick",
                        "--device", "cpu", "--adapters", "0,1,4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [x["adapters"] for x in doc["loraplex"]] == [0, 1, 4]
    assert [x["adapters"] for x in doc["hf_peft"]] == [0, 1, 4]
    assert all(x["decode_tok_s"] > 0 and x["steps"] == 6 for x in doc["loraplex"])
    assert doc["floor"]["floor_ms"] > 0 and doc["copy_bandwidth_GBps"] > 0
    assert {"speedup_vs_hf_peft", "base_step_vs_floor"} <= set(doc["checks"])


def test_serving_mix_bench_quick_on_cpu(tmp_path):
    """Requests arriving while others run, the same ones with and without the look-ahead: the
    same tokens either way, every look-ahead used."""
    out = tmp_path / "mix.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serving_mix_bench.py"), "--shape", "tiny", "--quick",
                        "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    waiting, ahead = doc["rounds"]["waiting"][0], doc["rounds"]["look_ahead"][0]
    assert waiting["tokens"] == ahead["tokens"] > 0 and waiting["steps"] == ahead["steps"]
    assert ahead["look_ahead_hits"] > 0 == ahead["look_ahead_misses"] == waiting["look_ahead_hits"]


def test_prefill_step_bench_quick_on_cpu(tmp_path):
    """Every case timed base only and with adapters, each launch variant asked for too; no
    graph on the CPU."""
    out = tmp_path / "step.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_step_bench.py"), "--shape", "tiny", "--quick",
                        "--device", "cpu", "--variants", "pdl-off,block-32", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert [(c["prompts"], c["tokens_each"], c["cached"]) for c in cases] == [(1, 8, 16), (3, 8, 16), (2, 24, 0)]
    for c in cases:
        assert all(c[k]["ms"] > 0 for k in ("base", "adapters", "pdl-off", "block-32"))
        assert "adapters_graph" not in c and c["adapters_over_base"] > 0


# On an IPv6 address the demo's requests went to "http://::1:PORT", which is no URL: they were
# never sent, and nothing said so.
@pytest.mark.parametrize("host", [[], ["--host", "::1"]], ids=["default", "ipv6"])
def test_demo_command_serves_and_answers(tmp_path, host):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    proc = subprocess.Popen([str(Path(sys.executable).parent / "loraplex-server"), "--demo", "--port", "0", *host],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    watchdog = threading.Timer(120, proc.kill)  # a server that never says "try it:" blocks readline
    watchdog.start()
    try:
        deadline = time.monotonic() + 120
        url = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "try it:" in line:
                url = line.split("curl ", 1)[1].split("/v1/", 1)[0]
                break
        assert url, "".join(lines)
        log = "".join(lines)
        for model in ("base", "sql-expert", "poet", "pirate"):
            assert f"model={model}" in log
        models = httpx.get(url + "/v1/models").json()["data"]
        assert {m["id"] for m in models} == {"base", "sql-expert", "poet", "pirate"}
        assert (tmp_path / "loraplex" / "demo" / "adapters" / "poet" / "adapter_config.json").is_file()
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("args, words", [
    (["--dummy-weights", "nope", "--device", "cpu"], "unknown dummy shape 'nope'"),
    (["--model", "/nonexistent"], "/nonexistent: no config.json"),
    (["--dummy-weights", "tiny", "--device", "cuda:99"], "--device cuda:99"),
    (["--dummy-weights", "tiny", "--device", "gpu"], "not a device"),
    (["--dummy-weights", "tiny", "--device", "cpu", "--lora-modules", "x=/nonexistent"], "no adapter_config.json"),
    (["--dummy-weights", "tiny", "--device", "cpu", "--lora-modules", "x"], "expected NAME=PATH"),
    # An empty name was served as the adapter "" (an empty id in /v1/models); a name given
    # twice had its second path found "already loaded" only once the model had loaded.
    (["--dummy-weights", "tiny", "--device", "cpu", "--lora-modules", f"={ROOT}"], "expected NAME=PATH"),
    (["--dummy-weights", "tiny", "--device", "cpu", "--lora-modules", f"a={ROOT}", f"a={ROOT}"], "'a' is given twice"),
    (["--dummy-weights", "tiny", "--max-loras", "-1"], "--max-loras must be at least 0"),
    (["--dummy-weights", "tiny", "--port", "99999"], "not a TCP port"),
    # logging.basicConfig raised on "verbose"; "warn", which logging takes, failed in uvicorn's
    # Config only after the model had loaded.
    (["--dummy-weights", "tiny", "--device", "cpu", "--log-level", "verbose"], "--log-level 'verbose'"),
    (["--dummy-weights", "tiny", "--device", "cpu", "--log-level", "warn"], "--log-level 'warn'"),
])
def test_bad_settings_get_one_line_and_exit_2_before_anything_loads(args, words, capsys):
    from loraplex.server.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loraplex-server: ") and words in err, err


def test_a_demo_dir_that_cannot_be_written_is_one_line(tmp_path, capsys):
    from loraplex.server.cli import main

    (tmp_path / "file").write_text("")  # a folder under a file: unwritable, even for root
    assert main(["--demo", "--demo-dir", str(tmp_path / "file" / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loraplex-server: --demo-dir") and "Not a directory" in err, err


def test_an_adapter_that_does_not_fit_is_refused_at_start_and_the_rest_served(tmp_path, caplog):
    """README: one whose target modules (or base, shapes, rank) do not fit is refused with the
    reason; the server keeps serving the others. It failed the whole start instead."""
    from loraplex.server.config import named_shape
    from loraplex.server.demo import write_random_adapter
    from loraplex.server.engine import LLMEngine
    from loraplex.server.settings import ServerSettings

    cfg = named_shape("tiny")
    write_random_adapter(tmp_path / "qv", cfg, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    write_random_adapter(tmp_path / "mlp", cfg, r=4, lora_alpha=8, target_modules=["gate_proj"])
    engine = LLMEngine.from_settings(ServerSettings(
        dummy_weights="tiny", device="cpu", max_num_seqs=2, max_model_len=64,
        lora_target_modules=["q_proj", "v_proj"], lora_modules=[f"mlp={tmp_path / 'mlp'}", f"qv={tmp_path / 'qv'}"]))
    assert [e.id.name for e in engine.adapters.list()] == ["qv"]
    assert "mlp" in caplog.text and "gate_proj" in caplog.text


@pytest.mark.parametrize("weights, words", [(None, "no *.safetensors files"),
                                            (b"\x00" * 40, "unreadable checkpoint")])
def test_a_model_folder_without_readable_weights_is_one_line(hf_llama, tmp_path, weights, words, capsys):
    from loraplex.server.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((hf_llama / "config.json").read_bytes())
    if weights is not None:
        (model / "model.safetensors").write_bytes(weights)
    assert main(["--model", str(model), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loraplex-server: ") and words in err, err


def test_a_started_server_puts_its_start_up_objects_out_of_the_collectors_walks():
    """The server's start (create_app_from_settings' lifespan) freezes what start-up made, so
    no full collection walks the engine and the libraries again (engine.freeze_start_up_objects).
    In a process of its own: a freeze outlives everything frozen."""
    code = """
import gc
from fastapi.testclient import TestClient
from loraplex.server.api.app import create_app_from_settings
from loraplex.server.settings import ServerSettings
assert gc.get_freeze_count() == 0
app = create_app_from_settings(ServerSettings(dummy_weights="tiny", device="cpu", max_num_seqs=2, max_model_len=64))
with TestClient(app) as client:
    assert client.get("/healthz").status_code == 200
    print(gc.get_freeze_count())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) > 50_000  # torch alone is more than that
