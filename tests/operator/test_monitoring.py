"""examples/monitoring/: the ServiceMonitor and PodMonitor select what the operator and the chart
run, and every series the rules and the dashboard query is one loraplex exports, with the
labels it has.

The exported series come from the real registries (the server's `EngineMetrics` with its
`CacheMetrics`, the node agent's `Metrics`), plus the labels a Prometheus Operator scrape puts
on a target and the monitors' relabelings. PromQL is read by a small tokenizer below, enough
for the metric names, label matchers and `by (...)` lists of these files; Prometheus' own
parser and the Prometheus Operator's CRD schemas are not available offline, so neither is
exercised here.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from loraplex.node_agent.metrics import Metrics as AgentMetrics
from loraplex.operator.specs import BaseModelSpec
from loraplex.operator.workloads import deployment, service
from loraplex.server.cache_metrics import CacheMetrics
from loraplex.server.metrics import EngineMetrics

from .test_chart import CHART, VALUES, Renderer

ROOT = pathlib.Path(__file__).resolve().parents[2]
MONITORING = ROOT / "examples" / "monitoring"


def _doc(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((MONITORING / name).read_text()) if d]
    return doc


SERVICE_MONITOR = _doc("servicemonitor-servers.yaml")
POD_MONITOR = _doc("podmonitor-node-agents.yaml")
RULE = _doc("prometheusrule.yaml")
DASHBOARD = json.loads((MONITORING / "grafana-dashboard.json").read_text())
RULES = [r for group in RULE["spec"]["groups"] for r in group["rules"]]
RECORDS = [r for r in RULES if "record" in r]
ALERTS = [r for r in RULES if "alert" in r]

# -- PromQL, as far as these files need it -----------------------------------------------------------

FUNCTIONS = frozenset("""
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp
    clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month
    deg delta deriv exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
    histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase irate
    label_join label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time
    minute month pi predict_linear present_over_time quantile_over_time rad rate resets round scalar
    sgn sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time
    stdvar_over_time sum_over_time tan tanh time timestamp vector year""".split())
AGGREGATIONS = frozenset("sum avg min max count group stddev stdvar topk bottomk quantile count_values "
                         "limitk limit_ratio".split())
GROUPINGS = frozenset({"by", "without"})
MATCHINGS = frozenset({"on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})
TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<space>\s+)
  | (?P<variable>\$\{?\w+\}?)                                   # Grafana's $namespace, ${datasource}
  | (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]@])
""", re.X)
CLOSE = {"(": ")", "[": "]", "{": "}"}


@dataclasses.dataclass
class Query:
    """What an expression reads: its series (in order), the labels its `{}` matchers name per
    series, and each `by`/`without`/`on`/... list with the series it applies to."""
    metrics: list[str]
    matchers: list[tuple[str, str]]                     # (series, label)
    groupings: list[tuple[str, tuple[str, ...], list[str], bool]]  # (keyword, labels, series, top level)
    functions: set[str]


def tokenize(expr: str) -> list[tuple[str, str]]:
    """[(kind, text)] without spaces; raises ValueError on a character PromQL has no use for
    here or on brackets that do not pair up."""
    tokens, pos, stack = [], 0, []
    while pos < len(expr):
        match = TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        pos = match.end()
        kind, text = match.lastgroup, match.group()
        if kind == "space":
            continue
        if text in CLOSE:
            stack.append(text)
        elif text in CLOSE.values():
            if not stack or CLOSE[stack.pop()] != text:
                raise ValueError(f"unbalanced {text!r} in {expr!r}")
        tokens.append((kind, text))
    if stack:
        raise ValueError(f"unclosed {stack[-1]!r} in {expr!r}")
    if not tokens:
        raise ValueError("empty expression")
    return tokens


