"""The objects the operator owns, against the contracts servers and agents build on."""

import base64
import copy
import gzip
import json
from fractions import Fraction

import pytest

from loraplex.operator.specs import BaseModelSpec, Memory, Serving, quantity_value
from loraplex.operator.workloads import (PlanTooLarge, _contains, deployment, needs_update, plan_config_map, read_plan,
                                         service)
from loraplex.server.settings import ServerSettings

BASE = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://models/llama-3-8b", max_lora_rank=64,
                     dtype="bfloat16", memory=Memory(slots=250),
                     serving=Serving(replicas=2, image="loraplex/server:test", resources={"limits": {"nvidia.com/gpu": 1}},
                                     node_selector={"gpu": "h100"},
                                     tolerations=({"key": "gpu", "operator": "Exists"},)))


def test_config_map_contract():
    cm = plan_config_map(BASE, '{"x": 1}\n')
    assert cm["metadata"]["annotations"] == {"loraplex.io/plan-encoding": "json"}
    assert cm["metadata"]["name"] == "llama-3-8b-plan" and cm["metadata"]["namespace"] == "ml"
    assert cm["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "loraplex-operator",
                                        "loraplex.io/base-model": "llama-3-8b"}
    assert cm["data"] == {"plan.json": '{"x": 1}\n'}


