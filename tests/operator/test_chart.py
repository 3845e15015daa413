"""The Helm chart, tested without a helm binary.

A small renderer below covers the subset of Go templates the chart uses (include/define,
if/with/range, and the pipes quote, nindent, toYaml, trunc, trimSuffix, default, printf,
splitList, last, or, and), so the rendered manifests can be parsed and checked: RBAC covers what the
operator and the node agent call, the node agent runs with its cache dir, the CRDs are the
repository's.
Helm itself (and its Sprig functions beyond these) is not exercised here.
"""

from __future__ import annotations

import copy
import filecmp
import pathlib
import re
import shlex
from typing import Any

import kopf
import pytest
import yaml

from loraplex.node_agent.cli import Settings as AgentSettings
from loraplex.operator.cli import parse_args as operator_args
from loraplex.operator.workloads import NODE_AGENT_PORT

ROOT = pathlib.Path(__file__).resolve().parents[2]
RELEASE_NS = "loraplex-system"  # the renderer's .Release.Namespace
IN_POD = {"NODE_NAME": "n1", "POD_NAMESPACE": RELEASE_NS, "KUBERNETES_SERVICE_HOST": "10.0.0.1",
          "KUBERNETES_SERVICE_PORT": "443"}  # what a node agent's pod has
CHART = ROOT / "charts" / "loraplex"
ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)


def _tokens(text: str) -> list[tuple[str, str]]:
    """[("text", ...), ("action", ...)] with {{- / -}} whitespace trimming applied."""
    out: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    for match in ACTION.finditer(text):
        chunk = text[pos:match.start()]
        if trim_next:
            chunk = chunk.lstrip()
        if match.group(1):
            chunk = chunk.rstrip()
        out.append(("text", chunk))
        out.append(("action", match.group(2)))
        trim_next = bool(match.group(3))
        pos = match.end()
    tail = text[pos:]
    out.append(("text", tail.lstrip() if trim_next else tail))
    return out


def _parse(tokens: list[tuple[str, str]], i: int = 0) -> tuple[list[Any], int]:
    nodes: list[Any] = []
    while i < len(tokens):
        kind, value = tokens[i]
        head = value.split(" ", 1)[0]
        if kind == "action" and head in ("if", "with", "range", "define"):
            body, i = _parse(tokens, i + 1)
            nodes.append((head, value[len(head):].strip(), body))
        elif kind == "action" and head == "end":
            return nodes, i + 1
        else:
            nodes.append((kind, value))
            i += 1
    return nodes, i


