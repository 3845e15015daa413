"""The README is a contract with its users; these tests hold it to the code.

Each test reads README.md (or bench/README.md) and checks one kind of claim mechanically:
the quick start's two commands and CI's, every command-line flag with its default (and every
flag of the three programs documented), the environment variables, every file path, the
Helm values and kubectl commands, every HTTP endpoint, and every metric on a real server's
and node agent's /metrics with the PromQL given for them. No network; a tiny CPU server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "bench" / "README.md").read_text()

# Flags of programs the README runs that are not loraplex's own.
OTHER_PROGRAMS_FLAGS = {"--create-namespace", "--set", "--standalone", "--help", "--all", "--type", "--from-file"}  # helm, kopf, kubectl


# -- reading the README ----------------------------------------------------------------------


def section(title: str, text: str = README) -> str:
    """The text under the heading `title` (any level), up to the next heading of its level or above."""
    m = re.search(rf"^(#+) {re.escape(title)}\s*$", text, re.M)
    assert m, f"README has no heading {title!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M)
    rest = text[m.end():]
    # headings inside fenced code (PromQL comments) are no headings
    pos = 0
    while True:
        n = end.search(rest, pos)
        if n is None:
            return rest
        if rest[:n.start()].count("```") % 2 == 0:
            return rest[:n.start()]
        pos = n.end()


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every markdown table in `text`, as lists of cells."""
    # header rows (each followed by its separator) are not body rows
    out, lines = [], [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.fullmatch(r"\|( ?-+ ?\|)+", line):
            continue
        if i + 1 < len(lines) and re.fullmatch(r"\|( ?-+ ?\|)+", lines[i + 1]):
            continue
        out.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def flags_in(text: str) -> list[str]:
    return re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", text)


def help_of(main, argv=("--help",)) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(list(argv))
    return out.getvalue()


def help_flags(help_text: str) -> set[str]:
    options = help_text.split("options:", 1)[1]
    return set(re.findall(r"(?<![\w<>/$-])--?[a-z][a-z0-9-]*", options)) - {"-h", "--help"}


def help_default(doc: str) -> str:
    m = re.search(r"Default: (.*)$", doc)
    assert m, doc
    return m.group(1).rstrip(".")


def plain(cell: str) -> str:
    return cell.replace("`", "").strip()


def default_agrees(readme: str, helped: str) -> bool:
    """The README's default says what --help's says: the same, or one of them goes on
    with a comma or a parenthesis."""
    a, b = plain(readme).lower(), helped.lower()
    return a == b or any(x.startswith(y + sep) for x, y in ((a, b), (b, a)) for sep in (",", " ("))


def flag_table(title: str) -> dict[str, str]:
    """{flag: its default cell} of the table under `title` (a row may list several flags:
    then its default cell lists as many defaults, comma-separated)."""
    out = {}
    for row in table_rows(section(title)):
        names = [s for s in spans(row[0]) if s.startswith("--")]  # `-n`, `--namespace`: one option
        if not names:
            continue  # another table under the same heading (an HTTP API)
        defaults = [row[1]] if len(names) == 1 else [d.strip() for d in row[1].split(",")]
        assert len(defaults) == len(names), row
        out.update(zip(names, defaults))
        out.update((s, row[1]) for s in spans(row[0]) if re.fullmatch(r"-[a-z]", s))
    return out


# -- quick start and CI ----------------------------------------------------------------------


def test_quick_start_is_make_demo_and_make_test_and_ci_runs_make_test():
    block = fenced(section("Quick start"), "bash")[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    recipes = dict(re.findall(r"^(\w+):[^\n]*\n\t([^\n]+)", makefile, re.M))
    assert "loraplex-server --demo" in recipes["demo"]
    assert "pytest" in recipes["test"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]


def test_pip_extras_the_readme_names_exist():
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"^([\w-]+) = \[", pyproject.split("[project.optional-dependencies]")[1], re.M))
    named = set(re.findall(r"'\.\[([\w-]+)\]'", README))
    assert named and named <= extras, named - extras


