"""The Ray dashboard as a user sees it: start `specserve up`, load it, screenshot, check, shut down.

    scripts/in-netns.sh .venv/bin/python scripts/dashboard_screenshots.py [--out docs/]

1. starts `specserve up --model smollm2-135m --draft ngram` as a child process and waits for its
   `grpc:` / `http:` / `dashboard:` lines;
2. sends a few OpenAI requests (chat and completions, one streamed) so the metrics hold values;
3. checks through the dashboard's REST API (GET /api/serve/applications/) that the application
   `specserve` is RUNNING and each expected deployment (Ingress, Scheduler, Verifier, and Drafter
   when a draft model is configured) is HEALTHY with all its replicas RUNNING, and that Ray's
   Prometheus endpoint (the node's metrics agent) exports the application's `ray_specserve_*` metrics;
4. saves screenshots with headless Chromium (Debian's `chromium`): the dashboard's Serve page of the
   application (OUT/dashboard-serve.png) and a metrics view (OUT/dashboard-metrics.png);
5. stops the server with SIGTERM to its PID (never `ray stop`).

The metrics view: the Ray dashboard draws its time-series charts only by embedding Grafana (not packaged
by Debian; AGPL), so with Debian's `prometheus` on PATH the script runs it on the scrape config Ray
writes into its session folder and screenshots Prometheus's graph of the application's Ray metrics
(the same series Ray's Grafana dashboards query); without it, the dashboard's own Metrics page.
Exits 0 when every check passed, 1 otherwise (each finding printed).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
APP_NAME = "specserve"
ADDRESS_KEYS = ("grpc", "http", "dashboard")
# metrics every request records (cluster/serving/metrics.py), as Ray's Prometheus endpoint names them
REQUIRED_RAY_METRICS = ("ray_specserve_requests", "ray_specserve_generation_tokens",
                        "ray_specserve_time_to_first_token_seconds")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=15000")
SERVE_WINDOW = (1600, 1000)
METRICS_WINDOW = (1600, 2250)  # Prometheus's classic graph page: ~700 px per panel
MAX_PNG_BYTES = 500_000
PROMETHEUS_PORT = 9090
PROMETHEUS_PANELS = (  # the metrics screenshot's graph panels, top to bottom
    "sum by (position) (ray_specserve_spec_decode_num_accepted_tokens_per_pos_total)",
    "sum by (finish_reason) (ray_specserve_requests_total)",
    "sum(ray_specserve_generation_tokens_total)",
)
PROMETHEUS_SAMPLES = 3  # scrapes (10 s apart in Ray's config) before the graph is taken


@dataclass(frozen=True)
class Finding:
    """One checked fact: what was checked, whether it holds, what was seen."""

    what: str
    ok: bool
    seen: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.what}: {self.seen}"


# ---------------------------------------------------------------------- checks (pure)
def expected_deployments(draft: str) -> list[str]:
    """The deployments `cluster/serving/app.py` builds: no Drafter with n-gram drafts."""
    return ["Ingress", "Scheduler", "Verifier"] + ([] if draft == "ngram" else ["Drafter"])


def check_serve_applications(answer: Mapping[str, Any], app: str, deployments: Sequence[str]) -> list[Finding]:
    """Read GET /api/serve/applications/ (Serve's ServeInstanceDetails): `app` RUNNING, and each of
    `deployments` HEALTHY with at least its target number of replicas, every replica RUNNING."""
    details = (answer.get("applications") or {}).get(app)
    if not isinstance(details, Mapping):
        listed = sorted(answer.get("applications") or {})
        return [Finding(f"application {app}", False, f"not listed (applications: {listed or 'none'})")]
    status = details.get("status")
    findings = [Finding(f"application {app}", status == "RUNNING", str(status))]
    listed = details.get("deployments") or {}
    for name in deployments:
        deployment = listed.get(name)
        if not isinstance(deployment, Mapping):
            findings.append(Finding(f"deployment {name}", False, f"not listed (deployments: {sorted(listed)})"))
            continue
        replicas = deployment.get("replicas") or []
        states = [replica.get("state") for replica in replicas]
        running = states.count("RUNNING")
        target = deployment.get("target_num_replicas", 1)
        ok = deployment.get("status") == "HEALTHY" and running >= max(1, target) and running == len(states)
        findings.append(Finding(f"deployment {name}", ok, f"{deployment.get('status')}, {running}/{target} "
                                                          f"replicas RUNNING (states: {states})"))
    extra = sorted(set(listed) - set(deployments))
    if extra:
        findings.append(Finding("unexpected deployments", False, ", ".join(extra)))
    return findings


def prometheus_metric_names(text: str) -> set[str]:
    """Metric family names in Prometheus text (samples' names less _total/_bucket/_sum/_count/_created)."""
    names = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                break
        names.add(name)
    return names


def check_ray_metrics(names: set[str], required: Iterable[str] = REQUIRED_RAY_METRICS) -> list[Finding]:
    ours = sorted(name for name in names if name.startswith("ray_specserve_"))
    missing = [name for name in required if name not in names]
    return [Finding("Ray's Prometheus endpoint exports the application's metrics", not missing,
                    f"{len(ours)} ray_specserve_* families" + (f"; missing {missing}" if missing else "")
                    + (f" ({', '.join(ours)})" if ours else ""))]


# ---------------------------------------------------------------------- the server
class Server:
    """`specserve up` as a child process; its stdout is drained by a thread (addresses parsed from it)."""

    def __init__(self, argv: list[str], log: TextIO) -> None:
        self.process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def addresses(self, timeout_s: float) -> dict[str, str]:
        found: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while set(found) != set(ADDRESS_KEYS):
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"`specserve up` printed no addresses within {timeout_s:.0f}s") from None
            if line is None:
                raise RuntimeError(f"`specserve up` exited ({self.process.wait()}) before printing its addresses")
            key, _, value = line.partition(": ")
            if key in ADDRESS_KEYS:
                found[key] = value.strip()
                print(f"  {line}")
        return found

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM to the PID, then wait; SIGKILL only if it is still there after `timeout_s`."""
        if self.process.poll() is None:
            print(f"stopping specserve up (SIGTERM to PID {self.process.pid})")
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"  still running after {timeout_s:.0f}s: SIGKILL to PID {self.process.pid}")
                self.process.kill()
                self.process.wait()
        return self.process.returncode


# ---------------------------------------------------------------------- HTTP
def get_json(url: str, timeout_s: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return json.load(answer)


def post(url: str, body: Mapping[str, Any], timeout_s: float = 300.0) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return answer.read()


def send_requests(http: str, model: str) -> list[Finding]:
    """A few greedy requests of each kind; the streamed one is read to its `data: [DONE]`."""
    prompts = ["Write a Python function that reverses a string.", "What is the capital of France?",
               "List three prime numbers."]
    findings = []
    for index, prompt in enumerate(prompts):
        chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                "temperature": 0}
        answer = json.loads(post(f"{http}/v1/chat/completions", chat))
        tokens = answer["usage"]["completion_tokens"]
        findings.append(Finding(f"chat completion {index}", tokens > 0, f"{tokens} tokens"))
    completion = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}
    tokens = json.loads(post(f"{http}/v1/completions", completion))["usage"]["completion_tokens"]
    findings.append(Finding("completion", tokens > 0, f"{tokens} tokens"))
    streamed = post(f"{http}/v1/chat/completions", {**chat, "stream": True}).decode()
    events = [line for line in streamed.splitlines() if line.startswith("data: ")]
    findings.append(Finding("streamed chat completion", bool(events) and events[-1] == "data: [DONE]",
                            f"{len(events)} SSE events"))
    return findings


def wait_for(probe: Any, timeout_s: float, every_s: float = 2.0) -> Any:
    """Call `probe` until it returns a truthy value or time runs out; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(every_s)


def serve_findings(dashboard: str, deployments: Sequence[str], timeout_s: float) -> list[Finding]:
    url = f"{dashboard}/api/serve/applications/"

    def probe() -> list[Finding] | None:
        try:
            findings = check_serve_applications(get_json(url), APP_NAME, deployments)
        except (OSError, ValueError) as exc:
            return [Finding(f"GET {url}", False, repr(exc))] if time.monotonic() >= deadline else None
        return findings if all(f.ok for f in findings) or time.monotonic() >= deadline else None

    deadline = time.monotonic() + timeout_s
    return wait_for(probe, timeout_s + 5)


def ray_session_dir() -> Path:
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "session_latest"


def ray_metrics_text(session: Path) -> str:
    """The node metrics agents' Prometheus text (targets from Ray's service-discovery file)."""
    groups = json.loads((session / "prom_metrics_service_discovery.json").read_text())
    texts = []
    for group in groups:
        for target in group.get("targets", []):
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as answer:
                texts.append(answer.read().decode())
    return "\n".join(texts)


def metrics_findings(session: Path, timeout_s: float) -> list[Finding]:
    """Ray exports on its report interval: wait until the required families show (or time runs out)."""
    def probe() -> list[Finding] | None:
        try:
            findings = check_ray_metrics(prometheus_metric_names(ray_metrics_text(session)))
        except (OSError, ValueError) as exc:
            findings = [Finding("Ray's Prometheus endpoint", False, repr(exc))]
        return findings if all(f.ok for f in findings) or time.monotonic() >= deadline else None

    deadline = time.monotonic() + timeout_s
    return wait_for(probe, timeout_s + 5, every_s=5.0)


# ---------------------------------------------------------------------- Prometheus
def start_prometheus(session: Path, workdir: Path, log: TextIO) -> subprocess.Popen[bytes]:
    """Debian's prometheus on the scrape config Ray wrote for this session (its metrics agents)."""
    config = session / "metrics" / "prometheus" / "prometheus.yml"
    argv = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"]
    print(f"starting {' '.join(argv)}")
    return subprocess.Popen(argv, stdout=log, stderr=log)


def prometheus_samples(metric: str) -> int:
    """How many samples of `metric` Prometheus holds from the last 10 minutes (0 if none or not reachable)."""
    expression = urllib.parse.quote(f"max(count_over_time({metric}[10m]))")
    try:
        result = get_json(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?query={expression}", 5)["data"]["result"]
    except (OSError, ValueError, KeyError):
        return 0
    return int(float(result[0]["value"][1])) if result else 0


def prometheus_graph_url(panels: Sequence[str], range_input: str = "3m") -> str:
    """Debian's prometheus serves the classic UI (its React UI is not packaged) under /classic/."""
    query = {}
    for index, expression in enumerate(panels):
        query |= {f"g{index}.expr": expression, f"g{index}.tab": "0", f"g{index}.range_input": range_input}
    return f"http://127.0.0.1:{PROMETHEUS_PORT}/classic/graph?{urllib.parse.urlencode(query)}"


# ---------------------------------------------------------------------- Chromium
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("no chromium on PATH: apt-get install -y chromium")
    return path


def run_chromium(url: str, window: tuple[int, int], *action: str) -> str:
    """One headless Chromium run in a throw-away profile; returns its stdout."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        argv = [chromium(), *CHROMIUM_FLAGS, f"--window-size={window[0]},{window[1]}", f"--user-data-dir={profile}",
                *action, url]
        if "--dump-dom" not in action:
            print(f"  {' '.join(argv)}")
        done = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120)
    return done.stdout


def screenshot(url: str, path: Path, window: tuple[int, int]) -> None:
    run_chromium(url, window, f"--screenshot={path}")
    shrink_png(path)


def rendered_text(url: str) -> str:
    """The page's DOM after its scripts ran (to check that the React app rendered what the picture shows)."""
    return run_chromium(url, SERVE_WINDOW, "--dump-dom")


def shrink_png(path: Path) -> None:
    """Re-encode with a 256-colour palette when the PNG is over the size limit (UI screenshots lose nothing)."""
    if path.stat().st_size <= MAX_PNG_BYTES:
        return
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)


def png_finding(path: Path, what: str) -> Finding:
    """Not blank: at least 2% of the pixels differ from the most common colour; under the size limit."""
    from PIL import Image

    if not path.is_file():
        return Finding(what, False, f"{path} not written")
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=rgb.width * rgb.height) or []
        size = f"{rgb.width}x{rgb.height}"
    dominant = max(count for count, _ in colours) / sum(count for count, _ in colours)
    bytes_ = path.stat().st_size
    ok = dominant <= 0.98 and len(colours) > 16 and bytes_ <= MAX_PNG_BYTES
    return Finding(what, ok, f"{path} {size}, {bytes_ // 1024} KiB, {len(colours)} colours, "
                             f"{100 * (1 - dominant):.1f}% off the background")