class Renderer:
    def __init__(self, values: dict[str, Any]) -> None:
        chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
        self.root = {"Values": values, "Release": {"Name": "lp", "Namespace": RELEASE_NS, "Service": "Helm"},
                     "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]}}
        self.defines: dict[str, list[Any]] = {}
        helpers, _ = _parse(_tokens((CHART / "templates" / "_helpers.tpl").read_text()))
        self._run(helpers, self.root)

    def render(self, name: str) -> list[dict[str, Any]]:
        nodes, _ = _parse(_tokens((CHART / "templates" / name).read_text()))
        return [doc for doc in yaml.safe_load_all(self._run(nodes, self.root)) if doc]

    def _run(self, nodes: list[Any], dot: Any) -> str:
        out = []
        for node in nodes:
            if node[0] == "text":
                out.append(node[1])
            elif node[0] == "action":
                if not node[1].startswith("/*"):
                    out.append(self._str(self._pipeline(node[1], dot)))
            elif node[0] == "define":
                self.defines[shlex.split(node[1])[0]] = node[2]
            elif node[0] == "if":
                if self._pipeline(node[1], dot):
                    out.append(self._run(node[2], dot))
            elif node[0] == "with":
                value = self._pipeline(node[1], dot)
                if value:
                    out.append(self._run(node[2], value))
            elif node[0] == "range":
                for item in self._pipeline(node[1], dot) or []:
                    out.append(self._run(node[2], item))
        return "".join(out)

    def _pipeline(self, text: str, dot: Any) -> Any:
        value: Any = None
        for n, command in enumerate(part.strip() for part in text.split("|")):
            fn, *args = shlex.split(command, posix=False)
            args = [self._arg(a, dot) for a in args]
            if n > 0:
                args.append(value)
            value = self._call(fn, args, dot) if not fn.startswith(".") and fn != "$" else self._arg(fn, dot)
        return value

    def _arg(self, token: str, dot: Any) -> Any:
        if token.startswith('"'):
            return token[1:-1]
        if token.isdigit():
            return int(token)
        if token == ".":
            return dot
        base, path = (self.root, token[1:]) if token.startswith("$") else (dot, token)
        for part in filter(None, path.split(".")):
            base = base.get(part) if isinstance(base, dict) else None
        return base

    def _call(self, fn: str, args: list[Any], dot: Any) -> Any:
        if fn == "include":
            return self._run(self.defines[args[0]], args[1]).strip()
        if fn == "quote":
            return f'"{args[0]}"'
        if fn == "int64":
            return int(args[0])
        if fn == "nindent":
            return "\n" + "\n".join(" " * args[0] + line for line in self._str(args[1]).splitlines())
        if fn == "toYaml":
            return yaml.safe_dump(args[0], default_flow_style=False, sort_keys=False).rstrip("\n")
        if fn == "trunc":
            return self._str(args[1])[:args[0]]
        if fn == "trimSuffix":
            text = self._str(args[1])
            return text[:-len(args[0])] if text.endswith(args[0]) else text
        if fn == "default":
            return args[1] if args[1] else args[0]
        if fn == "printf":
            return args[0] % tuple(args[1:])
        if fn == "splitList":
            return self._str(args[1]).split(args[0])
        if fn == "last":
            return args[0][-1] if args[0] else None
        if fn == "or":
            return next((a for a in args if a), args[-1])
        if fn == "and":
            return next((a for a in args if not a), args[-1])
        raise NotImplementedError(f"template function {fn!r} is not in the test renderer")

    @staticmethod
    def _str(value: Any) -> str:
        return "" if value is None else str(value)


VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def render_all(values: dict[str, Any] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    renderer = Renderer(values if values is not None else copy.deepcopy(VALUES))
    docs = {}
    for path in sorted((CHART / "templates").glob("*.yaml")):
        for doc in renderer.render(path.name):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_chart_crds_are_the_repository_crds():
    chart_crds = CHART / "crds"
    names = sorted(p.name for p in chart_crds.glob("*.yaml"))
    assert names == sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) and names
    for name in names:
        assert filecmp.cmp(chart_crds / name, ROOT / "crds" / name, shallow=False)


def test_chart_metadata_and_values_parse():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "loraplex"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert VALUES["nodeAgent"]["cacheDir"] == "/var/lib/loraplex/adapters"


def test_every_values_key_has_a_comment():
    """A comment right above every key, except inside free-form blocks (resources, tolerations)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    free_form_indent: int | None = None
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z]\w*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        if free_form_indent is not None and indent > free_form_indent:
            continue
        free_form_indent = indent if match.group(2) in ("resources", "tolerations") else None
        assert lines[i - 1].strip().startswith("#"), f"values.yaml:{i + 1} {line.strip()} has no comment"


def test_every_template_renders_to_kubernetes_objects():
    docs = render_all()
    assert set(docs) == {
        ("ServiceAccount", "lp-loraplex-operator"), ("ClusterRole", "lp-loraplex-operator"),
        ("ClusterRoleBinding", "lp-loraplex-operator"), ("Deployment", "lp-loraplex-operator"),
        ("ServiceAccount", "lp-loraplex-node-agent"), ("ClusterRole", "lp-loraplex-node-agent"),
        ("ClusterRoleBinding", "lp-loraplex-node-agent"), ("DaemonSet", "lp-loraplex-node-agent"),
        # nodeAgent.discoverPlans: the plans' mirrors in the release namespace
        ("Role", "lp-loraplex-operator-plan-mirrors"), ("RoleBinding", "lp-loraplex-operator-plan-mirrors"),
        ("Role", "lp-loraplex-node-agent-plans"), ("RoleBinding", "lp-loraplex-node-agent-plans"),
    }
    for doc in docs.values():
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "lp"


def _allows(role: dict[str, Any], group: str, resource: str, verb: str) -> bool:
    return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
               for rule in role["rules"])


def _granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


# What the operator calls (test_rbac_e2e.py records it from a run against the emulator):
OPERATOR_CALLS = {
    # kopf: watches (list + watch), finalizers and annotations (patch), status (patch /status)
    *(("loraplex.io", r, v) for r in ("basemodels", "loraadapters") for v in ("list", "watch", "patch")),
    ("loraplex.io", "basemodels/status", "patch"), ("loraplex.io", "loraadapters/status", "patch"),
    ("apps", "deployments", "list"), ("apps", "deployments", "watch"),  # readiness of its servers
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "events", "create"),  # handler failures as Warning events
    # operator/kube.py: the plan ConfigMap, Deployment and Service by name
    *((g, r, v) for g, r in (("", "configmaps"), ("", "services"), ("apps", "deployments"))
      for v in ("get", "create", "patch")),
    # serving.autoscaling's HPA by name: replaced whole, deleted when the field goes
    *(("autoscaling", "horizontalpodautoscalers", v) for v in ("get", "create", "update", "delete")),
    # no API call: the OwnerReferencesPermissionEnforcement admission plugin's condition for
    # blockOwnerDeletion (test_operator_may_block_the_deletion_of_what_it_adopts)
    ("loraplex.io", "basemodels/finalizers", "update"),
}


@pytest.mark.parametrize("namespaces", [[], ["ml", "research-*"]], ids=["clusterwide", "namespaces"])
def test_operator_role_grants_its_calls_and_no_more(namespaces):
    """Nothing it calls is missing, nothing granted goes unused: no configmaps list/watch
    (it reads one plan ConfigMap by name), no PUT, no CRD or namespace get. kopf lists and
    watches namespaces only when it serves some, not the whole cluster."""
    values = copy.deepcopy(VALUES)
    values["operator"]["watchNamespaces"] = namespaces
    role = render_all(values)[("ClusterRole", "lp-loraplex-operator")]
    expected = OPERATOR_CALLS | ({("", "namespaces", "list"), ("", "namespaces", "watch")} if namespaces else set())
    assert _granted(role) == expected


def test_operator_may_block_the_deletion_of_what_it_adopts():
    """The Deployment, Service and plan ConfigMap are adopted with blockOwnerDeletion; the
    OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters)
    refuses such a reference unless its writer may update the owner's finalizers."""
    owner = {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
             "metadata": {"name": "llama-3-8b", "namespace": "ml", "uid": "u"}}
    child: dict[str, Any] = {"metadata": {}}
    kopf.adopt(child, owner=owner)
    (ref,) = child["metadata"]["ownerReferences"]
    assert ref["blockOwnerDeletion"] and ref["kind"] == "BaseModel"
    role = render_all()[("ClusterRole", "lp-loraplex-operator")]
    assert _allows(role, "loraplex.io", "basemodels/finalizers", "update")