# -- flags -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _wide_help(monkeypatch):
    """--help unwrapped: argparse wraps at $COLUMNS, which would cut a flag at its dashes."""
    monkeypatch.setenv("COLUMNS", "10000")


def server_help() -> str:
    from loraplex.server.settings import build_parser

    return build_parser().format_help()


def agent_help() -> str:
    from loraplex.node_agent.cli import build_parser

    return build_parser().format_help()


def operator_help() -> str:
    from loraplex.operator.cli import parse_args

    return help_of(parse_args)


@pytest.mark.parametrize("title, helper, settings", [
    ("loraplex-server", server_help, "loraplex.server.settings:ServerSettings"),
    ("loraplex-node-agent", agent_help, "loraplex.node_agent.cli:Settings"),
])
def test_every_flag_is_documented_with_its_default(title, helper, settings):
    import importlib

    from loraplex.server.settings import field_docs

    module, _, name = settings.partition(":")
    cls = getattr(importlib.import_module(module), name)
    docs = {"--" + k.replace("_", "-"): v for k, v in field_docs(cls).items()}
    for name, aliases in getattr(importlib.import_module(module), "FLAG_ALIASES", {}).items():
        docs.update((alias, docs["--" + name.replace("_", "-")]) for alias in aliases)  # vLLM's names
    documented = flag_table(title)
    flags = {f for f in help_flags(helper()) if not f.startswith("--no-")}
    assert set(documented) == flags, (f"not in the README: {sorted(flags - set(documented))}; "
                                      f"not a flag: {sorted(set(documented) - flags)}")
    wrong = {f: (documented[f], help_default(docs[f])) for f in flags
             if not default_agrees(documented[f], help_default(docs[f]))}
    assert not wrong, wrong


def test_operator_flags_are_documented():
    documented = set(flag_table("loraplex-operator"))
    assert documented == help_flags(operator_help())


@pytest.mark.parametrize("settings", ["loraplex.server.settings:ServerSettings", "loraplex.node_agent.cli:Settings"])
def test_every_help_default_is_the_fields_default(settings):
    """--help says the default the code has (what the README's tables are checked against)."""
    import importlib

    from loraplex.server.settings import field_docs

    module, _, name = settings.partition(":")
    cls = getattr(importlib.import_module(module), name)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        said = help_default(docs[f.name])
        first = re.split(r"[ ,]", said, maxsplit=1)[0]
        if isinstance(value, bool):
            assert first == ("on" if value else "off"), (f.name, value, said)
        elif value is None or value == []:
            assert first == "none" or "$" in said or said.startswith("the "), (f.name, said)
        elif value == "":
            assert first == "empty", (f.name, value, said)
        elif isinstance(value, (int, float, str, Path)):
            assert first == str(value), (f.name, value, said)


def test_every_flag_the_readme_names_exists():
    from loraplex.server.settings import build_parser

    server = help_flags(server_help())
    negated = {opt for a in build_parser()._actions for opt in a.option_strings if opt.startswith("--no-")}
    known = server | negated | help_flags(agent_help()) | help_flags(operator_help()) | OTHER_PROGRAMS_FLAGS
    unknown = sorted(set(flags_in(README)) - known)
    assert not unknown, unknown


def test_readme_server_example_command_parses():
    from loraplex.server.settings import ServerSettings

    block = fenced(section("Serving a real model"), "bash")[0].replace("\\\n", " ")
    line = next(ln for ln in block.splitlines() if ln.startswith("loraplex-server"))
    s = ServerSettings.from_env_and_args(shlex.split(line)[1:])
    assert s.lora_modules == ["sql=/adapters/sql-lora", "support=/adapters/support-lora"]


# -- environment -----------------------------------------------------------------------------


