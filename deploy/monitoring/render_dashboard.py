"""Render the Grafana dashboard headless: its own queries, evaluated by a real Prometheus
scraping a loaded `ctxcache serve` stack, plotted in the dashboard's layout (matplotlib).

    .venv/bin/python deploy/monitoring/render_dashboard.py --engine vllm \\
        --out docs/img/dashboard.png

Needs the `prometheus` binary (Debian: apt-get install prometheus); with
`prometheus-redis-exporter` (apt-get install prometheus-redis-exporter) the Redis panels
have data too. The stack (its manager as its own process, as compose and Kubernetes run
it, and a Redis of its own), Prometheus (2 s scrapes, the alert rules loaded) and the load
all run on this machine, on free ports; everything is stopped at the end.
docs/operations.md shows the result.

The load is what an operator's dashboard should show working: conversations (a session
created with a document, then short turns, now and then streamed), plain requests, a long
answer not streamed now and then, one client over its rate limit (429s), and, on vLLM,
its prefix cache dropped every few seconds so that sessions come back from the sidecar.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "grafana" / "dashboards" / "ctxcache.json"
TOKEN = "render-metrics-token"  # the gateway's metrics token (GET /metrics/tenants)
KEY, LIMITED = "k-render", "k-limited"  # the load's API keys; the second one is held to 20 rpm
RESET_EVERY_S = 8.0  # (vLLM) its prefix cache is dropped this often: turns load from the sidecar
RATE_INTERVAL = "20s"  # what Grafana's $__rate_interval is at a 2 s scrape and this width
WORDS = "the cat sat on a mat while dogs ran over green hills and people talked of rain".split()  # noqa: SIM905


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "builtin"), default="builtin")
    p.add_argument("--seconds", type=float, default=150.0, help="load duration")
    p.add_argument("--clients", type=int, default=4, help="concurrent conversations")
    p.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    args = p.parse_args()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        sys.stderr.write("needs the prometheus binary (apt-get install prometheus)\n")
        return 2
    from ctxcache.net import free_port
    from ctxcache.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        port = free_port()
        procs: list[subprocess.Popen[bytes]] = []
        redis = RedisServer(tmp / "redis", fsync="always")
        try:
            redis.start()
            log = open(tmp / "serve.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "ctxcache.cli", "serve", "--port", str(port)),
                        *("--data-dir", str(tmp / "data"), "--engine", args.engine),
                        *("--redis-url", redis.url, "--manager-service"),
                        *("--api-key", f"{KEY}=render", "--api-key", f"{LIMITED}=limited:rpm=20"),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={
                        **os.environ,
                        "CTX_GATEWAY_METRICS_TOKEN": TOKEN,
                        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
                    },
                )
            )
            gateway = f"http://127.0.0.1:{port}"
            _wait(f"{gateway}/ready", 900, procs[0], tmp / "serve.log")
            ports = json.loads((tmp / "data" / "ports.json").read_text())
            exporter = shutil.which("prometheus-redis-exporter") or shutil.which("redis_exporter")
            if exporter is not None:
                ports["redis_exporter"] = free_port()
                procs.append(
                    subprocess.Popen(
                        [
                            exporter,
                            f"--redis.addr=redis://127.0.0.1:{redis.port}",
                            f"--web.listen-address=127.0.0.1:{ports['redis_exporter']}",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            else:
                sys.stderr.write("no prometheus-redis-exporter: the Redis panels stay empty\n")
            prom_port = free_port()
            config = tmp / "prometheus.yml"
            config.write_text(_prometheus_config(port, ports))
            procs.append(
                subprocess.Popen(
                    [
                        *(prometheus, f"--config.file={config}"),
                        *(
                            f"--storage.tsdb.path={tmp / 'tsdb'}",
                            f"--web.listen-address=127.0.0.1:{prom_port}",
                        ),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            prom = f"http://127.0.0.1:{prom_port}"
            _wait(f"{prom}/-/ready", 60, procs[1], None)
            start = time.time()
            sys.stderr.write(f"load: {args.clients} conversations for {args.seconds:.0f} s\n")
            engine = f"http://127.0.0.1:{ports['engine']}" if args.engine == "vllm" else None
            _load(gateway, args.clients, args.seconds, engine)
            time.sleep(6)  # the last scrapes
            end = time.time()
            series = _evaluate(prom, start, end)
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            redis.stop()
    _plot(series, args.out, start, f"ctxcache serve --engine {args.engine}, {args.clients} clients")
    sys.stderr.write(f"wrote {args.out}\n")
    return 0


def _prometheus_config(gateway: int, ports: dict[str, int]) -> str:
    jobs = {
        "ctxcache-gateway": gateway,
        "ctxcache-manager": ports["manager"],
        "ctxcache-sidecar": ports["sidecar_control"],
        "ctxcache-worker": ports["engine"],
    }
    if "redis_exporter" in ports:
        jobs["ctxcache-redis"] = ports["redis_exporter"]
    scrape = "".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        for job, port in jobs.items()
    )
    scrape += (
        "  - job_name: ctxcache-gateway-tenants\n    metrics_path: /metrics/tenants\n"
        f"    authorization: {{credentials: {TOKEN}}}\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{gateway}']\n"
    )
    return (
        "global:\n  scrape_interval: 2s\n  evaluation_interval: 2s\n"
        f"rule_files:\n  - {HERE / 'alerts.yml'}\nscrape_configs:\n{scrape}"
    )


def _wait(url: str, seconds: float, proc: subprocess.Popen[bytes], log: Path | None) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"{url} did not come up\n{tail}")
        time.sleep(0.5)


def _load(gateway: str, clients: int, seconds: float, engine: str | None) -> None:
    """Conversations: a session created with a document, then turns, now and then a plain
    request, a stream or (client 0) a long answer not streamed; each client a new session
    every 8 turns. Beside them, a client over its rate limit and (vLLM: `engine`) the
    prefix cache dropped every `RESET_EVERY_S`."""
    stop = time.monotonic() + seconds
    auth = {"authorization": f"Bearer {KEY}"}

    def text(rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def client(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(base_url=gateway, timeout=120, headers=auth) as c:
            while time.monotonic() < stop:
                r = c.post("/v1/context", json={"model": "tiny", "prompt": text(rng, 400)})
                sid = r.json().get("session_id")
                for _ in range(8):
                    if time.monotonic() >= stop or sid is None:
                        break
                    body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
                    roll = rng.random()
                    if roll < 0.2:  # a plain request, no session
                        c.post("/v1/completions", json={**body, "prompt": text(rng, 200)})
                    elif roll < 0.3:
                        body.update(prompt=" " + text(rng, 12), session_id=sid, stream=True)
                        with c.stream("POST", "/v1/completions", json=body) as s:
                            for _ in s.iter_bytes():
                                pass
                    elif roll < 0.4 and i == 0:  # a long answer, not streamed
                        body.update(prompt=" " + text(rng, 12), session_id=sid)
                        body.update(max_tokens=160, ignore_eos=True)
                        c.post("/v1/completions", json=body)
                    else:
                        body.update(prompt=" " + text(rng, 12), session_id=sid)
                        c.post("/v1/completions", json=body)

    def limited() -> None:  # 20 rpm allowed, ~60 asked: two in three answered 429
        limited_auth = {"authorization": f"Bearer {LIMITED}"}
        with httpx.Client(base_url=gateway, timeout=120, headers=limited_auth) as c:
            while time.monotonic() < stop:
                body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
                c.post("/v1/completions", json=body)
                time.sleep(1.0)

    def drop_prefix_cache() -> None:
        assert engine is not None
        while time.monotonic() < stop:
            time.sleep(RESET_EVERY_S)
            httpx.post(f"{engine}/reset_prefix_cache", timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    threads.append(threading.Thread(target=limited))
    if engine is not None:
        threads.append(threading.Thread(target=drop_prefix_cache))
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _evaluate(prom: str, start: float, end: float) -> dict[int, list[tuple[str, list[Any]]]]:
    """Panel id -> [(legend, [[t, value], ...])] for every query of every panel."""
    out: dict[int, list[tuple[str, list[Any]]]] = {}
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = concrete(target["expr"], dashboard)
            r = httpx.get(
                f"{prom}/api/v1/query_range",
                params={"query": expr, "start": start, "end": end, "step": 4},
                timeout=30,
            ).json()
            if r["status"] != "success":
                raise RuntimeError(f"{panel['title']}: {expr}: {r}")
            for result in r["data"]["result"]:
                legend = target["legendFormat"]
                for k, v in result["metric"].items():
                    legend = legend.replace("{{" + k + "}}", v)
                legend = legend.replace("{{instance}}", "").strip()
                out.setdefault(panel["id"], []).append((legend, result["values"]))
    return out


def concrete(expr: str, dashboard: dict[str, Any]) -> str:
    """A panel's query as Grafana sends it with every variable at "All" (the stack here is
    the only deployment) and $__rate_interval at its value for this scrape interval."""
    values = {"__rate_interval": RATE_INTERVAL}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            values[var["name"]] = var["allValue"]
    for name in sorted(values, key=len, reverse=True):  # ($job before a $jo...)
        expr = expr.replace(f"${name}", values[name])
    return expr


def _plot(
    series: dict[int, list[tuple[str, list[Any]]]], out: Path, start: float, what: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, FuncFormatter, PercentFormatter

    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.42  # inches per grid row
    fig = plt.figure(figsize=(24, rows * unit_h + 0.8), facecolor="#111217")
    height = rows * unit_h + 0.8

    def box(g: dict[str, int], pad: float = 0.012) -> list[float]:
        left = g["x"] / 24 + pad + 0.018  # room for the tick labels
        width = g["w"] / 24 - 2 * pad - 0.018
        top = 1 - (0.8 + g["y"] * unit_h) / height
        h = g["h"] * unit_h / height
        return [left, top - h + 0.05 * h + 0.55 / height, width, h * 0.95 - 0.9 / height]

    fig.text(0.01, 1 - 0.35 / height, f"ctxcache — {what}", color="white", fontsize=16)
    for p in panels:
        g = p["gridPos"]
        if p["type"] == "row":
            y = 1 - (0.8 + g["y"] * unit_h + 0.3) / height
            fig.text(0.005, y, p["title"], color="#d8d9da", fontsize=13, weight="bold")
            continue
        ax = fig.add_axes(box(g))
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.tick_params(colors="#9fa1a5", labelsize=8)
        ax.set_title(p["title"], color="#d8d9da", fontsize=10, loc="left")
        data = series.get(p["id"], [])
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        if p["type"] == "stat":
            value = _last(data)
            ax.set_xticks([])
            ax.set_yticks([])
            ok = value is not None and value >= 1
            ax.set_facecolor("#1a7f37" if ok else "#b3261e")
            ax.text(
                0.5,
                0.45,
                "no data" if value is None else f"{value:g}",
                color="white",
                fontsize=28,
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            continue
        if not data:
            ax.text(
                0.5,
                0.5,
                "no data",
                color="#9fa1a5",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        for legend, values in data[:8]:
            xs = [float(t) - start for t, _ in values]
            ys = [float(v) for _, v in values]
            ax.plot(xs, ys, linewidth=1.4, label=legend)
        if data:
            ax.legend(
                fontsize=7,
                loc="upper left",
                facecolor="#181b1f",
                labelcolor="#d8d9da",
                edgecolor="#2c3235",
                ncol=2,
            )
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit == "s":
            ax.yaxis.set_major_formatter(FuncFormatter(_seconds))
        elif unit in ("bytes", "Bps"):
            ax.yaxis.set_major_formatter(EngFormatter(unit="B" if unit == "bytes" else "B/s"))
        ax.grid(color="#2c3235", linewidth=0.5)
        ax.set_xlabel("seconds into the run", color="#9fa1a5", fontsize=7)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=60, facecolor=fig.get_facecolor())


def _last(data: list[tuple[str, list[Any]]]) -> float | None:
    if not data or not data[0][1]:
        return None
    return float(data[0][1][-1][1])


def _seconds(v: float, _: object) -> str:
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