def _closing(tokens: list[tuple[str, str]], i: int) -> int:
    """The index of the bracket closing the one at `i`."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j][1] in CLOSE:
            depth += 1
        elif tokens[j][1] in CLOSE.values():
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced")


def _label_list(tokens: list[tuple[str, str]], i: int) -> tuple[tuple[str, ...], int]:
    """The labels of `( a, b )` opening at `i`, and the index after it."""
    if i >= len(tokens) or tokens[i][1] != "(":
        return (), i
    end = _closing(tokens, i)
    labels = tuple(text for kind, text in tokens[i + 1:end] if kind == "ident")
    assert all(text == "," for kind, text in tokens[i + 1:end] if kind != "ident"), tokens[i:end + 1]
    return labels, end + 1


def parse(expr: str) -> Query:
    tokens = tokenize(expr)
    metrics: list[tuple[int, str]] = []
    matchers: list[tuple[str, str]] = []
    scopes: list[tuple[str, tuple[str, ...], range | None]] = []  # None: the whole expression
    aggregations: list[range] = []
    functions: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if text == "[":  # a range or a subquery's durations
            i = _closing(tokens, i) + 1
        elif text == "{":
            end = _closing(tokens, i)
            owner = metrics[-1][1] if metrics and metrics[-1][0] == i - 1 else None
            if owner is None:
                raise ValueError(f"a matcher with no metric name in {expr!r}")
            for j in range(i + 1, end):
                if tokens[j][0] == "ident" and tokens[j + 1][1] in ("=", "!=", "=~", "!~"):
                    matchers.append((owner, tokens[j][1]))
            i = end + 1
        elif kind != "ident":
            i += 1
        elif text in AGGREGATIONS:
            j, labels, keyword = i + 1, (), ""
            if tokens[j][1] in GROUPINGS:
                keyword = tokens[j][1]
                labels, j = _label_list(tokens, j + 1)
            end = _closing(tokens, j)
            if not labels and end + 1 < len(tokens) and tokens[end + 1][1] in GROUPINGS:
                keyword = tokens[end + 1][1]
                labels, _ = _label_list(tokens, end + 2)
            aggregations.append(range(j, end + 1))
            if keyword:
                scopes.append((keyword, labels, range(j, end + 1)))
            functions.add(text)
            i += 1
        elif text in GROUPINGS:  # read with its aggregation
            _, i = _label_list(tokens, i + 1)
        elif text in MATCHINGS:
            labels, i = _label_list(tokens, i + 1)
            scopes.append((text, labels, None))
        elif text in KEYWORDS:
            i += 1
        elif nxt == "(":
            if text not in FUNCTIONS:
                raise ValueError(f"{text!r} is no PromQL function")
            functions.add(text)
            i += 1
        else:
            metrics.append((i, text))
            i += 1
    groupings = []
    for keyword, labels, scope in scopes:
        inside = [name for at, name in metrics if scope is None or at in scope]
        top = scope is not None and not any(scope != other and scope.start in other for other in aggregations)
        groupings.append((keyword, labels, inside, top))
    return Query([name for _, name in metrics], matchers, groupings, functions)


def test_the_promql_reader_finds_series_matchers_and_groupings():
    q = parse('histogram_quantile(0.95, sum by (le, source) (rate(loraplex_adapter_load_seconds_bucket'
              '{tier="gpu", source=~"host|disk", pod!="a{b}"}[5m] offset 1h)))'
              ' > on (instance) group_left max without (job) (vllm:kv_cache_usage_perc{namespace=~"$ns"})'
              ' and sum(up) by (namespace)')
    assert q.metrics == ["loraplex_adapter_load_seconds_bucket", "vllm:kv_cache_usage_perc", "up"]
    assert q.matchers == [("loraplex_adapter_load_seconds_bucket", label) for label in ("tier", "source", "pod")] + \
        [("vllm:kv_cache_usage_perc", "namespace")]
    assert q.groupings == [
        ("by", ("le", "source"), ["loraplex_adapter_load_seconds_bucket"], True),
        ("on", ("instance",), q.metrics, False),
        ("group_left", (), q.metrics, False),
        ("without", ("job",), ["vllm:kv_cache_usage_perc"], True),
        ("by", ("namespace",), ["up"], True),
    ]
    assert q.functions == {"histogram_quantile", "sum", "rate", "max"}
    # A grouping inside another aggregation is not the result's.
    nested = parse("max by (namespace) (sum by (namespace, pod) (x))")
    assert [(labels, top) for _, labels, _, top in nested.groupings] == [(("namespace",), True),
                                                                          (("namespace", "pod"), False)]


@pytest.mark.parametrize(("expr", "error"), [
    ("sum(rate(x[5m])", "unclosed"),
    ("sum(rate(x[5m)))", "unbalanced"),
    ("rat(x[5m])", "no PromQL function"),
    ('{__name__="x"}', "no metric name"),
    ("   ", "empty"),
    ("x # y", "cannot read"),
])
def test_the_promql_reader_refuses_what_it_cannot_read(expr, error):
    with pytest.raises(ValueError, match=error):
        parse(expr)


# -- what loraplex exports --------------------------------------------------------------------------

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",)}


def exported(registry: CollectorRegistry, *owners: object) -> dict[str, frozenset[str]]:
    """Series name -> label names, as `registry` exports them: a counter X as X_total, a histogram
    as X_bucket (with `le`), X_sum and X_count. A labelled metric with no series yet shows no
    labels in its samples, so they come from the metric objects `owners` hold too
    (prometheus-client keeps them in `_labelnames` alone)."""
    declared: dict[str, tuple[str, ...]] = {}
    for owner in owners:
        for wrapper in vars(owner).values():
            if isinstance(wrapper, MetricWrapperBase):
                (family,) = wrapper.describe()
                declared[family.name] = wrapper._labelnames
    series: dict[str, set[str]] = collections.defaultdict(set)
    for family in registry.collect():
        for suffix in SUFFIXES[family.type]:
            series[family.name + suffix] |= set(declared.get(family.name, ()))
        if family.type == "histogram":
            series[family.name + "_bucket"].add("le")
        for sample in family.samples:
            series[sample.name] |= set(sample.labels)
    return {name: frozenset(labels) for name, labels in series.items()}


def server_series() -> dict[str, frozenset[str]]:
    engine = EngineMetrics()
    cache = CacheMetrics(engine.registry)  # as LLMEngine registers it
    engine.vllm_lora.set("a", "", "1", 0.0)  # its one series appears once set
    return exported(engine.registry, engine, cache)


def agent_series() -> dict[str, frozenset[str]]:
    agent = AgentMetrics()
    return exported(agent.registry, agent)


def test_the_registries_read_as_the_readme_lists_them():
    server, agent = server_series(), agent_series()
    assert server["loraplex_generation_tokens_total"] == frozenset()
    assert server["loraplex_adapter_load_seconds_bucket"] == {"source", "le"}
    assert server["loraplex_adapter_load_seconds_count"] == {"source"}
    assert server["vllm:lora_requests_info"] == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    assert "loraplex_generation_tokens" not in server  # a counter is read as _total
    assert agent["loraplex_node_agent_task_crashes_total"] == {"task"}  # no series yet, labels declared
    assert agent["loraplex_node_agent_server_calls_total"] == {"action", "outcome"}


# Labels a Prometheus Operator scrape puts on every series of a target (its generated scrape
# configs), besides the monitors' own relabelings.
SERVICE_TARGET_LABELS = frozenset({"job", "instance", "namespace", "service", "pod", "container", "endpoint"})
POD_TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "endpoint"})


def _relabeled(endpoints: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    return frozenset(r["targetLabel"] for e in endpoints for r in e.get("relabelings", [])
                     if r.get("action", "replace") == "replace")


def scraped() -> dict[str, frozenset[str]]:
    """Every series Prometheus holds from the two monitors, with its labels."""
    server_labels = SERVICE_TARGET_LABELS | _relabeled(SERVICE_MONITOR["spec"]["endpoints"])
    agent_labels = POD_TARGET_LABELS | _relabeled(POD_MONITOR["spec"]["podMetricsEndpoints"])
    series = {name: labels | server_labels for name, labels in server_series().items()}
    series.update({name: labels | agent_labels for name, labels in agent_series().items()})
    return series


def recorded() -> dict[str, frozenset[str]]:
    """The PrometheusRule's recorded series, with the labels their top-level `by` keeps (`le`
    gone through histogram_quantile)."""
    out: dict[str, frozenset[str]] = {}
    for rule in RECORDS:
        q = parse(rule["expr"])
        tops = [set(labels) for keyword, labels, _, top in q.groupings if keyword == "by" and top]
        assert tops, f"{rule['record']} keeps no labels: sum it by (...)"
        out[rule["record"]] = frozenset(set.intersection(*tops) - {"le"})
    return out


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every query of the rules and of the dashboard's panels."""
    out = [(r.get("record") or r["alert"], r["expr"]) for r in RULES]
    out += [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in DASHBOARD["panels"] for t in p["targets"]]
    return out


LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")


def _check(where: str, q: Query, series: Mapping[str, frozenset[str]]) -> None:
    unknown = [name for name in q.metrics if name not in series]
    assert not unknown, f"{where} reads series loraplex does not export: {unknown}"
    for name, label in q.matchers:
        assert label in series[name], f"{where}: {name} has no label {label!r} (it has {sorted(series[name])})"
    for keyword, labels, inside, _ in q.groupings:
        for label in labels:
            missing = [name for name in inside if label not in series[name]]
            assert not missing, f"{where}: {keyword} ({label}) over {missing}, which lack it"


def test_every_query_reads_exported_series_by_labels_they_have():
    series = scraped()
    series.update(recorded())
    for where, expr in expressions():
        q = parse(expr)
        assert q.metrics, f"{where} reads no series"
        _check(where, q, series)


def test_every_dashboard_variable_query_reads_exported_series_by_labels_they_have():
    series = scraped()
    queries = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in queries} == {"namespace", "base_model"}
    for var in queries:
        match = LABEL_VALUES.fullmatch(var["query"]["query"])
        assert match, var["query"]
        (name,) = parse(match["selector"]).metrics
        assert match["label"] in series[name], f"${var['name']}: {name} has no label {match['label']!r}"
        _check(f"${var['name']}", parse(match["selector"]), series)