def test_environment_variables_the_readme_names_are_read(monkeypatch):
    from loraplex.server.settings import ServerSettings

    from loraplex.operator.cli import MIRROR_NAMESPACE_ENV, mirror_namespace_from_env

    fields = {f.name.upper() for f in dataclasses.fields(ServerSettings)}
    readers = (ROOT / "kernels" / "configs.py").read_text() + (ROOT / "node_agent" / "cli.py").read_text()
    for var in set(re.findall(r"LORAPLEX_[A-Z_<>]+", README)):
        suffix = var.removeprefix("LORAPLEX_")
        assert suffix == "<FIELD>" or suffix in fields or f'"{var}"' in readers or var == MIRROR_NAMESPACE_ENV, var
    assert mirror_namespace_from_env({MIRROR_NAMESPACE_ENV: "loraplex-system"}) == "loraplex-system"  # the operator's
    # What the README says of LORAPLEX_<FIELD>: a default's override, the flag wins, lists split.
    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "32")
    monkeypatch.setenv("LORAPLEX_EVICTION_POLICY", "lfu-aged")
    monkeypatch.setenv("LORAPLEX_CUDA_GRAPHS", "0")
    monkeypatch.setenv("LORAPLEX_LORA_TARGET_MODULES", "q_proj,v_proj")
    s = ServerSettings.from_env_and_args(["--model", "/m", "--eviction-policy", "wtinylfu"])
    assert (s.max_loras, s.eviction_policy, s.cuda_graphs, s.lora_target_modules) == (
        32, "wtinylfu", False, ["q_proj", "v_proj"])


def test_an_environment_value_that_does_not_parse_exits_2(monkeypatch, capsys):
    from loraplex.server.cli import main

    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "many")
    assert main(["--model", "/m"]) == 2
    assert "LORAPLEX_MAX_LORAS" in capsys.readouterr().err


# -- paths, chart, kubectl -------------------------------------------------------------------


TOP = {p.name for p in ROOT.iterdir()}


def repo_paths(text: str) -> set[str]:
    """Tokens of code spans and code blocks that name a file or folder of this repository."""
    tokens = set()
    for chunk in spans(text) + re.findall(r"```\w*\n(.*?)```", text, re.S):
        for tok in re.split(r"[\s'\"(),=]+", chunk):
            tok = tok.rstrip(".:;")
            first = tok.split("/", 1)[0]
            if "/" in tok and first in TOP and "<" not in tok and "{" not in tok:
                tokens.add(tok)
            elif re.fullmatch(r"[\w.-]+_notes\.md", tok):
                tokens.add("bench/results/" + tok)
    return tokens


@pytest.mark.parametrize("text", [README, BENCH_README], ids=["README", "bench/README"])
def test_every_path_the_readme_names_exists(text):
    base = ROOT if text is README else ROOT / "bench"
    paths = repo_paths(text) if text is README else {
        p if p.startswith("results/") else p for p in re.findall(r"`(results/[^`]+)`", text)}
    assert paths
    missing = [p for p in sorted(paths) if not list(base.glob(p.rstrip("/")))
               and not list(base.glob(p.rstrip("/") + "*"))]
    assert not missing, missing


def test_links_to_sections_resolve():
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.*)$", README, re.M)}
    anchors = set(re.findall(r"\]\(#([^)]+)\)", README))
    assert anchors <= slugs, anchors - slugs


def values_yaml() -> dict:
    return yaml.safe_load((ROOT / "charts" / "loraplex" / "values.yaml").read_text())


def lookup(values: dict, key: str):
    node = values
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"{key} is not in charts/loraplex/values.yaml"
        node = node[part]
    return node


def test_chart_values_the_readme_names_exist_with_their_defaults():
    values = values_yaml()
    keys = {s for s in spans(README) if re.fullmatch(r"(operator|nodeAgent|imagePullSecrets)(\.\w+)*", s)}
    keys |= set(re.findall(r"--set ([\w.]+)=", README))
    assert "nodeAgent.planConfigMap" in keys
    for key in keys:
        lookup(values, key)
    for row in table_rows(section("Helm chart values")):
        names = spans(row[0])
        defaults = spans(row[1])
        if len(defaults) == len(names):
            for key, default in zip(names, defaults):
                assert yaml.safe_load(default) == lookup(values, key), (key, default)


