"""A real Prometheus server for the tests, and the Grafana dashboard's queries.

`Prometheus(config, work_dir)` runs the `prometheus` binary (Debian's package; `.ci/run`
installs it) on a free loopback port with its own TSDB directory, and answers PromQL through
the same HTTP API Grafana uses. `dashboard_queries()` yields every query of every panel of
`infra/grafana/dashboards/`, with Grafana's variables filled in the way Grafana fills them.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.launch.replicas import wait_healthy
from tests.conftest import REPO, free_port

DASHBOARDS = REPO / "infra" / "grafana" / "dashboards"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    legend: str
    expr: str  # variables filled in


def rate_interval(scrape_interval_s: float, interval_s: float) -> str:
    """Grafana's `$__rate_interval`: max($__interval + scrape interval, 4 × scrape interval),
    where the scrape interval is the data source's `timeInterval`."""
    return f"{max(interval_s + scrape_interval_s, 4 * scrape_interval_s):g}s"


def dashboard_queries(scrape_interval_s: float, interval_s: float) -> list[PanelQuery]:
    """Every target of every panel; `interval_s` is the `$__interval` Grafana would pick."""
    fill = {
        "$__rate_interval": rate_interval(scrape_interval_s, interval_s),
        "$__interval": f"{max(interval_s, scrape_interval_s):g}s",
    }
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        assert not dashboard["templating"]["list"], "fill the dashboard's own variables here"
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in fill.items():
                    expr = expr.replace(name, value)
                assert "$" not in expr, f"{panel['title']}: unfilled variable in {expr}"
                out.append(PanelQuery(panel["title"], target.get("legendFormat", ""), expr))
    return out


class Prometheus:
    """`prometheus` on a free port scraping per `config` (YAML text); stop() ends it."""

    def __init__(self, binary: str, config: str, work_dir: Path) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = work_dir / "prometheus.yml"
        self.config_path.write_text(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work_dir / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={work_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        alive = lambda: self.proc.poll() is None  # noqa: E731
        wait_healthy(self.url, alive, timeout_s, name="prometheus", log=self.log, path="/-/ready")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series; `at` is a Unix time (default now)."""
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        data = self.api("query", **params)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return [(row["metric"], float(row["value"][1])) for row in data["result"]]

    def finite(self, expr: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, v) for labels, v in self.query(expr) if math.isfinite(v)]

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
