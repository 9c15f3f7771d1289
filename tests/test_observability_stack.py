"""deploy/observability against the real thing: the Grafana dashboard's queries and the alert rules name
only metrics tokenmill exports, and a real Prometheus (Debian's binary) scraping real servers answers
every panel's query without a PromQL error, with data once load went through.

Two servers cover every family the dashboard reads: one engine with a host offload tier (the offload
families; offload and KV transfer cannot share an engine), and a fleet of two workers split into prefill
and decode with a planner (the `worker` label, the router's, the KV transfer's and the planner's
families). One Prometheus, configured from the shipped prometheus.yml and prometheus-fleet.yml, scrapes
both every second and evaluates rules.yml. Grafana itself is not run (not packaged for Debian): its side
is checked as data (the JSON, the variables, the provisioning files).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from server_fixture import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
OBS = ROOT / "deploy" / "observability"
DASHBOARD = OBS / "grafana" / "tokenmill-dashboard.json"
MODEL = "smollm2-135m"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RATE_INTERVAL = "2m"  # what `$__rate_interval` stands for in the test: spans the whole load

# A metric name as PromQL writes it in a selector (`name{...}`, `name[...]`); tokenmill's (with a colon).
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*[{\[]")
COLON_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*:[A-Za-z0-9_:]*")
BUILTIN = {"up"}  # series Prometheus makes itself, not on /metrics

# Rows whose panels need a fleet (worker label, router, KV transfer, planner) or an offload tier.
FLEET_ROWS = ("Fleet:",)
OFFLOAD_ROWS = ("KV offload",)


# --------------------------------------------------------------------------------------- the files
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(dash: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(row title, panel) of every panel, rows included, collapsed rows' panels too."""
    row = ""
    for p in dash["panels"]:
        if p["type"] == "row":
            row = p["title"]
            yield row, p
            for q in p.get("panels", []):
                yield row, q
        else:
            yield row, p


def queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(row title, panel title, expression) of every panel target."""
    return [
        (row, p["title"], t["expr"]) for row, p in panels(dash) if p["type"] != "row" for t in p["targets"]
    ]


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((OBS / "rules.yml").read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"]]


def names_in(expr: str) -> set[str]:
    """The metric names an expression reads; every selector must be one of them (or a builtin)."""
    colon = set(COLON_NAME.findall(re.sub(r'"[^"]*"', '""', expr)))
    selected = set(SELECTOR.findall(expr)) - {"by", "without", "on", "ignoring", "group_left", "group_right"}
    assert selected <= colon | BUILTIN, (
        f"a selector of a name that is not tokenmill's: {selected - colon} in {expr}"
    )
    return colon


def kubernetes_job() -> dict[str, Any]:
    """The commented-out Kubernetes job of prometheus-fleet.yml, as Prometheus would read it uncommented."""
    text = (OBS / "prometheus-fleet.yml").read_text(encoding="utf-8")
    block = text.split("# BEGIN kubernetes job\n", 1)[1].split("  # END kubernetes job", 1)[0]
    lines = [line.replace("  # ", "  ", 1) if line.strip() else line for line in block.splitlines()]
    assert all(line.startswith("  ") for line in lines if line.strip()), block
    (job,) = yaml.safe_load("\n".join(lines))
    return job


# ---------------------------------------------------------------------------------- static checks
def test_dashboard_is_a_grafana_dashboard_on_a_datasource_variable() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    assert "__inputs" not in dash, "import-time inputs do not resolve when Grafana provisions the file"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("model_name", "instance"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DS
        assert variables[name]["multi"] and variables[name]["includeAll"]
    all_panels = [p for _, p in panels(dash)]
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    for p in all_panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == DS, f"{p['title']}: datasource {p.get('datasource')}"
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS, f"{p['title']} {t['refId']}"
            assert t["expr"].strip(), p["title"]
    # Every selector of every query is narrowed by the two variables, and its windows are Grafana's.
    for _, title, expr in queries(dash):
        for sel in re.findall(r"tokenmill:[A-Za-z0-9_:]*\{([^}]*)\}", expr):
            assert 'model_name=~"$model_name"' in sel and 'instance=~"$instance"' in sel, f"{title}: {sel}"
        windows = re.findall(r"\[([^\]]+)\]", expr)
        assert all(w == "$__rate_interval" for w in windows), f"{title}: windows {windows}"
        assert set(re.findall(r"\$\{?(\w+)", expr)) <= {"model_name", "instance", "__rate_interval"}, title


def test_dashboard_has_the_panels_an_operator_reads() -> None:
    exprs = "\n".join(e for _, _, e in queries(dashboard()))
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            want = f"histogram_quantile({q}, sum by (le) (rate(tokenmill:{hist}_bucket{{"
            assert want in exprs, want
    for name in (
        "generation_tokens_total", "request_success_total", "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket", "num_requests_running", "num_requests_waiting",
        "kv_cache_usage_perc", "prefix_cache_hits_total", "prefix_cache_queries_total",
        "queue_to_compute_ratio", "num_preemptions_total", "router_decisions_total",
        "kv_offload_loaded_blocks_total", "kv_transfer_read_blocks_total", "planner_decisions_total",
        "planner_target_workers", "engine_healthy",
    ):  # fmt: skip
        assert f"tokenmill:{name}{{" in exprs, name
    assert "sum by (finished_reason)" in exprs and "sum by (tier)" in exprs and "max by (worker)" in exprs


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    prov = OBS / "grafana" / "provisioning"
    (ds,) = yaml.safe_load((prov / "datasources" / "tokenmill-prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://localhost:9090" and ds["access"] == "proxy"
    scrape = yaml.safe_load((OBS / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == scrape  # what $__rate_interval is computed from
    (provider,) = yaml.safe_load((prov / "dashboards" / "tokenmill.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "${TOKENMILL_DASHBOARDS}"
    # README.md sets TOKENMILL_DASHBOARDS to the directory the dashboard is in.
    readme = (OBS / "README.md").read_text(encoding="utf-8")
    assert "TOKENMILL_DASHBOARDS=$PWD/deploy/observability/grafana" in readme
    assert "GF_PATHS_PROVISIONING=$PWD/deploy/observability/grafana/provisioning" in readme


def test_the_kubernetes_job_finds_the_fronts_of_the_manifests() -> None:
    job = kubernetes_job()
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "front-deployment.yaml").read_text()))
    (front,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = front["spec"]["template"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod"
    (selector,) = sd["selectors"]
    key, value = selector["label"].split("=")
    assert pod["metadata"]["labels"][key] == value
    relabel = {tuple(r["source_labels"]): r for r in job["relabel_configs"]}
    annotations = pod["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"]
        == relabel[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]["regex"]
    )
    (port,) = [p for c in pod["spec"]["containers"] for p in c["ports"]]
    assert port["name"] == relabel[("__meta_kubernetes_pod_container_port_name",)]["regex"]
    assert str(port["containerPort"]) == annotations["prometheus.io/port"]
    # The address rule, as Prometheus applies it (anchored), on the addresses pod discovery gives.
    rule = relabel[("__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port")]
    for address, want in (("10.1.2.3:8000", "10.1.2.3:8000"), ("[fd00::7]:8000", "[fd00::7]:8000")):
        m = re.fullmatch(rule["regex"], f"{address};{annotations['prometheus.io/port']}")
        assert m and rule["replacement"].replace("$1", m[1]).replace("$2", m[2]) == want
    assert (
        relabel[("__meta_kubernetes_pod_annotation_prometheus_io_path",)]["target_label"]
        == "__metrics_path__"
    )


def promtool(*args: str, cwd: Path = OBS) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_configs_and_rules() -> None:
    for args in (
        ("check", "config", "prometheus.yml"),
        ("check", "config", "prometheus-fleet.yml"),
        ("check", "rules", "rules.yml"),
        ("test", "rules", "rules.test.yml"),  # each alert fires, and not before its time
    ):
        r = promtool(*args)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}"


def test_promtool_reads_the_kubernetes_job_where_it_can(tmp_path: Path) -> None:
    """With the Kubernetes job uncommented the config is valid, where promtool knows Kubernetes discovery
    (Debian's build does not: it rejects the field, and that is the only error accepted)."""
    config = yaml.safe_load((OBS / "prometheus-fleet.yml").read_text())
    config["scrape_configs"].append(kubernetes_job())
    config["rule_files"] = [str(OBS / "rules.yml")]
    (tmp_path / "p.yml").write_text(yaml.safe_dump(config))
    r = promtool("check", "config", "p.yml", cwd=tmp_path)
    if r.returncode != 0 and "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        pytest.skip("this promtool is built without Kubernetes discovery (Debian's); the job was parsed only")
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_queried_name_is_declared_in_tokenmill() -> None:
    """A fast guard before the live tests: each family the dashboard and the alerts read (less the
    suffixes prometheus_client adds) is named in tokenmill's sources."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tokenmill").rglob("*.py"))
    wanted = {name for _, _, expr in queries(dashboard()) for name in names_in(expr)}
    wanted |= {name for r in rules() for name in names_in(r["expr"])}
    for name in wanted:
        assert name.startswith("tokenmill:"), name
        family = re.sub(r"_(total|bucket|sum|count)$", "", name.removeprefix("tokenmill:"))
        assert f'"{family}"' in source or f'"tokenmill:{family}"' in source, name


# ----------------------------------------------------------------------------- live: servers + Prometheus
def sample_names(text: str) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }


def scraped_value(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """{"single": base URL, "fleet": base URL}. Both admit 2 running and 2 queued requests, so a burst is
    turned away in part (request_failure_total)."""
    small = ["--max-num-seqs", "2", "--max-queued-requests", "2"]
    with ExitStack() as stack:
        single = stack.enter_context(running_server("--threads", "1", "--kv-offload", "host=64MB", *small))
        fleet = stack.enter_context(
            running_server(
                "--workers", "2..2", "--disaggregate", "1P1D", "--planner", "load",
                "--disagg-min-prefill-tokens", "32", *small,
            )
        )  # fmt: skip
        yield {"single": single.base_url, "fleet": fleet.base_url}


def instance(base: str) -> str:
    return base.removeprefix("http://")


def prometheus_config(servers: dict[str, str]) -> dict[str, Any]:
    """The shipped configs, made one: the single-server job at the engine server, the fleet's front job at
    the fleet, scraped and evaluated every second, with the shipped rules."""
    single = yaml.safe_load((OBS / "prometheus.yml").read_text())
    fleet = yaml.safe_load((OBS / "prometheus-fleet.yml").read_text())
    (job,) = single["scrape_configs"]
    (front,) = fleet["scrape_configs"]  # the Kubernetes job is commented out
    job["static_configs"][0]["targets"] = [instance(servers["single"])]
    front["static_configs"][0]["targets"] = [instance(servers["fleet"])]
    return {
        "global": {**single["global"], "scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(OBS / f) for f in single["rule_files"]],
        "scrape_configs": [job, front],
    }


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def prometheus(servers: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """A real Prometheus scraping both servers (its base URL), or None without the binary: the tests that
    query it skip then, the one reading /metrics runs."""
    exe = shutil.which("prometheus")
    if exe is None:
        yield None
        return
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(servers)))
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-3000:]}")
            try:
                return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, "prometheus to be ready")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def needs(prometheus: str | None) -> str:
    if prometheus is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus)")
    return prometheus


def query(prom: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n-> {r.status_code} {body}"
    return body["data"]


def vector(prom: str, expr: str) -> list[float]:
    data = query(prom, expr)
    assert data["resultType"] == "vector", data
    return [float(s["value"][1]) for s in data["result"]]


STORY = (
    "the lighthouse keeper counted ships every night while storms rolled over the northern cliffs, gulls "
    "circled the harbour where old fishermen mended their nets beside painted boats, and the baker's "
    "children ran along the quay with lanterns to meet the ferry coming home through the rain"
)


def prompt(i: int) -> str:
    """About 60 tokens, each prompt its own after the first few: the fleet prefills it on its prefill
    worker, and the decode worker reads the blocks (KV transfer). Each is sent more than once (prefix-cache
    hits)."""
    words = STORY.split()
    return f"Story {i}: " + " ".join(words[5 * i :] + words[: 5 * i])


PROMPTS = [prompt(i) for i in range(8)]


def complete(base: str, text: str, max_tokens: int) -> tuple[int, int]:
    """(HTTP status, completion tokens)."""
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code in (200, 429), r.text
    return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0


@pytest.fixture(scope="module")
def loaded(servers: dict[str, str], prometheus: str | None) -> dict[str, dict[str, int]]:
    """Load through both servers, in two rounds so Prometheus sees every histogram's series before and
    after it grows (a rate needs two samples); then wait until Prometheus holds the final counts, twice.
    Returns, per server, the completion tokens it answered with and the requests it turned away (429)."""
    sent = {name: {"tokens": 0, "rejected": 0} for name in servers}
    for name, base in servers.items():
        for text in PROMPTS[:2]:
            sent[name]["tokens"] += complete(base, text, 4)[1]
    for name, base in servers.items():
        if prometheus is None:
            break
        sel = f'tokenmill:time_to_first_token_seconds_count{{instance="{instance(base)}"}}'
        wait_for(
            lambda sel=sel: vector(prometheus, sel), 60, f"the {name} server's first requests in Prometheus"
        )
    with ThreadPoolExecutor(16) as pool:
        for name, base in servers.items():
            for _ in range(5):  # bursts of 8 at a server that takes 4: some are turned away (429)
                results = list(pool.map(lambda text, base=base: complete(base, text, 12), PROMPTS))
                sent[name]["tokens"] += sum(n for _, n in results)
                sent[name]["rejected"] += sum(code == 429 for code, _ in results)
                if sent[name]["rejected"]:
                    break
            assert sent[name]["rejected"], f"no burst at the {name} server was turned away"
    for name, base in servers.items():
        if prometheus is None:
            break
        want = scraped_value(
            httpx.get(f"{base}/metrics", timeout=10).text, "tokenmill:generation_tokens_total"
        )
        sel = f'tokenmill:generation_tokens_total{{instance="{instance(base)}"}}'
        wait_for(lambda sel=sel, want=want: vector(prometheus, sel) == [want], 60, f"{name}'s last scrape")
        # A series born in the burst (the 429s' counter) needs a second sample before it has a rate.
        every = f'{{__name__=~"tokenmill:.+", instance="{instance(base)}"}}[{RATE_INTERVAL}]'
        wait_for(
            lambda q=every: min(len(s["values"]) for s in query(prometheus, q)["result"]) >= 2,
            30,
            f"two samples of each {name} series",
        )
    return sent


@pytest.mark.slow
def test_every_name_queried_is_on_metrics(servers: dict[str, str], loaded: dict[str, dict[str, int]]) -> None:
    exported = set()
    for base in servers.values():
        exported |= sample_names(httpx.get(f"{base}/metrics", timeout=10).text)
    wanted: dict[str, str] = {}
    for _, title, expr in queries(dashboard()):
        wanted |= dict.fromkeys(names_in(expr), f"panel {title!r}")
    for r in rules():
        wanted |= dict.fromkeys(names_in(r["expr"]) - BUILTIN, f"alert {r['alert']}")
    missing = {name: where for name, where in wanted.items() if name not in exported}
    assert not missing, f"queried but exported by neither server: {missing}"


@pytest.mark.slow
def test_prometheus_scrapes_what_the_servers_say(
    servers: dict[str, str], prometheus: str | None, loaded: dict[str, dict[str, int]]
) -> None:
    prometheus = needs(prometheus)
    targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    health = {t["labels"]["instance"]: (t["labels"]["job"], t["health"]) for t in targets}
    assert health == {
        instance(servers["single"]): ("tokenmill", "up"),
        instance(servers["fleet"]): ("tokenmill-front", "up"),
    }, targets
    for name, base in servers.items():
        sel = f'instance="{instance(base)}"'
        assert vector(prometheus, f"up{{{sel}}}") == [1.0]
        (p90,) = vector(
            prometheus,
            "histogram_quantile(0.9, sum by (le) "
            f"(rate(tokenmill:time_to_first_token_seconds_bucket{{{sel}}}[{RATE_INTERVAL}])))",
        )
        assert math.isfinite(p90) and p90 > 0, (name, p90)
        # Every token the server answered with, counted once by it and seen by Prometheus.
        (tokens,) = vector(prometheus, f"tokenmill:generation_tokens_total{{{sel}}}")
        own = scraped_value(
            httpx.get(f"{base}/metrics", timeout=10).text, "tokenmill:generation_tokens_total"
        )
        assert tokens == own == loaded[name]["tokens"], (name, tokens, own, loaded[name])
        (rejected,) = vector(prometheus, f"sum(tokenmill:request_failure_total{{{sel}}})")
        assert rejected == loaded[name]["rejected"], (name, rejected, loaded[name])
    # The fleet routed, prefilled prompts on its prefill worker and moved their KV blocks.
    sel = f'instance="{instance(servers["fleet"])}"'
    for counter in ("router_decisions_total", "router_disaggregated_total", "kv_transfer_read_blocks_total"):
        (n,) = vector(prometheus, f"sum(tokenmill:{counter}{{{sel}}})")
        assert n > 0, counter


@pytest.mark.slow
def test_prometheus_evaluates_the_rules(prometheus: str | None, loaded: dict[str, dict[str, int]]) -> None:
    prometheus = needs(prometheus)

    def evaluated() -> list[dict[str, Any]] | None:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        got = [r for g in groups for r in g["rules"]]
        done = got and all(not r["lastEvaluation"].startswith("0001") for r in got)
        return got if done else None

    got = wait_for(evaluated, 30, "every rule evaluated")
    assert sorted(r["name"] for r in got) == sorted(r["alert"] for r in rules())
    for r in got:
        assert r["health"] == "ok", r
    # The servers answer: neither the scrape nor the engine alert is even pending.
    assert not [a for r in got for a in r["alerts"] if r["name"] in ("TokenmillDown", "TokenmillEngineDown")]


@pytest.mark.slow
def test_the_dashboard_variables_find_the_servers(
    servers: dict[str, str], prometheus: str | None, loaded: dict[str, dict[str, int]]
) -> None:
    """`label_values(metric{selector}, label)`, asked as Grafana's Prometheus data source does."""
    prometheus = needs(prometheus)
    variables = {v["name"]: v["query"] for v in dashboard()["templating"]["list"] if v["type"] == "query"}

    def label_values(q: str) -> set[str]:
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", q)
        assert m, q
        match = m[1].replace("$model_name", MODEL)
        r = httpx.get(f"{prometheus}/api/v1/series", params={"match[]": match}, timeout=10).json()
        return {s[m[2]] for s in r["data"] if m[2] in s}

    assert label_values(variables["model_name"]) == {MODEL}
    assert label_values(variables["instance"]) == {instance(b) for b in servers.values()}


@pytest.mark.slow
def test_every_panel_query_answers(
    servers: dict[str, str], prometheus: str | None, loaded: dict[str, dict[str, int]]
) -> None:
    """Each panel's expression, its variables set as Grafana would for one server, answers without error
    for both servers, and with data for the server that has the panel's features (the fleet's rows on the
    fleet, the offload row on the offload server, the rest on both); traffic and latency as numbers."""
    prometheus = needs(prometheus)
    failed, empty = [], []
    checked = 0
    for row, title, expr in queries(dashboard()):
        for name, base in servers.items():
            q = (
                expr.replace("$model_name", MODEL)
                .replace("$instance", instance(base))
                .replace("$__rate_interval", RATE_INTERVAL)
            )
            assert "$" not in q, q
            r = httpx.get(f"{prometheus}/api/v1/query", params={"query": q}, timeout=30).json()
            checked += 1
            if r["status"] != "success":
                failed.append(f"{row} / {title}: {q}\n  -> {r.get('error')}")
                continue
            applies = not (
                (row.startswith(FLEET_ROWS) and name != "fleet")
                or (row.startswith(OFFLOAD_ROWS) and name != "single")
            )
            if applies and not r["data"]["result"]:
                empty.append(f"{row} / {title} on the {name} server: {q}")
            # Traffic and latency had load in the window: numbers, not NaN (a rate of nothing).
            values = [float(s["value"][1]) for s in r["data"]["result"]]
            if row in ("Overview", "Latency") and not all(math.isfinite(v) for v in values):
                empty.append(f"{row} / {title} on the {name} server: {values} from {q}")
    assert not failed, "panel queries Prometheus refused:\n" + "\n".join(failed)
    assert not empty, "panels without data (or NaN) after load:\n" + "\n".join(empty)
    assert checked > 100