def test_the_checks_catch_a_wrong_name_and_a_wrong_label():
    series = scraped()
    with pytest.raises(AssertionError, match="does not export"):
        _check("t", parse("rate(loraplex_generation_tokens[1m])"), series)  # a counter's name without _total
    with pytest.raises(AssertionError, match="no label 'tier'"):
        _check("t", parse('loraplex_adapter_load_seconds_bucket{tier="gpu"}'), series)
    with pytest.raises(AssertionError, match="lack it"):
        _check("t", parse("sum by (le) (rate(loraplex_adapter_load_seconds_count[5m]))"), series)
    with pytest.raises(AssertionError, match="lack it"):
        _check("t", parse("sum by (service) (loraplex_node_agent_disk_bytes)"), series)  # a PodMonitor's target


def test_the_rules_and_dashboard_watch_what_they_promise():
    rule_series = {name for r in RULES for name in parse(r["expr"]).metrics}
    assert {"loraplex_generation_tokens_total", "loraplex_adapter_cache_hits_total",
            "loraplex_adapter_cache_misses_total", "loraplex_adapter_load_seconds_bucket",
            "loraplex_queue_wait_seconds_bucket", "loraplex_adapter_load_failures_total",
            "loraplex_node_agent_task_crashes_total", "loraplex_node_agent_disk_bytes",
            "loraplex_node_agent_disk_budget_bytes", "loraplex_requests_waiting"} <= rule_series
    panel_series = {name for p in DASHBOARD["panels"] for t in p["targets"] for name in parse(t["expr"]).metrics}
    assert {"loraplex_generation_tokens_total", "loraplex_adapter_cache_hits_total",
            "loraplex_adapter_load_seconds_bucket", "loraplex_queue_wait_seconds_bucket",
            "loraplex_adapter_loads_in_flight", "loraplex_adapter_loads_pending", "loraplex_adapters_resident",
            "loraplex_adapters_pinned", "loraplex_adapter_slots", "loraplex_adapter_evictions_total",
            "loraplex_requests_running", "loraplex_requests_waiting", "vllm:kv_cache_usage_perc",
            "loraplex_node_agent_disk_bytes", "loraplex_node_agent_disk_budget_bytes",
            "loraplex_node_agent_downloads_in_flight"} <= panel_series