def test_helm_and_kubectl_commands_point_at_what_exists():
    block = fenced(section("Deploying on a cluster"), "bash")[0].replace("\\\n", " ")
    commands = [c for c in (shlex.split(line.split("#", 1)[0]) for line in block.splitlines()) if c]
    helm = next(c for c in commands if c[:2] == ["helm", "install"])
    assert (ROOT / helm[3] / "Chart.yaml").is_file()
    apply = next(c for c in commands if c[:3] == ["kubectl", "apply", "-k"])
    kustomization = yaml.safe_load((ROOT / apply[3] / "kustomization.yaml").read_text())
    docs = [d for f in kustomization["resources"]
            for d in yaml.safe_load_all((ROOT / apply[3] / f).read_text()) if d]
    bases = {d["metadata"]["name"] for d in docs if d["kind"] == "BaseModel"}
    namespace = kustomization["namespace"]
    for c in commands:
        if c[0] == "kubectl" and "-n" in c:
            assert c[c.index("-n") + 1] == namespace, c
        if c[:3] == ["kubectl", "get", "configmap"]:
            assert c[3].removesuffix("-plan") in bases and c[3].endswith("-plan"), c
    # No plan named: the chart's agents follow the plans the operator mirrors into its namespace.
    assert "--set" not in helm and values_yaml()["nodeAgent"]["discoverPlans"] is True
    assert helm[helm.index("-n") + 1] == "loraplex-system"  # the namespace the README lists the copies in
    assert "kubectl get configmaps -n loraplex-system -l loraplex.io/plan-mirror=true" in README
    # "Without Helm: `kubectl apply -f crds/`"
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == [
        "basemodels.loraplex.io.yaml", "loraadapters.loraplex.io.yaml"]


def test_the_servers_command_line_the_readme_gives_is_the_operators():
    from loraplex.operator.specs import BaseModelSpec
    from loraplex.operator.workloads import server_args

    text = " ".join(section("Deploying on a cluster").split())
    said = re.search(r"`(loraplex-server --model .*?)`", text).group(1)
    base_doc = yaml.safe_load((ROOT / "examples" / "basemodel.yaml").read_text())
    base = BaseModelSpec.from_body(base_doc | {"metadata": {**base_doc["metadata"], "namespace": "ml"}})
    said_flags = [t for t in said.split() if t.startswith("--")]
    actual = [t for t in server_args(base, 8) if t.startswith("--")]
    # The README quotes the flags every server gets; the optional serving.engine fields the
    # example sets and its extraArgs follow them, as the README says.
    optional = [t for t in [*base.serving.engine.args()[4:], *base.serving.extra_args] if t.startswith("--")]
    assert said_flags + optional == actual


# -- HTTP endpoints --------------------------------------------------------------------------


def documented_endpoints(text: str) -> set[tuple[str, str]]:
    found = set()
    for row in table_rows(text):
        for s in spans(row[0]):
            m = re.fullmatch(r"(GET|POST|PUT|PATCH|DELETE) (/\S*)", s)
            if m:
                found.add((m.group(1), m.group(2)))
    return found


