"""CRDs and examples: the schemas are real, every example validates, and the examples plan
the way their comments say. jsonschema stands in for the API server's validation here; it
shares the OpenAPI subset the CRDs use (types, enums, patterns, minimums, required) but not
Kubernetes' structural-schema rules, pruning or defaulting."""

from __future__ import annotations

import copy
import datetime
import pathlib
import re
import shutil
import subprocess

import jsonschema
import pytest
import yaml

from loraplex.operator.plan import build_plan
from loraplex.operator.specs import ALL_TARGET_MODULES, AdapterSpec, BaseModelSpec
from loraplex.operator.workloads import service

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRDS = {doc["spec"]["names"]["kind"]: doc for doc in
        (yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml")))}
EXAMPLES = [doc for p in sorted((ROOT / "examples").glob("*.yaml")) if p.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(p.read_text()) if doc]


def schema(kind: str) -> dict:
    (version,) = CRDS[kind]["spec"]["versions"]
    return _json_schema(version["schema"]["openAPIV3Schema"])


def _json_schema(node):
    """The CRD's OpenAPI schema as JSON Schema reads it: `nullable: true` (OpenAPI's) becomes
    a type that takes null too, as the API server takes an explicit null there."""
    if isinstance(node, list):
        return [_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items()}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def validator(kind: str) -> jsonschema.Validator:
    return jsonschema.Draft7Validator(schema(kind), format_checker=jsonschema.FormatChecker())


def test_both_crds_are_namespaced_v1alpha1_with_status_and_columns():
    assert set(CRDS) == {"BaseModel", "LoRAAdapter"}
    for kind, crd in CRDS.items():
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.loraplex.io"
        assert spec["group"] == "loraplex.io" and spec["scope"] == "Namespaced"
        assert spec["names"]["shortNames"]
        (version,) = spec["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}
        assert version["additionalPrinterColumns"][-1]["name"] == "Age"


def test_adapter_printer_columns_are_the_ones_users_asked_for():
    (version,) = CRDS["LoRAAdapter"]["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Base": ".spec.baseModel", "Tenant": ".spec.tenant", "Priority": ".spec.priority",
                       "Phase": ".status.phase", "Pinned": ".status.pinned", "Age": ".metadata.creationTimestamp"}


@pytest.mark.parametrize("kind", ["BaseModel", "LoRAAdapter"])
def test_printer_columns_point_at_schema_fields(kind):
    (version,) = CRDS[kind]["spec"]["versions"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"].lstrip(".").split(".")
        if path[0] == "metadata":
            continue
        node = schema(kind)
        for part in path:
            node = node["properties"][part]
        assert "type" in node


def _walk(node: dict, path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", ["BaseModel", "LoRAAdapter"])
def test_schemas_are_structural(kind):
    """Every node says its type (or is int-or-string / free-form on purpose)."""
    for path, node in _walk(schema(kind)):
        assert "type" in node or node.get("x-kubernetes-int-or-string") or \
            node.get("x-kubernetes-preserve-unknown-fields"), f"{kind}{path} has no type"


def test_every_example_validates_against_its_crd():
    kinds = [doc["kind"] for doc in EXAMPLES]
    assert kinds.count("BaseModel") == 1 and kinds.count("LoRAAdapter") >= 3
    assert {doc["spec"].get("tenant") for doc in EXAMPLES if doc["kind"] == "LoRAAdapter"} == {"acme", "globex"}
    for doc in EXAMPLES:
        if doc["kind"] in CRDS:
            errors = list(validator(doc["kind"]).iter_errors(doc))
            assert not errors, f"{doc['metadata']['name']}: {[e.message for e in errors]}"


def test_kustomization_lists_every_example():
    kustomization = yaml.safe_load((ROOT / "examples" / "kustomization.yaml").read_text())
    files = {p.name for p in (ROOT / "examples").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert kustomization["namespace"] == "loraplex-demo"


def test_examples_plan_as_their_comments_say():
    base = BaseModelSpec.from_body(next(d for d in EXAMPLES if d["kind"] == "BaseModel"))
    adapters = [AdapterSpec.from_body({**d, "metadata": {**d["metadata"], "namespace": base.namespace}})
                for d in EXAMPLES if d["kind"] == "LoRAAdapter"]
    plan = build_plan(base, adapters, datetime.datetime(2026, 12, 20, 7, 50, tzinfo=datetime.timezone.utc))
    assert plan.slots == 1222 and plan.pinning.capacity == 122
    assert all(v.accepted for v in plan.verdicts.values())
    assert "globex-sandbox" not in plan.pinning.pinned  # pinPolicy Never
    # 10 minutes before the campaign, inside its 15-minute lead: prefetched.
    assert [e.name for e in plan.prefetch] == ["globex-holiday-campaign"]


GOOD_ADAPTER = {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "a"},
                "spec": {"baseModel": "llama-3-8b", "source": "https://artifacts.example/a", "sha256": "a" * 64}}


@pytest.mark.parametrize(("path", "value"), [
    (("sha256",), "A" * 64),              # upper-case hex
    (("sha256",), "a" * 63),              # short
    (("source",), "ftp://host/a"),        # scheme we cannot fetch
    (("pinPolicy",), "Sometimes"),
    (("priority",), -1),
    (("rank",), 0),
    (("baseModel",), "Llama_3"),          # not a DNS name
    (("warmup",), {"start": "2026-12-01T00:00:00Z"}),  # no end
    (("targetModules",), []),
])
def test_schema_refuses_common_mistakes(path, value):
    doc = copy.deepcopy(GOOD_ADAPTER)
    doc["spec"][path[0]] = value
    assert not validator("LoRAAdapter").is_valid(doc)
    assert validator("LoRAAdapter").is_valid(GOOD_ADAPTER)


@pytest.mark.parametrize("missing", ["baseModel", "source"])
def test_adapter_requires_base_and_source(missing):
    doc = copy.deepcopy(GOOD_ADAPTER)
    del doc["spec"][missing]
    assert not validator("LoRAAdapter").is_valid(doc)


def test_basemodel_schema_quantities_and_modules():
    good = {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "b"},
            "spec": {"source": "/models/b", "maxLoraRank": 16,
                     "memory": {"gpuMemory": "80Gi", "kvCacheReserve": 30_000_000_000, "adapterBytes": "40M"}}}
    assert validator("BaseModel").is_valid(good)
    enum = schema("BaseModel")["properties"]["spec"]["properties"]["targetModules"]["items"]["enum"]
    assert tuple(enum) == ALL_TARGET_MODULES
    for bad in ({"memory": {"gpuMemory": "80 GB"}}, {"maxLoraRank": 0}, {"dtype": "int8"},
                {"targetModules": ["lm_head"]}, {"pinnedPercent": 101}):
        doc = copy.deepcopy(good)
        doc["spec"].update(bad)
        assert not validator("BaseModel").is_valid(doc), bad


@pytest.mark.parametrize("name", ["llama-3-8b", "b", "llama-3.1-8b", "3b-instruct", "a" * 63, "a" * 64])
def test_basemodel_names_the_schema_takes_name_its_service_and_label_its_pods(name):
    """The operator names the Service `<base>` (a DNS-1035 label: no dots, a letter first) and
    puts the name in pod labels (63 characters at most); a BaseModel the API server takes
    under another name would leave its servers unwritten, the Service refused on every retry."""
    doc = {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": name},
           "spec": {"source": "/models/m", "maxLoraRank": 8}}
    servable = re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) is not None and len(name) <= 63
    assert validator("BaseModel").is_valid(doc) == servable
    if servable:
        base = BaseModelSpec.from_body({**doc, "metadata": {"name": name, "namespace": "ml"}})
        assert service(base)["metadata"]["name"] == name
    # An adapter names its base the same way.
    adapter = copy.deepcopy(GOOD_ADAPTER)
    adapter["spec"]["baseModel"] = name
    assert validator("LoRAAdapter").is_valid(adapter) == servable


@pytest.mark.parametrize("kind", ["BaseModel", "LoRAAdapter"])
def test_kubectl_explain_describes_every_field(kind):
    """`kubectl explain loraadapter.spec.pinPolicy` (or any field of spec and status) prints
    the schema's description: a field without one explains nothing to the user who meets it."""
    top = schema(kind)["properties"]
    bare = [f"{name}{path}" for name in ("spec", "status") for path, node in _walk(top[name])
            if not path.endswith(("[]", "{}")) and not str(node.get("description") or "").strip()]
    assert bare == [], f"{kind} fields with no description: {bare}"


API_KEYS = ROOT / "examples" / "api-keys"


def _merge(target, patch):
    """A JSON merge patch, as kustomize applies a patch to a custom resource (no strategic-merge schema)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        out[key] = _merge(out.get(key), value)
    return out


def examples_with_api_keys() -> list[dict]:
    """The examples with the api-keys Component, as `kubectl apply -k examples/` builds them once
    ../kustomization.yaml lists it: its resources added, its patches merged by kind and name."""
    component = yaml.safe_load((API_KEYS / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    docs = copy.deepcopy(EXAMPLES) + [d for f in component["resources"]
                                      for d in yaml.safe_load_all((API_KEYS / f).read_text()) if d]
    for entry in component["patches"]:
        patch = yaml.safe_load((API_KEYS / entry["path"]).read_text())
        (i,) = [i for i, d in enumerate(docs)
                if (d["kind"], d["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
        docs[i] = _merge(docs[i], patch)
    return docs


def test_the_api_keys_example_validates_and_names_secrets_it_holds(tmp_path):
    from loraplex.operator.workloads import deployment
    from loraplex.server.api_keys import read_keys_file

    docs = examples_with_api_keys()
    for doc in docs:
        if doc["kind"] in CRDS:
            errors = list(validator(doc["kind"]).iter_errors(doc))
            assert not errors, f"{doc['metadata']['name']}: {[e.message for e in errors]}"
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    base = BaseModelSpec.from_body({**next(d for d in docs if d["kind"] == "BaseModel"),
                                    "metadata": {"name": "llama-3-8b", "namespace": "loraplex-demo"}})
    keys = base.serving.api_keys
    admin, tenants = keys.admin_key_secret, keys.tenant_keys_secret
    assert admin is not None and tenants is not None
    assert "namespace" not in secrets[admin.name]["metadata"]  # the kustomization's, as the BaseModel's
    admin_key = secrets[admin.name]["stringData"][admin.key]
    keys_json = tmp_path / "keys.json"
    keys_json.write_text(secrets[tenants.name]["stringData"][tenants.key])
    assert sorted(read_keys_file(keys_json).values()) == ["acme", "globex"]  # the examples' two tenants
    pod = deployment(base, 1222)["spec"]["template"]["spec"]
    assert {src["secret"]["name"] for v in pod["volumes"] if "projected" in v
            for src in v["projected"]["sources"] if "secret" in src} == {admin.name, tenants.name}
    # The node agents' copy: in the chart's namespace, under the key the chart reads by default,
    # the same admin key (else the servers refuse the agents' warming).
    agents = yaml.safe_load((API_KEYS / "node-agent-secret.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "loraplex" / "values.yaml").read_text())
    assert agents["metadata"]["namespace"] == "loraplex-system"
    assert agents["stringData"][chart["nodeAgent"]["serverApiKeySecret"]["key"]] == admin_key


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kustomize_builds_the_api_keys_component_as_the_test_does(tmp_path):
    """kubectl's own kustomize, on a copy of examples/ that lists the Component as its comment says."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    kustomization = tmp_path / "examples" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + "components:\n  - api-keys\n")
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path / "examples")], capture_output=True, text=True,
                         check=True).stdout
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    ours = {(d["kind"], d["metadata"]["name"]): d for d in examples_with_api_keys()}
    assert set(built) == set(ours)
    for key, doc in ours.items():
        if key[0] != "Namespace":
            assert built[key]["metadata"]["namespace"] == "loraplex-demo"
        assert {k: v for k, v in built[key].items() if k != "metadata"} == \
            {k: v for k, v in doc.items() if k != "metadata"}, key