# -- the PrometheusRule -------------------------------------------------------------------------------

def test_the_rule_is_a_prometheus_rule_with_unique_names():
    assert (RULE["apiVersion"], RULE["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    groups = [g["name"] for g in RULE["spec"]["groups"]]
    assert len(groups) == len(set(groups))
    for rule in RULES:
        assert ("record" in rule) != ("alert" in rule), rule
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
    names = [r.get("record") or r["alert"] for r in RULES]
    assert len(names) == len(set(names))
    assert RECORDS and len(ALERTS) >= 6


DURATION = re.compile(r"(\d+[smhdwy])+")


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a["alert"])
def test_every_alert_waits_has_a_severity_and_says_what_is_wrong(alert):
    assert re.fullmatch(r"Loraplex[A-Z][A-Za-z]+", alert["alert"])
    assert DURATION.fullmatch(str(alert.get("for", ""))), "an alert without `for` fires on one evaluation"
    assert alert["labels"]["severity"] in ("info", "warning", "critical")
    annotations = alert["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    # A template names labels the alert's result carries.
    series = scraped()
    series.update(recorded())
    q = parse(alert["expr"])
    kept = [set(labels) for keyword, labels, _, top in q.groupings if keyword == "by" and top] or \
        [set(series[name]) for name in q.metrics[:1]]
    for label in re.findall(r"\$labels\.(\w+)", annotations["summary"] + annotations["description"]):
        assert label in set.union(*kept), f"{alert['alert']}'s annotations name {label!r}, which its result lacks"


def _stem(name: str) -> str:
    return re.sub(r"_(total|bucket|sum|count|created)$", "", name)


@pytest.mark.parametrize("rule", RECORDS, ids=lambda r: r["record"])
def test_recorded_series_are_named_level_metric_operations(rule):
    level, metric, operations = rule["record"].split(":")
    q = parse(rule["expr"])
    (by, *_) = [labels for keyword, labels, _, top in q.groupings if keyword == "by" and top]
    assert level == "_".join(label for label in by if label != "le"), "the level is the labels kept"
    assert any(metric.startswith(_stem(name)) for name in q.metrics), f"{metric} is none of {q.metrics}"
    for op in operations.split("_"):
        if window := re.fullmatch(r"(rate|increase)(\d+[smhd])", op):
            assert window[1] in q.functions and f"[{window[2]}]" in rule["expr"], op
        elif quantile := re.fullmatch(r"p(\d\d)", op):
            assert re.search(rf"histogram_quantile\(\s*0\.{quantile[1]}\s*,", rule["expr"]), op
        else:
            assert op == "ratio" and "/" in rule["expr"], op


def test_the_readme_expressions_are_recorded_per_pool():
    """The README's PromQL, with `by (namespace, base_model)` added: the same reads, so a
    change there shows here."""
    exprs = {r["record"]: re.sub(r"\s+", " ", r["expr"]).strip() for r in RECORDS}
    assert exprs["namespace_base_model:loraplex_generation_tokens:rate1m"] == \
        "sum by (namespace, base_model) (rate(loraplex_generation_tokens_total[1m]))"
    assert "rate(loraplex_adapter_load_seconds_bucket[5m])" in \
        exprs["namespace_base_model_source:loraplex_adapter_load_seconds:p95_rate5m"]
    (hit,) = [parse(r["expr"]) for r in RECORDS if r["record"].endswith(":loraplex_adapter_cache_hits:ratio_rate5m")]
    assert hit.metrics == ["loraplex_adapter_cache_hits_total"] * 2 + ["loraplex_adapter_cache_misses_total"]


# -- the monitors select what the operator and the chart run -------------------------------------------

def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to `labels`."""
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        have = e["key"] in labels
        ok = {"In": have and labels.get(e["key"]) in e.get("values", []),
              "NotIn": not have or labels[e["key"]] not in e.get("values", []),
              "Exists": have, "DoesNotExist": not have}[e["operator"]]
        if not ok:
            return False
    return True


def _base(name: str, namespace: str) -> BaseModelSpec:
    return BaseModelSpec.from_body({"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
                                    "metadata": {"name": name, "namespace": namespace},
                                    "spec": {"source": "/models/m", "maxLoraRank": 16}})


def _meta_label(prefix: str, labels: Mapping[str, str]) -> set[str]:
    """The service discovery's meta labels for an object's labels (`a.b/c` -> `..._a_b_c`)."""
    return {f"__meta_kubernetes_{prefix}_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}" for k in labels}


KNOWN_META = {"__meta_kubernetes_pod_node_name", "__meta_kubernetes_namespace", "__meta_kubernetes_pod_name"}


def test_the_service_monitor_selects_every_pools_service_and_scrapes_its_port():
    assert (SERVICE_MONITOR["apiVersion"], SERVICE_MONITOR["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    spec = SERVICE_MONITOR["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    services = [service(_base("llama-3-8b", "ml")), service(_base("mistral-7b", "team-b"))]
    for svc in services:
        assert _selects(spec["selector"], svc["metadata"]["labels"]), svc["metadata"]
    # Not by accident: the selector names labels, and other objects the operator labels are not taken.
    assert spec["selector"]["matchLabels"]
    assert not _selects(spec["selector"], {"app.kubernetes.io/managed-by": "loraplex-operator",
                                           "loraplex.io/base-model": "llama-3-8b"})  # the plan ConfigMap's
    (endpoint,) = spec["endpoints"]
    for svc in services:
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # The relabelings read labels the Service has (or standard pod meta labels).
    meta = _meta_label("service", services[0]["metadata"]["labels"]) | KNOWN_META
    for relabel in endpoint["relabelings"]:
        assert set(relabel["sourceLabels"]) <= meta, relabel
        assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", relabel["targetLabel"])
    # The Service's port leads to the server container's `/metrics` port.
    pod = deployment(_base("llama-3-8b", "ml"), 1)["spec"]["template"]["spec"]
    (port,) = services[0]["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for c in pod["containers"] for p in c["ports"]}


def chart(release: str) -> list[dict[str, Any]]:
    """The chart's objects, rendered under the release name `release`."""
    renderer = Renderer(copy.deepcopy(VALUES))
    renderer.root["Release"]["Name"] = release
    return [doc for path in sorted((CHART / "templates").glob("*.yaml")) for doc in renderer.render(path.name)]


@pytest.mark.parametrize("release", ["lp", "loraplex"])  # the tests' name, the README's
def test_the_pod_monitor_selects_the_node_agents_alone_and_scrapes_their_port(release):
    assert (POD_MONITOR["apiVersion"], POD_MONITOR["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    spec = POD_MONITOR["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    docs = chart(release)
    (agents,) = [d for d in docs if d["kind"] == "DaemonSet"]
    template = agents["spec"]["template"]
    assert _selects(spec["selector"], template["metadata"]["labels"]), template["metadata"]["labels"]
    # Not the operator's pod, which shares the chart's name label, nor a server's.
    (operator,) = [d for d in docs if d["kind"] == "Deployment"]
    assert not _selects(spec["selector"], operator["spec"]["template"]["metadata"]["labels"])
    server = deployment(_base("llama-3-8b", "ml"), 1)["spec"]["template"]
    assert not _selects(spec["selector"], server["metadata"]["labels"])
    (endpoint,) = spec["podMetricsEndpoints"]
    (container,) = template["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint["path"] == "/metrics"
    meta = _meta_label("pod", template["metadata"]["labels"]) | KNOWN_META
    for relabel in endpoint["relabelings"]:
        assert set(relabel["sourceLabels"]) <= meta, relabel


# -- the dashboard ------------------------------------------------------------------------------------

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def test_the_dashboard_has_a_prometheus_datasource_variable_every_query_uses():
    assert 36 <= DASHBOARD["schemaVersion"] <= 41 and DASHBOARD["uid"] and DASHBOARD["title"]
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DATASOURCE, var["name"]
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, (panel["title"], target["refId"])
    # The variables the queries name exist (Grafana's own $__ ones aside).
    used = {v for _, expr in expressions() for v in re.findall(r"\$\{?(\w+)", expr) if not v.startswith("__")}
    assert used <= set(variables), used - set(variables)


def test_every_panel_has_a_unique_id_targets_and_its_own_place():
    panels = DASHBOARD["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        assert panel["type"] == "timeseries" and panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]  # Grafana's grid is 24 wide
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


# -- the kustomization -------------------------------------------------------------------------------

KUSTOMIZATION = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())


def test_the_kustomization_lists_every_file():
    assert KUSTOMIZATION["kind"] == "Kustomization" and "namespace" not in KUSTOMIZATION
    # (prometheus-adapter-values.yaml is a Helm chart's values, not a kustomize resource)
    files = {p.name for p in MONITORING.iterdir()} - {"kustomization.yaml", "prometheus-adapter-values.yaml"}
    (generator,) = KUSTOMIZATION["configMapGenerator"]
    dashboards = {f.split("=")[-1] for f in generator["files"]}
    assert set(KUSTOMIZATION["resources"]) | dashboards == files
    assert generator["options"] == {"disableNameSuffixHash": True, "labels": {"grafana_dashboard": "1"}}
    # `kubectl apply` keeps the whole object in an annotation, and annotations hold 256 KiB.
    assert (MONITORING / "grafana-dashboard.json").stat().st_size < 200_000


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_kustomize_builds_the_monitors_rule_and_dashboard():
    out = subprocess.run(["kubectl", "kustomize", str(MONITORING)], capture_output=True, text=True,
                         check=True).stdout
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    assert set(built) == {("ServiceMonitor", "loraplex-servers"), ("PodMonitor", "loraplex-node-agents"),
                          ("PrometheusRule", "loraplex"), ("ConfigMap", "loraplex-dashboard")}
    for (kind, _), doc in built.items():
        assert "namespace" not in doc["metadata"], kind  # `kubectl apply -n` places them
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "loraplex"
    dashboard = built[("ConfigMap", "loraplex-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["loraplex.json"]) == DASHBOARD
    # The common label did not reach the selectors (it would select nothing the operator labels).
    assert built[("ServiceMonitor", "loraplex-servers")]["spec"] == SERVICE_MONITOR["spec"]
    assert built[("PodMonitor", "loraplex-node-agents")]["spec"] == POD_MONITOR["spec"]


def test_the_adapter_serves_the_queue_metric_the_readmes_autoscaler_names():
    """prometheus-adapter-values.yaml: each rule's series is one the scrape holds, with the
    `namespace` and `pod` labels its resources map; its metricsQuery groups by the pod as the
    adapter substitutes it; the name it serves is the README's serving.autoscaling metric."""
    import re

    values = yaml.safe_load((MONITORING / "prometheus-adapter-values.yaml").read_text())
    series = scraped()
    served = set()
    for rule in values["rules"]["custom"]:
        (metric,) = re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"])
        assert metric in series, metric
        overrides = rule["resources"]["overrides"]
        assert {"namespace", "pod"} <= set(overrides) <= series[metric], (metric, overrides)
        assert {v["resource"] for v in overrides.values()} == {"namespace", "pod"}
        assert re.fullmatch(rule["name"]["matches"], metric)
        assert "<<.Series>>" in rule["metricsQuery"] and "by (<<.GroupBy>>)" in rule["metricsQuery"]
        served.add(rule["name"]["as"])
    readme = (ROOT / "README.md").read_text()
    autoscaling = readme.split("`serving.autoscaling` puts", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    example = yaml.safe_load(autoscaling)["serving"]["autoscaling"]
    names = {m["pods"]["metric"]["name"] for m in example["metrics"] if m["type"] == "Pods"}
    assert names and names <= served
