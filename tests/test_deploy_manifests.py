"""The Kubernetes manifests under deploy/kubernetes, checked offline: no cluster runs on these machines.

Every document is validated against the Kubernetes API's JSON schemas (kubernetes-validate, strict:
unknown fields are errors), and the pieces are checked to fit together: selectors match pod labels,
probes and scrape annotations point at ports and paths the containers serve, the HPA targets the
StatefulSet and a metric the front exports, the flags in the container args exist. The EndpointSlice
discovery the front uses is checked against a stand-in for the Kubernetes API (the one fake here).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import yaml

from tokenmill.cluster.discovery import DnsDiscovery, EndpointSliceDiscovery, FileDiscovery
from tokenmill.paths import default_cache_dir

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="dev dependency kubernetes-validate")

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"


def documents() -> list[dict]:
    kustomization = yaml.safe_load((ROOT / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((ROOT / name).read_text()) if d)
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


def one(kind: str, name: str) -> dict:
    (doc,) = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    return doc


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_kubernetes(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_file_in_the_folder_is_in_the_kustomization() -> None:
    listed = set(yaml.safe_load((ROOT / "kustomization.yaml").read_text())["resources"])
    assert {p.name for p in ROOT.glob("*.yaml")} - {"kustomization.yaml"} == listed


def test_services_select_the_pods_and_name_their_ports() -> None:
    for svc in by_kind("Service"):
        sel = svc["spec"]["selector"]
        owners = [
            w for w in by_kind("Deployment") + by_kind("StatefulSet")
            if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(owners) == 1, svc["metadata"]["name"]
        named = {p["name"] for c in owners[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named
    engines = one("Service", "tokenmill-engines")
    assert engines["spec"]["clusterIP"] == "None", "headless: one record per pod, routing is ours"
    assert one("StatefulSet", "tokenmill-engine")["spec"]["serviceName"] == "tokenmill-engines"


def _args(workload: dict) -> list[str]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c["command"] + c["args"]


@pytest.mark.parametrize(
    ("kind", "name"), [("StatefulSet", "tokenmill-engine"), ("Deployment", "tokenmill-front")]
)
def test_container_commands_are_real_tokenmill_flags(kind: str, name: str) -> None:
    cmd = _args(one(kind, name))
    assert cmd[0] == "tokenmill"
    # serve and worker list their less common flags only under --help-all.
    help_flag = "--help-all" if cmd[1] in {"serve", "worker"} else "--help"
    help_text = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", cmd[1], help_flag],
        capture_output=True, text=True, env={"COLUMNS": "300", "PATH": ""}, timeout=120,
    ).stdout  # fmt: skip
    for arg in cmd[2:]:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            assert flag in help_text, f"{name}: {flag} is not a flag of `tokenmill {cmd[1]}`"


def test_probes_and_scraping_use_what_the_containers_serve() -> None:
    front = one("Deployment", "tokenmill-front")
    (c,) = front["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v1/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v1/health/live"
    ann = front["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == "/metrics" and ann["prometheus.io/port"] == "8000"
    assert "--port=8000" in c["args"]
    (e,) = one("StatefulSet", "tokenmill-engine")["spec"]["template"]["spec"]["containers"]
    assert e["readinessProbe"]["exec"]["command"][:2] == ["tokenmill", "probe"]
    assert "--listen=tcp://0.0.0.0:7100" in e["args"]


@pytest.mark.parametrize(
    ("kind", "name"), [("StatefulSet", "tokenmill-engine"), ("Deployment", "tokenmill-front")]
)
def test_workers_and_front_share_the_worker_secret(kind: str, name: str) -> None:
    """Workers listen on 0.0.0.0: without the shared secret anyone reaching a pod could use its engine
    (issue 51). Both sides read the same Secret from a mounted file (not an env value: no secret in the
    pod spec or `kubectl describe`)."""
    spec = one(kind, name)["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    path = env["TOKENMILL_WORKER_SECRET_FILE"]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "tokenmill-worker-secret"
    assert path.rsplit("/", 1)[1] == "secret"  # the key the README's `kubectl create secret` makes
    assert "TOKENMILL_WORKER_SECRET" not in env


def test_front_may_read_endpointslices_and_hpa_scales_the_workers() -> None:
    role = one("Role", "tokenmill-endpointslice-reader")
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and {"list", "watch"} <= set(rule["verbs"])
    binding = one("RoleBinding", "tokenmill-front-reads-endpointslices")
    sa = one("Deployment", "tokenmill-front")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"][0]["name"] == sa and binding["roleRef"]["name"] == role["metadata"]["name"]
    hpa = one("HorizontalPodAutoscaler", "tokenmill-engine")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "tokenmill-engine",
    }
    (metric,) = hpa["spec"]["metrics"]
    # The adapter exposes Prometheus' tokenmill:queue_to_compute_ratio with ':' as '_'.
    assert metric["object"]["metric"]["name"] == "tokenmill_queue_to_compute_ratio"
    assert metric["object"]["describedObject"]["name"] == "tokenmill-front"


def _slice(address_type: str, port: int, endpoints: list[tuple[str, bool | None]]) -> NS:
    return NS(
        address_type=address_type,
        ports=[NS(name="engine", port=port)],
        endpoints=[NS(addresses=[a], conditions=NS(ready=r)) for a, r in endpoints],
    )


class FakeDiscoveryApi:
    """Stands in for kubernetes.client.DiscoveryV1Api: no cluster can run here."""

    def __init__(self, slices: list[NS]) -> None:
        self.slices, self.calls = slices, []

    def list_namespaced_endpoint_slice(self, namespace: str, label_selector: str) -> NS:
        self.calls.append((namespace, label_selector))
        return NS(items=self.slices)


def test_endpointslice_discovery_takes_ready_endpoints_of_every_slice() -> None:
    api = FakeDiscoveryApi(
        [
            _slice("IPv4", 7100, [("10.0.0.1", True), ("10.0.0.2", None), ("10.0.0.3", False)]),
            _slice("IPv6", 7100, [("fd00::4", True)]),
        ]
    )
    d = EndpointSliceDiscovery("tokenmill-engines", "prod", api=api)
    assert d.addresses() == {"tcp://10.0.0.1:7100", "tcp://10.0.0.2:7100", "tcp://[fd00::4]:7100"}
    assert api.calls == [("prod", "kubernetes.io/service-name=tokenmill-engines")]


def test_dns_and_file_discovery(tmp_path: Path) -> None:
    assert DnsDiscovery("localhost", 7100).addresses() & {"tcp://127.0.0.1:7100", "tcp://[::1]:7100"}
    assert DnsDiscovery("no-such-host.invalid", 7100).addresses() == set()
    f = tmp_path / "workers.txt"
    f.write_text("# the fleet\ntcp://10.0.0.1:7100\n\ntcp://10.0.0.2:7100  # second\n")
    assert FileDiscovery(f).addresses() == {"tcp://10.0.0.1:7100", "tcp://10.0.0.2:7100"}
    f.write_text("10.0.0.1:7100\n")
    with pytest.raises(ValueError, match="not a tcp://"):
        FileDiscovery(f).addresses()


WORKLOADS = [("StatefulSet", "tokenmill-engine"), ("Deployment", "tokenmill-front")]


def _container(kind: str, name: str) -> tuple[dict, dict]:
    spec = one(kind, name)["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_every_variable_in_the_args_is_defined_and_threads_follow_the_cpu_request(
    kind: str, name: str
) -> None:
    """Kubernetes expands $(VAR) in args only for variables the container defines (others stay literal,
    and the flag would get the text "$(VAR)")."""
    _, c = _container(kind, name)
    env = {e["name"]: e for e in c["env"]}
    for arg in c["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"{name}: {arg} uses ${var} that the container does not define"
    if "--threads=$(CPU_REQUEST)" in c["args"]:
        ref = env["CPU_REQUEST"]["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "requests.cpu" and ref["containerName"] == c["name"]
        assert ref["divisor"] == "1" and c["resources"]["requests"]["cpu"]


def test_engines_take_the_cores_they_request_and_tell_readers_their_pod_address() -> None:
    _, c = _container("StatefulSet", "tokenmill-engine")
    assert "--threads=$(CPU_REQUEST)" in c["args"]
    env = {e["name"]: e for e in c["env"]}
    assert "--kv-transfer-host=$(POD_IP)" in c["args"]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = next(a for a in c["args"] if a.startswith("--kv-transfer-port="))
    assert {"name": "kv-transfer", "containerPort": int(port.split("=")[1])} in c["ports"]


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_a_first_start_is_never_killed_by_liveness(kind: str, name: str) -> None:
    """A first start on a node builds the kernels for its CPU: minutes. A startup probe holds liveness
    off until the server has answered once, however long that takes within its budget."""
    _, c = _container(kind, name)
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= (600 if kind == "StatefulSet" else 300)
    assert "initialDelaySeconds" not in c["livenessProbe"]
    live = c["livenessProbe"]  # the startup probe asks what liveness asks, with its own patience
    if "httpGet" in live:
        assert start["httpGet"] == live["httpGet"]
    else:
        assert start["exec"]["command"][:3] == live["exec"]["command"][:3]


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_pods_run_unprivileged_on_a_read_only_image(kind: str, name: str) -> None:
    spec, c = _container(kind, name)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] and pod["runAsUser"] != 0 and pod["seccompProfile"]["type"] == "RuntimeDefault"
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # What the process writes lands on volumes: /tmp, and for engines the cache (kernels built for the
    # node's CPU, dequantized weights) and /dev/shm (the KV cache shared for transfers) in memory.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    if kind == "StatefulSet":
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert "emptyDir" in volumes[mounts[env["XDG_CACHE_HOME"]]]
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def _selects(selector: dict, kind: str, name: str) -> bool:
    labels = one(kind, name)["spec"]["template"]["metadata"]["labels"]
    return selector["matchLabels"].items() <= labels.items()


def test_only_fronts_reach_the_engine_ports_and_only_engines_their_transfers() -> None:
    engine = one("NetworkPolicy", "tokenmill-engine")["spec"]
    assert _selects(engine["podSelector"], "StatefulSet", "tokenmill-engine")
    assert engine["policyTypes"] == ["Ingress"]
    _, c = _container("StatefulSet", "tokenmill-engine")
    allowed: dict[str, set[str]] = {}
    for rule in engine["ingress"]:
        (source,) = rule["from"]
        who = next(n for k, n in WORKLOADS if _selects(source["podSelector"], k, n))
        for p in rule["ports"]:
            allowed.setdefault(p["port"], set()).add(who)
    assert allowed == {
        "engine": {"tokenmill-front"}, "kv-events": {"tokenmill-front"}, "kv-replay": {"tokenmill-front"},
        "kv-transfer": {"tokenmill-engine"},
    }  # fmt: skip
    assert set(allowed) == {p["name"] for p in c["ports"]}  # every port the engine serves is covered
    front = one("NetworkPolicy", "tokenmill-front")["spec"]
    assert _selects(front["podSelector"], "Deployment", "tokenmill-front")
    assert [p["port"] for r in front["ingress"] for p in r["ports"]] == ["http"]


def test_disruption_budgets_keep_a_front_and_all_but_one_engine() -> None:
    engine = one("PodDisruptionBudget", "tokenmill-engine")["spec"]
    assert _selects(engine["selector"], "StatefulSet", "tokenmill-engine") and engine["maxUnavailable"] == 1
    front = one("PodDisruptionBudget", "tokenmill-front")["spec"]
    assert _selects(front["selector"], "Deployment", "tokenmill-front") and front["minAvailable"] == 1
    assert one("Deployment", "tokenmill-front")["spec"]["replicas"] > front["minAvailable"]


# -- the container image recipe ---------------------------------------------------------------------------
DOCKERFILE = ROOT.parent / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, its text, continuation lines joined) of deploy/Dockerfile."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_image_recipe_fits_the_repository_and_the_manifests() -> None:
    """The image cannot be built here (no container runtime): what it relies on is checked instead."""
    steps = _instructions()
    repo = ROOT.parent.parent
    for word, rest in steps:
        if word == "COPY":
            *sources, _ = rest.split()
            assert all((repo / s).exists() for s in sources), rest
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(r for w, r in steps if w == "ENV")))
    run = " ".join(r for w, r in steps if w == "RUN")
    # The model and the kernels are made at build time, with commands tokenmill has, into the cache the
    # engines' seed-cache init container copies from.
    for command in ("tokenmill models pull", "tokenmill kernels --all"):
        assert command in run
    assert "torch==2.13.0" in run  # the version pyproject.toml pins
    assert '"torch==2.13.0"' in (repo / "pyproject.toml").read_text()
    spec = one("StatefulSet", "tokenmill-engine")["spec"]["template"]["spec"]
    (seed,) = spec["initContainers"]
    assert seed["command"][:3] == ["cp", "-a", env["XDG_CACHE_HOME"] + "/."]
    # Its user is the one the pods run as (not root); its ports are those the containers name.
    user = next(r for w, r in steps if w == "USER")
    for kind, name in WORKLOADS:
        assert one(kind, name)["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user)
    exposed = {int(p) for w, r in steps if w == "EXPOSE" for p in r.split()}
    served = {
        p["containerPort"] for k, n in WORKLOADS for p in _container(k, n)[1]["ports"]
    }  # fmt: skip
    assert exposed == served
    entry = json.loads(next(r for w, r in steps if w == "ENTRYPOINT"))
    assert entry == ["tokenmill"]


# -- the Helm chart ---------------------------------------------------------------------------------------
CHART = ROOT.parent / "helm" / "tokenmill"
HELM = shutil.which("helm") or str(default_cache_dir() / "helm" / "helm")
needs_helm = pytest.mark.skipif(
    not Path(HELM).is_file(), reason="helm is fetched by `make install` (tests/get_helm.sh) and was not"
)


def helm_template(*values: str) -> list[dict]:
    args = [a for v in values for a in ("--set", v)]
    out = subprocess.run(
        [HELM, "template", "tokenmill", str(CHART), *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _key(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True)


@needs_helm
def test_the_chart_with_its_defaults_renders_these_manifests() -> None:
    """One fleet, two ways to install it: `helm install` and `kubectl apply -k` give the same objects."""
    assert sorted(map(_key, helm_template())) == sorted(map(_key, documents()))
    lint = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


@needs_helm
def test_the_charts_values_render_valid_fitting_manifests() -> None:
    docs = helm_template(
        "engine.replicas=3", "engine.resources.requests.cpu=4", "engine.startupBudgetSeconds=1200",
        "front.router=round-robin", "model=/models/my-model", "autoscaling.enabled=false",
        "networkPolicy.enabled=false", "podDisruptionBudget.enabled=false", "workerSecret.create=true",
        "workerSecret.name=fleet-key",
    )  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = [d["kind"] for d in docs]
    for off in ("HorizontalPodAutoscaler", "NetworkPolicy", "PodDisruptionBudget"):
        assert off not in kinds
    (engine,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (front,) = [d for d in docs if d["kind"] == "Deployment"]
    assert engine["spec"]["replicas"] == 3
    (c,) = engine["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["requests"]["cpu"] == 4 and "--threads=$(CPU_REQUEST)" in c["args"]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 1200
    assert "--model=/models/my-model" in c["args"]
    (f,) = front["spec"]["template"]["spec"]["containers"]
    assert "--router=round-robin" in f["args"] and "--model=/models/my-model" in f["args"]
    # The Secret the chart makes is the one both workloads mount: a 64-character key.
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "fleet-key" and len(base64.b64decode(secret["data"]["secret"])) == 64
    for workload in (engine, front):
        vols = workload["spec"]["template"]["spec"]["volumes"]
        assert {"name": "worker-secret", "secret": {"secretName": "fleet-key", "defaultMode": 0o400}} in vols
