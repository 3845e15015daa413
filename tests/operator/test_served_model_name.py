"""A BaseModel's serving.servedModelName: the base's name in its servers' API
(--served-model-name), which no adapter of the base may take; without it the --model
folder's name, as before."""

from __future__ import annotations

import pytest

from loraplex.operator.specs import AdapterSpec, BaseModelSpec, SpecError
from loraplex.operator.validation import served_name, validate
from loraplex.operator.workloads import deployment, needs_update

from .test_manifests import validator


def body(serving=None) -> dict:
    spec = {"source": "s3://models/llama", "maxLoraRank": 16, "memory": {"slots": 8},
            "serving": {"modelPath": "/models/Meta-Llama-3-8B-Instruct", **(serving or {})}}
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
            "metadata": {"name": "llama-3-8b", "namespace": "ml"}, "spec": spec}


def args_of(base: BaseModelSpec) -> list[str]:
    (container,) = deployment(base, 8)["spec"]["template"]["spec"]["containers"]
    return container["args"]


def adapter(name: str) -> AdapterSpec:
    return AdapterSpec(name=name, namespace="ml", base_model="llama-3-8b", source="s3://a/a", rank=8,
                       target_modules=("q_proj", "v_proj"))


def test_the_servers_serve_the_base_under_the_name_given():
    named = BaseModelSpec.from_body(body({"servedModelName": "meta-llama/Meta-Llama-3-8B-Instruct"}))
    args = args_of(named)
    assert args[args.index("--served-model-name") + 1] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert served_name(named) == "meta-llama/Meta-Llama-3-8B-Instruct"
    plain = BaseModelSpec.from_body(body())
    assert "--served-model-name" not in args_of(plain)
    assert served_name(plain) == "Meta-Llama-3-8B-Instruct"  # the --model folder's, as the server names it
    # Naming it (or renaming it) rolls the servers.
    assert needs_update(deployment(plain, 8), deployment(named, 8))
    assert needs_update(deployment(named, 8), deployment(plain, 8))


def test_the_server_takes_the_name_from_the_deployments_args():
    settings_module = pytest.importorskip("loraplex.server.settings")
    args = args_of(BaseModelSpec.from_body(body({"servedModelName": "llama3"})))
    args = [a.replace("$(NODE_IP)", "10.0.0.5") for a in args]
    assert settings_module.ServerSettings.from_env_and_args(args).served_model_name == "llama3"


def test_an_adapter_may_not_take_the_served_name_and_may_take_the_folders_then():
    named = BaseModelSpec.from_body(body({"servedModelName": "llama3"}))
    verdict = validate(adapter("llama3"), named)
    assert (verdict.phase, verdict.reason) == ("Rejected", "InvalidName") and "llama3" in verdict.message
    assert validate(adapter("meta-llama-3-8b-instruct"), named).accepted
    plain = BaseModelSpec.from_body(body({"modelPath": "/models/llama3"}))
    assert validate(adapter("llama3"), plain).reason == "InvalidName"


@pytest.mark.parametrize("value", ["", "two words", "tab\there", "é", "x" * 257, 5])
def test_a_name_no_client_could_send_is_refused(value):
    with pytest.raises(SpecError, match="servedModelName"):
        BaseModelSpec.from_body(body({"servedModelName": value}))
    assert not validator("BaseModel").is_valid(body({"servedModelName": value}))


def test_names_as_clients_send_them_are_taken():
    for value in ("llama3", "meta-llama/Meta-Llama-3-8B-Instruct", "x" * 256, "gpt-4o:ft@v2"):
        assert validator("BaseModel").is_valid(body({"servedModelName": value}))
        assert BaseModelSpec.from_body(body({"servedModelName": value})).serving.served_model_name == value