def test_node_agent_may_patch_only_adapter_status():
    role = render_all()[("ClusterRole", "lp-loraplex-node-agent")]
    assert _allows(role, "loraplex.io", "loraadapters/status", "patch")
    assert not _allows(role, "loraplex.io", "loraadapters", "patch")
    assert not _allows(role, "", "configmaps", "patch")


def test_node_agent_role_grants_its_calls_and_no_more():
    """The agent runs on every node with the host's adapter cache mounted; its token may do
    what node_agent/kube.py does: GET one plan ConfigMap by name, list the pods on its node,
    get / merge-patch LoRAAdapter status, review the servers' tokens (stage_auth.py). Not get
    or list every ConfigMap of the cluster (aws-auth, coredns, any app's configuration), read
    objects it never reads, or write events."""
    docs = render_all()
    role = docs[("ClusterRole", "lp-loraplex-node-agent")]
    assert _granted(role) == {("loraplex.io", "loraadapters/status", "get"),
                              ("loraplex.io", "loraadapters/status", "patch"), ("", "pods", "list"),
                              ("authentication.k8s.io", "tokenreviews", "create")}
    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["stageTokenAudience"] = ""
    role = render_all(values)[("ClusterRole", "lp-loraplex-node-agent")]
    assert ("authentication.k8s.io", "tokenreviews", "create") not in _granted(role)


