"""The deployment files parse, their command lines are valid refitd invocations, the chart
renders to manifests with the probes and IPC settings the agents need, and the dashboard
queries only metrics the controller exports."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from refitd.cli.main import build_parser
from refitd.config import Settings
from refitd.server.metrics import ControllerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CHART = DEPLOY / "helm" / "refitd"
TEMPLATE_REF = re.compile(r"\{\{\s*\.(Values|Release|Chart)\.([A-Za-z0-9_.]+)\s*\}\}")


def assert_valid_cli(argv: list[str]) -> None:
    """Parse argv with refitd's own parser; unknown flags or subcommands fail the test."""
    args = build_parser(argv).parse_args(argv)
    assert args.command in ("serve", "agent")


def render_chart(release: str = "rt") -> list[dict]:
    """Render the chart's templates with values.yaml.

    The chart uses plain value references only, so substitution is the whole of rendering;
    any other template construct is rejected so this stays an honest render.
    """
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    scopes = {"Values": values, "Release": {"Name": release}, "Chart": {"Name": chart["name"]}}

    def lookup(m: re.Match[str]) -> str:
        node = scopes[m.group(1)]
        for part in m.group(2).split("."):
            node = node[part]
        return str(node)

    docs: list[dict] = []
    for path in sorted((CHART / "templates").glob("*.yaml")):
        text = TEMPLATE_REF.sub(lookup, path.read_text())
        assert "{{" not in text, f"{path.name}: unsupported template construct"
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_parse_and_run_refitd(name: str, tmp_path: Path) -> None:
    parser = DockerfileParser(path=str(tmp_path), env_replace=False)
    parser.content = (DEPLOY / "docker" / name).read_text()
    instructions = [i["instruction"] for i in parser.structure if i["instruction"] != "COMMENT"]
    assert instructions[0] == "FROM"
    assert "torch==2.13.0" in parser.content, "torch must be pinned"
    assert "libibverbs1" in parser.content, "the rdma path's engine links libibverbs"
    entry = json.loads(
        next(i["value"] for i in parser.structure if i["instruction"] == "ENTRYPOINT")
    )
    cmd = json.loads(next(i["value"] for i in parser.structure if i["instruction"] == "CMD"))
    assert entry == ["refitd"]
    assert_valid_cli(cmd)


def test_compose_commands_are_valid() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"controller", "agent"}
    for service in compose["services"].values():
        assert_valid_cli(service["command"])
    assert compose["services"]["agent"]["ipc"] == "host"


def test_chart_renders_probes_and_host_ipc() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render_chart("rt")}
    deployment = docs[("Deployment", "rt-controller")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert_valid_cli(container["args"])
    agent = docs[("DaemonSet", "rt-agent")]["spec"]["template"]["spec"]
    assert agent["hostIPC"] is True
    assert_valid_cli(agent["containers"][0]["args"])
    service_ports = {p["name"] for p in docs[("Service", "rt-controller")]["spec"]["ports"]}
    assert service_ports == {"grpc", "http", "store"}
    config = tomllib.loads(docs[("ConfigMap", "rt-config")]["data"]["refitd.toml"])
    settings = Settings(**config)
    assert settings.host == "0.0.0.0" and settings.embedded_agent is False


def test_systemd_units_start_valid_commands() -> None:
    for unit in (DEPLOY / "systemd").glob("*.service"):
        line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
        argv = shlex.split(line.removeprefix("ExecStart="))
        assert Path(argv[0]).name == "refitd", unit.name
        assert_valid_cli(argv[1:])


def test_dashboard_and_scrape_config_match_exported_metrics() -> None:
    exported: set[str] = set()
    for family in ControllerMetrics().registry.collect():
        exported.update(sample.name for sample in family.samples)
        exported.add(family.name)
    counters = {f.name + "_total" for f in ControllerMetrics().registry.collect()}
    exported |= counters
    histogram_parts = {n + s for n in exported for s in ("_bucket", "_sum", "_count")}
    dashboard = json.loads((DEPLOY / "grafana" / "refitd-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\brefitd_[a-z_]+", target["expr"])
    }
    assert queried, "the dashboard queries no refitd metric"
    unknown = queried - exported - histogram_parts
    assert not unknown, f"dashboard queries metrics the controller does not export: {unknown}"
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())
    job = scrape["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{Settings().http_port}"]