def test_server_endpoints_are_the_documented_ones():
    from loraplex.server.api.app import create_app

    app = create_app(None)  # routes only: the engine starts in lifespan, which does not run here
    served = {(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops}
    assert documented_endpoints(section("HTTP API (OpenAI-compatible, as vLLM's)")) == served


def test_node_agent_endpoints_are_the_documented_ones(tmp_path):
    from loraplex.node_agent.app import AgentConfig, create_app

    app = create_app(AgentConfig(cache_dir=tmp_path, budget_bytes=1 << 20))
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert documented_endpoints(section("loraplex-node-agent")) == served


# -- metrics ---------------------------------------------------------------------------------


def metric_table(text: str) -> dict[str, set[str]]:
    """{series: its labels} of the metrics table in `text`."""
    out = {}
    for row in table_rows(text):
        names = spans(row[0])
        if len(row) == 4 and names and row[1] in ("counter", "gauge", "histogram"):
            out[names[0]] = set(spans(row[2]))
    return out


def exposed(text: str) -> dict[str, tuple[str, set[str] | None]]:
    """{series name as users query it: (type, labels or None when it has no sample yet)}.
    A counter is queried as NAME_total, a histogram as NAME (NAME_bucket, _sum, _count)."""
    out = {}
    families = list(text_string_to_metric_families(text))
    kinds = {fam.name: fam.type for fam in families}
    for fam in families:
        if fam.name.endswith("_created") and kinds.get(fam.name.removesuffix("_created")) in ("counter", "histogram"):
            continue  # prometheus-client's creation time of a counter or histogram
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = {k for s in fam.samples for k in s.labels} - {"le"} if fam.samples else None
        out[name] = (fam.type, labels)
    return out


def sample_names(series: dict[str, tuple[str, set[str] | None]]) -> dict[str, set[str] | None]:
    """Every name a PromQL query may use, with its labels."""
    out = {}
    for name, (kind, labels) in series.items():
        if kind == "histogram":
            out[name + "_bucket"] = (labels or set()) | {"le"}
            out[name + "_sum"] = out[name + "_count"] = labels
        else:
            out[name] = labels
    return out


@pytest.fixture(scope="module")
def server_metrics(tmp_path_factory) -> str:
    """/metrics of a real tiny CPU server (the demo's model and adapters) after a request to
    an adapter and one to an adapter on disk whose weights are cut (a failed load)."""
    from fastapi.testclient import TestClient

    from loraplex.server.api.app import create_app
    from loraplex.server.demo import build_demo
    from loraplex.server.engine import LLMEngine
    from loraplex.server.settings import ServerSettings

    root = tmp_path_factory.mktemp("demo")
    base, adapters = build_demo(root)
    cache = root / "cache"
    broken = cache / "broken"
    shutil.copytree(adapters["sql-expert"], broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    engine = LLMEngine.from_settings(ServerSettings(
        model=str(base), device="cpu", max_num_seqs=4, max_model_len=128, max_loras=4,
        adapter_cache_dir=str(cache), lora_modules=[f"{n}={p}" for n, p in adapters.items()]))
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/completions", json={"model": "sql-expert", "prompt": "SELECT", "max_tokens": 3})
        assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"model": "broken", "prompt": "SELECT", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["code"] == "adapter_load_failed", r.text
        return client.get("/metrics").text


def test_server_metrics_are_the_documented_ones(server_metrics):
    documented = metric_table(section("Metrics").split("The node agent's")[0])
    series = exposed(server_metrics)
    assert set(documented) == set(series), (f"not in the README: {sorted(set(series) - set(documented))}; "
                                            f"not served: {sorted(set(documented) - set(series))}")
    wrong = {n: (documented[n], labels) for n, (_, labels) in series.items() if labels != documented[n]}
    assert not wrong, wrong


async def test_node_agent_metrics_are_the_documented_ones(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    from loraplex.node_agent.app import AgentConfig, create_app

    documented = metric_table(section("Metrics").split("The node agent's")[1])
    client = TestClient(TestServer(create_app(AgentConfig(cache_dir=tmp_path, budget_bytes=1 << 20)),
                                   host="127.0.0.1"))
    await client.start_server()
    try:
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    series = exposed(text)
    assert set(documented) == set(series), (f"not in the README: {sorted(set(series) - set(documented))}; "
                                            f"not served: {sorted(set(documented) - set(series))}")
    wrong = {n: (documented[n], labels) for n, (_, labels) in series.items()
             if labels is not None and labels != documented[n]}
    assert not wrong, wrong


PROMQL_FUNCTIONS = {"sum", "rate", "irate", "increase", "histogram_quantile", "avg", "max", "min", "by", "without"}
TARGET_LABELS = {"instance", "job"}  # Prometheus adds these to every scraped series


def promql_queries() -> list[str]:
    queries = []
    for block in fenced(section("Metrics"), "promql"):
        current: list[str] = []
        for line in block.splitlines() + [""]:
            if not line.strip() or line.lstrip().startswith("#"):
                if current:
                    queries.append(" ".join(current))
                current = []
            else:
                current.append(line.strip())
    return queries


def test_promql_uses_real_series_and_labels(server_metrics):
    names = sample_names(exposed(server_metrics))
    queries = promql_queries()
    assert len(queries) >= 3
    for q in queries:
        depth = 0
        for ch in q:  # brackets balance
            depth += {"(": 1, ")": -1}.get(ch, 0)
            assert depth >= 0, q
        assert depth == 0 and q.count("{") == q.count("}") and q.count("[") == q.count("]"), q
        used = set(re.findall(r"\b(?:loraplex_|vllm:)[\w:]+", q))
        assert used and used <= set(names), (q, used - set(names))
        labels = set().union(*(names[u] or set() for u in used)) | TARGET_LABELS
        for matcher in re.findall(r"\{([^}]*)\}", q):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matcher):
                assert label in labels, (q, label)
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", q):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in labels, (q, label)
        for fn in re.findall(r"\b([a-z_]+)\s*\(", q):
            assert fn in PROMQL_FUNCTIONS, (q, fn)
        for window in re.findall(r"\[([^\]]*)\]", q):
            assert re.fullmatch(r"\d+[smhd]", window), (q, window)
    text = " ".join(queries)
    # the three a user watches: tokens/s, the adapter cache's hit rate, cold-load p95
    assert "rate(loraplex_generation_tokens_total[" in text
    assert "loraplex_adapter_cache_hits_total" in text and "loraplex_adapter_cache_misses_total" in text
    assert "histogram_quantile(0.95" in text and "loraplex_adapter_load_seconds_bucket" in text


# -- bench/README ----------------------------------------------------------------------------


def test_bench_readme_lists_every_script_with_flags_it_has():
    rows = {spans(r[0])[0]: r for r in table_rows(BENCH_README) if spans(r[0])}
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")} - {"checkout.py"}
    assert set(rows) == scripts
    shared = (ROOT / "bench" / "checkout.py").read_text()
    for name, row in rows.items():
        source = (ROOT / "bench" / name).read_text()
        if "engine_parser" in source:
            source += shared
        missing = [f for f in set(flags_in(" ".join(row[1:]))) if f'"{f}"' not in source]
        assert not missing, (name, missing)
    for cmd in re.findall(r"`(python3 bench/[^`]+)`", BENCH_README) + re.findall(r"python3? (bench/\S+\.py[^\n`]*)", README):
        script = ROOT / next(t for t in shlex.split(cmd) if t.startswith("bench/"))
        source = script.read_text() + (shared if "engine_parser" in script.read_text() else "")
        assert all(f'"{f}"' in source for f in flags_in(cmd)), cmd


def test_readme_json_snippets_parse():
    """Request bodies the README shows (its curl examples) are JSON."""
    for body in re.findall(r"-d '(\{.*?\})'", README, re.S):
        json.loads(body)


def test_the_servers_help_names_the_node_agents_port():
    """--node-agent-url's example is where the node agent listens by default."""
    from loraplex.node_agent.cli import Settings
    from loraplex.server.settings import field_docs

    urls = re.findall(r"https?://[\w.]+:(\d+)", field_docs()["node_agent_url"])
    assert urls and all(int(port) == Settings.port for port in urls), urls


def test_the_charts_notes_commands_work_as_written():
    """What `helm install` prints: the configmap lives in the BaseModel's namespace (a get
    without -n looked in the default one and found nothing), the example's namespace is the
    kustomization's, and the value it names exists."""
    notes = (ROOT / "charts" / "loraplex" / "templates" / "NOTES.txt").read_text()
    kustomization = yaml.safe_load((ROOT / "examples" / "kustomization.yaml").read_text())
    assert f"namespace {kustomization['namespace']}" in notes
    for line in notes.splitlines():
        if line.strip().startswith("kubectl get configmap"):
            assert " -n " in line, line
    for key in re.findall(r"\b(nodeAgent\.\w+)=", notes):
        lookup(values_yaml(), key)