def text_finding(text: str, words: Sequence[str], what: str) -> Finding:
    missing = [word for word in words if word not in text]
    return Finding(what, not missing, "shows " + ", ".join(words) if not missing else f"missing {missing}")


# ---------------------------------------------------------------------- the run
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs", help="folder for the PNGs (default docs/)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="ngram")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for `specserve up`")
    p.add_argument("--metrics-timeout", type=float, default=120.0,
                   help="seconds to wait for the metrics to reach Ray's Prometheus endpoint")
    p.add_argument("--no-prometheus", action="store_true",
                   help="screenshot the dashboard's own Metrics page even when `prometheus` is on PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chromium()  # fail before starting anything
    workdir = Path(tempfile.mkdtemp(prefix="dashboard-screenshots-"))
    log_path = workdir / "specserve-up.log"
    findings: list[Finding] = []
    prometheus: subprocess.Popen[bytes] | None = None
    up = [sys.executable, "-m", "cluster.cli.main", "up", "--model", args.model, "--draft", args.draft]
    print(f"starting {' '.join(up[2:])} (log: {log_path})")
    with log_path.open("w") as log:
        server = Server(up, log)
        try:
            addresses = server.addresses(args.startup_timeout)
            http, dashboard = addresses["http"], addresses["dashboard"]
            session = ray_session_dir()
            use_prometheus = not args.no_prometheus and shutil.which("prometheus") is not None
            if use_prometheus:  # before the requests, so that its graphs show the counters rise
                prometheus = start_prometheus(session, workdir, log)
            print("sending requests")
            findings += send_requests(http, args.model)
            print("checking the dashboard's REST API and Ray's metrics endpoint")
            findings += serve_findings(dashboard, expected_deployments(args.draft), timeout_s=60)
            findings += metrics_findings(session, args.metrics_timeout)
            serve_url = f"{dashboard}/#/serve/applications/{APP_NAME}"
            print("screenshots")
            serve_png = args.out / "dashboard-serve.png"
            screenshot(serve_url, serve_png, SERVE_WINDOW)
            findings.append(png_finding(serve_png, "Serve page screenshot"))
            findings.append(text_finding(rendered_text(serve_url), [APP_NAME, *expected_deployments(args.draft)],
                                         "Serve page as rendered"))
            metrics_png = args.out / "dashboard-metrics.png"
            if use_prometheus:
                metric = "ray_specserve_requests_total"
                samples = wait_for(lambda: prometheus_samples(metric) >= PROMETHEUS_SAMPLES, timeout_s=90)
                findings.append(Finding("Prometheus scraped the application's series", samples,
                                        f"{prometheus_samples(metric)} samples of {metric}"))
                screenshot(prometheus_graph_url(PROMETHEUS_PANELS), metrics_png, METRICS_WINDOW)
            else:
                screenshot(f"{dashboard}/#/metrics", metrics_png, SERVE_WINDOW)
            findings.append(png_finding(metrics_png, "metrics screenshot"))
        except Exception as exc:  # report it as a finding, then shut down all the same
            findings.append(Finding("run", False, f"{type(exc).__name__}: {exc}"))
        finally:
            if prometheus is not None:
                prometheus.terminate()
                prometheus.wait(30)
            code = server.stop(timeout_s=120)
            findings.append(Finding("specserve up exited after SIGTERM", code == 0, f"exit status {code}"))
    print()
    for finding in findings:
        print(finding.line())
    failed = [f for f in findings if not f.ok]
    if failed:
        print(f"\n{len(failed)} check(s) failed; the server's log: {log_path}")
        print("".join(log_path.read_text().splitlines(keepends=True)[-30:]))
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nall {len(findings)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
