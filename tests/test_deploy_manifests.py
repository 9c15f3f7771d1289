"""The Kubernetes manifests under deploy/kubernetes, checked offline: no cluster runs on these machines.

Every document is validated against the Kubernetes API's JSON schemas (kubernetes-validate, strict:
unknown fields are errors), and the pieces are checked to fit together: selectors match pod labels,
probes and scrape annotations point at ports and paths the containers serve, the HPA targets the
StatefulSet and a metric the front exports, the flags in the container args exist. The EndpointSlice
discovery the front uses is checked against a stand-in for the Kubernetes API (the one fake here).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import yaml

from tokenmill.cluster.discovery import DnsDiscovery, EndpointSliceDiscovery, FileDiscovery

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