def test_deployment_runs_the_server_with_the_plan_mounted():
    dep = deployment(BASE, 250)
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["loraplex-server"]
    assert container["args"] == ["--model", "/models/llama-3-8b", "--host", "", "--port", "8000",
                                 "--plan-file", "/etc/loraplex/plan/plan.json", "--max-loras", "250",
                                 "--max-lora-rank", "64", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
                                 "o_proj", "--dtype", "bfloat16",
                                 "--adapter-cache-dir", "/var/lib/loraplex/adapters", "--adapter-namespace", "ml",
                                 "--node-agent-url", "http://$(NODE_IP):8081",
                                 "--node-agent-token-file", "/var/run/secrets/loraplex/node-agent/token",
                                 "--max-num-seqs", "16", "--max-model-len", "2048"]
    # The server's own command line accepts them, with the meaning the operator intends
    # ($(NODE_IP) as the kubelet expands it from the downward-API variable).
    node_ip = container["env"][0]
    assert node_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    args = [a.replace("$(NODE_IP)", "10.1.2.3") for a in container["args"]]
    settings = ServerSettings.from_env_and_args(args)
    assert (settings.host, settings.port, settings.max_loras, settings.max_lora_rank) == ("", 8000, 250, 64)
    assert settings.lora_target_modules == list(BASE.target_modules)
    assert settings.adapter_cache_dir == "/var/lib/loraplex/adapters" and settings.adapter_namespace == "ml"
    assert settings.node_agent_url == "http://10.1.2.3:8081"
    assert settings.plan_file == "/etc/loraplex/plan/plan.json"
    # The node agent's token: a projected service-account token of the agent's audience, which
    # the kubelet rotates; the agent stages this namespace's adapters for it, no other's.
    assert settings.node_agent_token_file == "/var/run/secrets/loraplex/node-agent/token"
    assert {"name": "node-agent-token", "mountPath": "/var/run/secrets/loraplex/node-agent",
            "readOnly": True} in container["volumeMounts"]
    assert {"name": "node-agent-token", "projected": {"sources": [{"serviceAccountToken": {
        "audience": "loraplex-node-agent", "expirationSeconds": 3600, "path": "token"}}]}} in pod["volumes"]
    assert {"name": "plan", "mountPath": "/etc/loraplex/plan", "readOnly": True} in container["volumeMounts"]
    assert {"name": "plan", "configMap": {"name": "llama-3-8b-plan"}} in pod["volumes"]
    # The node's adapter cache: the namespace's folder alone (node_agent.store), read-only, where
    # the server looks for its adapters; another namespace's adapters of one name are not there.
    assert {"name": "adapters", "mountPath": "/var/lib/loraplex/adapters", "readOnly": True} in container["volumeMounts"]
    assert {"name": "adapters", "hostPath": {"path": "/var/lib/loraplex/adapters/.namespaces/ml",
                                             "type": "DirectoryOrCreate"}} in pod["volumes"]
    # The port opens after the weights load and the warm-up: liveness waits for a startup
    # probe that allows minutes, not the liveness probe's one.
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["httpGet"] == liveness["httpGet"] == {"path": "/healthz", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert liveness["periodSeconds"] * liveness["failureThreshold"] < 600
    # Compiled kernels outlive the pod on its node: Triton's cache on a hostPath.
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["kernel-cache"]["mountPath"] == env["TRITON_CACHE_DIR"] == "/var/lib/loraplex/kernel-cache"
    assert not mounts["kernel-cache"].get("readOnly")
    assert volumes["kernel-cache"]["hostPath"] == {"path": "/var/lib/loraplex/kernel-cache", "type": "DirectoryOrCreate"}
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert dep["spec"]["replicas"] == 2
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_service_port_8000_named_http():
    svc = service(BASE)
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == deployment(BASE, 1)["spec"]["selector"]["matchLabels"]


def test_local_source_is_the_model_path():
    local = BaseModelSpec(name="tiny", namespace="ml", source="file:///data/tiny", max_lora_rank=8)
    assert deployment(local, 4)["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["--model", "/data/tiny"]


def test_needs_update_tolerates_server_defaults_only():
    desired = deployment(BASE, 250)
    existing = copy.deepcopy(desired)
    existing["metadata"]["uid"] = "u"
    existing["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    existing["spec"]["strategy"] = {"type": "RollingUpdate"}
    existing["status"] = {"readyReplicas": 2}
    assert not needs_update(existing, desired)
    assert needs_update(None, desired)
    assert needs_update(existing, deployment(BASE, 251))  # --max-loras moved
    relabelled = copy.deepcopy(existing)
    relabelled["metadata"]["labels"]["loraplex.io/base-model"] = "other"
    assert needs_update(relabelled, desired)


def test_large_plans_are_gzipped_under_the_same_key():
    """A ConfigMap holds 1 MiB: a big plan goes to binaryData, gzipped, still mounted as plan.json."""
    adapters = [{"name": f"adapter-{i:05d}", "sha256": f"{i:064x}", "source": f"s3://adapters/{i}"}
                for i in range(8000)]
    text = json.dumps({"adapters": adapters}, separators=(",", ":"))
    assert len(text) > 900_000
    cm = plan_config_map(BASE, text)
    assert "data" not in cm and cm["metadata"]["annotations"] == {"loraplex.io/plan-encoding": "gzip"}
    packed = base64.b64decode(cm["binaryData"]["plan.json"])
    assert packed[:2] == b"\x1f\x8b" and len(cm["binaryData"]["plan.json"]) < 1_000_000
    assert gzip.decompress(packed).decode() == text and read_plan(cm) == {"adapters": adapters}
    assert plan_config_map(BASE, text) == cm  # no timestamp in the gzip header: same bytes
    assert read_plan(plan_config_map(BASE, '{"x": 1}')) == {"x": 1}


def test_a_plan_too_large_even_gzipped_is_refused():
    import random

    rng = random.Random(0)
    noise = "".join(rng.choice("0123456789abcdef") for _ in range(2_600_000))  # ~1.3 MB gzipped
    with pytest.raises(PlanTooLarge, match="a ConfigMap holds"):
        plan_config_map(BASE, json.dumps({"noise": noise}))


def test_serving_parts_the_base_dropped_are_nulled_and_absent_ones_match():
    plain = BaseModelSpec(name="tiny", namespace="ml", source="s3://m/tiny", max_lora_rank=8)
    desired = deployment(plain, 4)
    pod = desired["spec"]["template"]["spec"]
    # null in the merge patch removes what an earlier spec set
    assert pod["nodeSelector"] is None and pod["tolerations"] is None and pod["containers"][0]["resources"] is None
    assert needs_update(deployment(BASE, 4), desired)
    # what the API server answers for a pod without them (no keys, resources {}) is no change
    existing = copy.deepcopy(desired)
    del existing["spec"]["template"]["spec"]["nodeSelector"], existing["spec"]["template"]["spec"]["tolerations"]
    existing["spec"]["template"]["spec"]["containers"][0]["resources"] = {}
    assert not needs_update(existing, desired)


@pytest.mark.parametrize(("a", "b", "same"), [
    (1, "1", True),                      # nvidia.com/gpu: 1 comes back "1"
    (0.5, "500m", True),                 # cpu: 0.5 comes back "500m"
    ("0.25", "250m", True),
    ("1024Mi", "1Gi", True),             # kept as given, or canonical: one value
    ("1.5Gi", "1536Mi", True),
    (1073741824, "1Gi", True),
    ("1e3", "1k", True),                 # decimal exponent
    ("1E3", "1000", True),
    ("1E", "1000P", True),               # E alone is exa, not an exponent
    (".5", "500m", True),
    ("+2Ki", "2048", True),
    (0.1, "100m", True),                 # the float's shortest repr, not its binary expansion
    ("1Gi", "1G", False),
    ("500m", "0.6", False),
    (2, "2k", False),
    ("1e999999999", "1e999999999", True),  # not a quantity to us: equal only as the same string
    ("1e999999999", "1e999999998", False),
    ("abc", "abc", True),
    ("abc", "abd", False),
])
def test_quantities_compare_by_value(a, b, same):
    assert _contains(b, a, quantity=True) is same
    assert _contains(a, b, quantity=True) is same


@pytest.mark.parametrize(("text", "value"), [
    ("500m", Fraction(1, 2)), ("1Gi", 2**30), ("1e-3", Fraction(1, 1000)), ("-2Ki", -2048), ("1.", 1),
    ("12M", 12 * 10**6), ("3E", 3 * 10**18), ("2e+2", 200), (7, 7), (0.5, Fraction(1, 2)),
    ("1 Gi", None), ("Gi", None), ("1gi", None), ("1Mb", None), ("", None), (True, None), (None, None),
    (float("nan"), None), ("1e999999999", None),
])
def test_quantity_value_reads_the_kubernetes_grammar(text, value):
    assert quantity_value(text) == value


def test_a_deployment_the_api_server_canonicalised_is_no_change():
    """Quantities come back in canonical form; comparing them as given, every resync patched
    the Deployment with what it already had (and logged "Deployment ... patched")."""
    serving = Serving(resources={"limits": {"nvidia.com/gpu": 1, "cpu": 0.5, "memory": "1024Mi"},
                                 "requests": {"cpu": "0.25", "memory": "1.5Gi", "ephemeral-storage": "1e9"}},
                      volumes=({"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "0.5Gi"}},),
                      extra_args=("--max-request-bytes", "1k"))
    base = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m/llama-3-8b", max_lora_rank=16,
                         memory=Memory(slots=8), serving=serving)
    desired = deployment(base, 8)
    live = copy.deepcopy(desired)
    pod = live["spec"]["template"]["spec"]
    pod["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": "1", "cpu": "500m", "memory": "1Gi"},
        "requests": {"cpu": "250m", "memory": "1536Mi", "ephemeral-storage": "1G"}}
    next(v for v in pod["volumes"] if v["name"] == "scratch")["emptyDir"]["sizeLimit"] = "512Mi"
    assert not needs_update(live, desired)

    more = copy.deepcopy(live)
    more["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "600m"
    assert needs_update(more, desired)
    # Arguments are strings, not quantities: "1000" for "1k" is a change.
    other = copy.deepcopy(live)
    other["spec"]["template"]["spec"]["containers"][0]["args"][-1] = "1000"
    assert needs_update(other, desired)


def test_a_resource_field_refs_divisor_the_api_server_canonicalised_is_no_change():
    """A downward-API env var's divisor is a quantity too (`divisor: 1024Ki` comes back "1Mi")."""
    ref = {"containerName": "server", "resource": "limits.memory", "divisor": "1024Ki"}
    base = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m/llama-3-8b", max_lora_rank=16,
                         memory=Memory(slots=8),
                         serving=Serving(env=({"name": "MEMORY_MIB", "valueFrom": {"resourceFieldRef": ref}},)))
    desired = deployment(base, 8)
    live = copy.deepcopy(desired)
    env = live["spec"]["template"]["spec"]["containers"][0]["env"]
    env[-1]["valueFrom"]["resourceFieldRef"]["divisor"] = "1Mi"
    assert not needs_update(live, desired)
    env[-1]["valueFrom"]["resourceFieldRef"]["divisor"] = "1Ki"
    assert needs_update(live, desired)


def test_empty_strings_and_false_the_api_server_leaves_out_are_no_change():
    """The API server writes no zero value of an omitempty field of a built-in kind (an
    EnvVar's `value: ""`, a VolumeMount's or a PVC volume's `readOnly: false`, a toleration's
    `value: ""`, an emptyDir's `medium: ""`): compared as given, every resync patched the
    Deployment with what it already had."""
    serving = Serving(env=({"name": "HF_HUB_OFFLINE", "value": ""},),
                      volumes=({"name": "weights", "persistentVolumeClaim": {"claimName": "w", "readOnly": False}},
                               {"name": "scratch", "emptyDir": {"medium": ""}}),
                      volume_mounts=({"name": "weights", "mountPath": "/models", "readOnly": False},),
                      tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "value": "", "effect": "NoSchedule"},))
    base = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m/llama-3-8b", max_lora_rank=16,
                         memory=Memory(slots=8), serving=serving)
    desired = deployment(base, 8)
    live = copy.deepcopy(desired)
    pod = live["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    del container["env"][-1]["value"], container["volumeMounts"][-1]["readOnly"], pod["tolerations"][0]["value"]
    del pod["volumes"][-2]["persistentVolumeClaim"]["readOnly"], pod["volumes"][-1]["emptyDir"]["medium"]
    assert not needs_update(live, desired)
    # Another value there is still a change.
    for path, value in ((("containers", 0, "env", -1, "value"), "1"),
                        (("containers", 0, "volumeMounts", -1, "readOnly"), True),
                        (("tolerations", 0, "value"), "h100")):
        other = copy.deepcopy(live)
        node = other["spec"]["template"]["spec"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert needs_update(other, desired), path


def test_an_empty_value_in_a_map_is_still_a_change():
    """Map entries are kept whatever their value: a nodeSelector on a label without one
    (`node-role.kubernetes.io/gpu: ""`) that the live Deployment lacks is to be written, not
    taken for an omitted zero value."""
    base = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m/llama-3-8b", max_lora_rank=16,
                         memory=Memory(slots=8), serving=Serving(node_selector={"node-role.kubernetes.io/gpu": ""}))
    desired = deployment(base, 8)
    live = copy.deepcopy(desired)
    live["spec"]["template"]["spec"]["nodeSelector"] = {"zone": "a"}
    assert needs_update(live, desired)
    del live["spec"]["template"]["spec"]["nodeSelector"]
    assert needs_update(live, desired)