def test_node_agent_may_read_its_plan_configmap_and_no_other():
    """By name, in a ClusterRole: a Role in the plan's namespace would have to be installed
    into a namespace that need not exist yet (the README installs the chart first)."""
    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["planConfigMap"] = "ml/llama-3-8b-plan"
    values["nodeAgent"]["discoverPlans"] = False
    docs = render_all(values)
    role = docs[("ClusterRole", "lp-loraplex-node-agent")]
    (rule,) = [r for r in role["rules"] if "configmaps" in r["resources"]]
    assert rule == {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["llama-3-8b-plan"],
                    "verbs": ["get"]}
    assert not [key for key in docs if key[0] in ("Role", "RoleBinding")]


def test_node_agents_follow_several_plans_and_read_those_alone():
    """One plan per BaseModel: each named plan ConfigMap on the agent's command line, and in
    its role by name."""
    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["planConfigMap"] = "ml/llama-3-8b-plan"
    values["nodeAgent"]["planConfigMaps"] = ["team-b/mistral-plan"]
    docs = render_all(values)
    (rule,) = [r for r in docs[("ClusterRole", "lp-loraplex-node-agent")]["rules"] if "configmaps" in r["resources"]]
    assert rule["resourceNames"] == ["llama-3-8b-plan", "mistral-plan"] and rule["verbs"] == ["get"]
    (container,) = docs[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    settings = AgentSettings.from_env_and_args(container["args"], env=IN_POD)
    assert settings.plan_configmap == ["ml/llama-3-8b-plan", "team-b/mistral-plan"]


def test_node_agent_daemonset_contract():
    ds = render_all()[("DaemonSet", "lp-loraplex-node-agent")]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["loraplex-node-agent"]
    assert container["args"][:2] == ["--cache-dir", "/var/lib/loraplex/adapters"]
    # The rendered arguments are ones the agent's own command line accepts, with the values' meaning.
    settings = AgentSettings.from_env_and_args(container["args"], env=IN_POD)
    assert (settings.budget_bytes, settings.max_concurrent_downloads, settings.port) == (53687091200, 4, 8081)
    assert settings.plan_configmap == []
    assert (settings.plan_selector, settings.plan_namespace) == ("loraplex.io/plan-mirror=true", RELEASE_NS)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # The serving pods the operator runs call the agent at <node IP>:NODE_AGENT_PORT.
    assert container["ports"] == [{"name": "http", "containerPort": NODE_AGENT_PORT, "hostPort": NODE_AGENT_PORT}]
    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["planConfigMap"] = "ml/llama-3-8b-plan"
    (container,) = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    assert AgentSettings.from_env_and_args(container["args"], env=IN_POD).plan_configmap == ["ml/llama-3-8b-plan"]
    assert {"name": "adapters", "mountPath": "/var/lib/loraplex/adapters"} in container["volumeMounts"]
    assert pod["volumes"][0]["hostPath"]["path"] == "/var/lib/loraplex/adapters"
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert container["image"] == "loraplex/node-agent:0.1.0"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_node_agent_extra_args_stay_strings():
    """Container args are strings: an extra argument that reads as a YAML number or boolean
    (a value such as 0.5 or 2) must still render as one, or the API server refuses the DaemonSet."""
    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["extraArgs"] = ["--poll-seconds", "0.5", "--server-poll-seconds", "2", "--log-level", "DEBUG"]
    (container,) = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    assert container["args"][-6:] == values["nodeAgent"]["extraArgs"]
    settings = AgentSettings.from_env_and_args(container["args"], env=IN_POD)
    assert (settings.poll_seconds, settings.server_poll_seconds, settings.log_level) == (0.5, 2.0, "DEBUG")


def test_operator_deployment_follows_values():
    values = copy.deepcopy(VALUES)
    values["operator"].update(watchNamespaces=["ml", "research"], verbose=True)
    values["operator"]["image"]["tag"] = "dev"
    values["nodeAgent"]["enabled"] = False
    docs = render_all(values)
    assert ("DaemonSet", "lp-loraplex-node-agent") not in docs
    dep = docs[("Deployment", "lp-loraplex-operator")]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["loraplex-operator"]
    assert container["args"] == ["--liveness=http://:8080/healthz", "--namespace=ml", "--namespace=research",
                                 "--verbose"]
    assert "env" not in container  # no node agents: no plans mirrored for them
    assert not [key for key in docs if key[0] in ("Role", "RoleBinding")]
    assert container["image"] == "loraplex/operator:dev"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "lp-loraplex-operator"
    binding = docs[("ClusterRoleBinding", "lp-loraplex-operator")]
    assert binding["subjects"][0]["name"] == "lp-loraplex-operator"


def _env(container: dict[str, Any], namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet gives it, in a pod of `namespace`."""
    out = {}
    for var in container.get("env") or []:
        if "value" in var:
            out[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, var
            out[var["name"]] = namespace
    return out


def test_the_operator_mirrors_plans_where_the_agents_look_for_them():
    """nodeAgent.discoverPlans (the default): the operator writes each plan's mirror into the
    release namespace, and the agents list that namespace with the mirrors' label."""
    docs = render_all()
    (operator,) = docs[("Deployment", "lp-loraplex-operator")]["spec"]["template"]["spec"]["containers"]
    mirrors = operator_args(operator["args"], env=_env(operator, RELEASE_NS)).plan_mirror_namespace
    (agent,) = docs[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    settings = AgentSettings.from_env_and_args(agent["args"], env=IN_POD)
    assert mirrors == settings.plan_namespace == RELEASE_NS
    assert settings.plan_selector == "loraplex.io/plan-mirror=true"

    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["discoverPlans"] = False
    docs = render_all(values)
    (operator,) = docs[("Deployment", "lp-loraplex-operator")]["spec"]["template"]["spec"]["containers"]
    assert operator_args(operator["args"], env=_env(operator, RELEASE_NS)).plan_mirror_namespace is None
    (agent,) = docs[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    assert AgentSettings.from_env_and_args(agent["args"], env=IN_POD).plan_selector is None
    assert not [key for key in docs if key[0] in ("Role", "RoleBinding")]


def _bound(docs: dict, role: str, account: str) -> dict[str, Any]:
    """The Role `role`, checked to be in the release namespace and bound there to `account` alone."""
    doc = docs[("Role", role)]
    binding = docs[("RoleBinding", role)]
    assert doc["metadata"]["namespace"] == binding["metadata"]["namespace"] == RELEASE_NS
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": RELEASE_NS}]
    return doc


def test_the_node_agent_may_list_the_configmaps_of_its_namespace_alone():
    """Discovery lists the mirrors (the listing holds their data; the agent neither gets nor
    watches them): a Role in the release namespace, not a cluster-wide read of ConfigMaps."""
    docs = render_all()
    role = _bound(docs, "lp-loraplex-node-agent-plans", "lp-loraplex-node-agent")
    assert _granted(role) == {("", "configmaps", "list")}
    assert not _allows(docs[("ClusterRole", "lp-loraplex-node-agent")], "", "configmaps", "list")


def test_the_operator_may_list_and_delete_the_mirrors_in_the_release_namespace_alone():
    """Its ClusterRole writes ConfigMaps by name (the mirrors too); listing (the sweep) and
    deleting (a mirror has no owner reference) it may in the release namespace only."""
    docs = render_all()
    role = _bound(docs, "lp-loraplex-operator-plan-mirrors", "lp-loraplex-operator")
    assert _granted(role) == {("", "configmaps", "list"), ("", "configmaps", "delete")}
    cluster = docs[("ClusterRole", "lp-loraplex-operator")]
    assert not _allows(cluster, "", "configmaps", "list") and not _allows(cluster, "", "configmaps", "delete")
    for verb in ("get", "create", "patch"):
        assert _allows(cluster, "", "configmaps", verb)


def test_node_agent_takes_the_servers_api_key_from_a_secret(tmp_path):
    """nodeAgent.serverApiKeySecret: the Secret's key mounted as a file (a folder mount, which
    the kubelet updates when the Secret changes) for the agents' --server-api-key-file, never a
    literal in the DaemonSet; none named: no mount, no key sent."""
    pod = render_all()[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "server-api-key" not in {v["name"] for v in pod["volumes"]}
    settings = AgentSettings.from_env_and_args(container["args"], env=IN_POD)
    assert settings.server_api_key is None and settings.server_api_key_file is None

    for secret, key in ((None, "api-key"), ("admin-key", "admin-key")):
        values = copy.deepcopy(VALUES)
        values["nodeAgent"]["serverApiKeySecret"]["name"] = "loraplex-server-keys"
        if secret is not None:
            values["nodeAgent"]["serverApiKeySecret"]["key"] = secret
        pod = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert not [e for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "server-api-key"]
        assert volume == {"name": "server-api-key", "secret": {"secretName": "loraplex-server-keys",
                                                               "items": [{"key": key, "path": "api-key"}]}}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "server-api-key"]
        assert "subPath" not in mount and mount["readOnly"] is True
        # What the kubelet mounts from that Secret is the key the agent sends.
        args = container["args"]
        path = args[args.index("--server-api-key-file") + 1]
        assert path == f"{mount['mountPath']}/api-key"
        (tmp_path / "api-key").write_text("sk-ops-1\n")
        args[args.index("--server-api-key-file") + 1] = str(tmp_path / "api-key")
        settings = AgentSettings.from_env_and_args(args, env=IN_POD)
        assert settings.server_api_key_file == str(tmp_path / "api-key") and settings.server_api_key is None


def test_node_agent_takes_the_servers_keys_per_namespace_from_a_secret(tmp_path):
    """nodeAgent.serverApiKeysSecret: the whole Secret mounted as a folder (each data key a
    file, the kubelet's updates seen) for --server-api-keys-dir, beside serverApiKeySecret's
    one key; none named: no mount, no folder."""
    pod = render_all()[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "server-api-keys" not in {v["name"] for v in pod["volumes"]}
    assert AgentSettings.from_env_and_args(container["args"], env=IN_POD).server_api_keys_dir is None

    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["serverApiKeysSecret"]["name"] = "loraplex-team-keys"
    values["nodeAgent"]["serverApiKeySecret"]["name"] = "loraplex-server-keys"
    pod = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "server-api-keys"]
    assert volume == {"name": "server-api-keys", "secret": {"secretName": "loraplex-team-keys"}}  # every key
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "server-api-keys"]
    assert "subPath" not in mount and mount["readOnly"] is True
    args = container["args"]
    assert args[args.index("--server-api-keys-dir") + 1] == mount["mountPath"]
    assert "--server-api-key-file" in args  # the fallback stays
    (tmp_path / "api-key").write_text("sk-ops-1\n")
    args[args.index("--server-api-key-file") + 1] = str(tmp_path / "api-key")
    args[args.index("--server-api-keys-dir") + 1] = str(tmp_path)
    settings = AgentSettings.from_env_and_args(args, env=IN_POD)
    assert settings.agent_config().server_api_keys_dir == tmp_path


def test_node_agent_takes_its_own_api_key_from_a_secret():
    """nodeAgent.apiKeySecret: the agents' own --api-key as LORAPLEX_NODE_AGENT_API_KEY from the
    Secret (never a literal in the DaemonSet); none named: no such variable, the API open. Apart
    from serverApiKeySecret: each Secret becomes its own variable."""
    (container,) = render_all()[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    assert "LORAPLEX_NODE_AGENT_API_KEY" not in {e["name"] for e in container["env"]}
    assert AgentSettings.from_env_and_args(container["args"], env=IN_POD).api_key is None

    for secret, key in ((None, "api-key"), ("agent-key", "agent-key")):
        values = copy.deepcopy(VALUES)
        values["nodeAgent"]["apiKeySecret"]["name"] = "loraplex-node-agent-key"
        if secret is not None:
            values["nodeAgent"]["apiKeySecret"]["key"] = secret
        (container,) = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
        (var,) = [e for e in container["env"] if e["name"] == "LORAPLEX_NODE_AGENT_API_KEY"]
        assert var == {"name": "LORAPLEX_NODE_AGENT_API_KEY",
                       "valueFrom": {"secretKeyRef": {"name": "loraplex-node-agent-key", "key": key}}}
        assert "--server-api-key-file" not in container["args"]
        # What the kubelet gives the container from that Secret is the key the agent takes.
        settings = AgentSettings.from_env_and_args(container["args"],
                                                   env={**IN_POD, "LORAPLEX_NODE_AGENT_API_KEY": "sk-agent-1"})
        assert settings.api_key == "sk-agent-1" and settings.server_api_key is None
        # The kubelet's probe stays on an endpoint that needs no key.
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"

    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["apiKeySecret"]["name"] = "loraplex-node-agent-key"
    values["nodeAgent"]["serverApiKeySecret"]["name"] = "loraplex-server-keys"
    (container,) = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e
            and "secretKeyRef" in e["valueFrom"]}
    assert refs == {"LORAPLEX_NODE_AGENT_API_KEY": "loraplex-node-agent-key"}
    assert "--server-api-key-file" in container["args"]


def test_the_readme_upgrades_the_crds_before_the_release():
    """Helm installs a chart's crds/ on install only, never on `helm upgrade`: the README's
    upgrade applies crds/ (the chart's CRDs are those files) and then upgrades the release."""
    readme = (ROOT / "README.md").read_text()
    deploying = readme.split("## Deploying on a cluster", 1)[1].split("\n## ", 1)[0]
    upgrades = []
    for block in re.findall(r"```bash\n(.*?)```", deploying, re.S):
        commands = [shlex.split(line.split("#", 1)[0]) for line in block.splitlines()]
        commands = [c for c in commands if c]
        if [c[:2] for c in commands] == [["kubectl", "apply"], ["helm", "upgrade"]]:
            upgrades.append(commands)
    assert upgrades, "no upgrade lines (kubectl apply -f crds/, then helm upgrade) in Deploying on a cluster"
    ((apply, upgrade),) = upgrades
    assert apply == ["kubectl", "apply", "-f", "crds/"]
    assert (ROOT / upgrade[3] / "Chart.yaml").is_file() and (ROOT / upgrade[3] / "crds").resolve() == ROOT / "crds"


def test_node_agent_stages_plan_adapters_only_when_the_chart_says_so():
    (container,) = render_all()[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    assert not AgentSettings.from_env_and_args(container["args"], env=IN_POD).stage_plan_adapters_only
    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["stagePlanAdaptersOnly"] = True
    (container,) = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    assert AgentSettings.from_env_and_args(container["args"], env=IN_POD).agent_config().stage_plan_adapters_only


def test_node_agents_take_the_servers_tokens_of_the_operators_audience():
    """The chart's agents review the tokens the operator's servers send (the audience both use),
    and stage for the token's namespace alone; with the value empty /v1/stage is open."""
    from loraplex.operator.workloads import NODE_AGENT_AUDIENCE

    (container,) = render_all()[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    config = AgentSettings.from_env_and_args(container["args"], env=IN_POD).agent_config()
    assert config.stage_token_audience == NODE_AGENT_AUDIENCE
    values = copy.deepcopy(VALUES)
    values["nodeAgent"]["stageTokenAudience"] = ""
    (container,) = render_all(values)[("DaemonSet", "lp-loraplex-node-agent")]["spec"]["template"]["spec"]["containers"]
    assert AgentSettings.from_env_and_args(container["args"], env=IN_POD).agent_config().stage_token_audience is None
