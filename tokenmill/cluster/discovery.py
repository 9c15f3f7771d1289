"""Where the workers are: a set of engine addresses, looked up again every few seconds, that the router
makes its fleet match (workers that appear join, workers that vanish leave).

- `file`: a text file of tcp:// addresses, one a line (`#` comments), re-read when it changes;
- `dns`: the A/AAAA records of a name, e.g. a Kubernetes headless Service (one record per ready pod);
- `k8s`: the ready endpoints in the EndpointSlices of a Service, through the official `kubernetes`
  client (in-cluster config, or ~/.kube/config elsewhere). Needs get/list on endpointslices.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from tokenmill.extras import require


class Discovery(ABC):
    @abstractmethod
    def addresses(self) -> set[str]:
        """The engine addresses (tcp://host:port) of the workers that should be in the fleet now."""


class FileDiscovery(Discovery):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def addresses(self) -> set[str]:
        out = set()
        for line in self.path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                if not line.startswith(("tcp://", "ipc://")):
                    raise ValueError(f"{self.path}: {line!r} is not a tcp:// or ipc:// address")
                out.add(line)
        return out


class DnsDiscovery(Discovery):
    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port

    def addresses(self) -> set[str]:
        try:
            infos = socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return set()  # no ready pod has a record yet
        out = set()
        for family, _, _, _, sockaddr in infos:
            host = sockaddr[0]
            out.add(
                f"tcp://[{host}]:{self.port}" if family == socket.AF_INET6 else f"tcp://{host}:{self.port}"
            )
        return out


class EndpointSliceDiscovery(Discovery):
    """Ready endpoints of a Service, from every EndpointSlice labelled with its name."""

    def __init__(
        self, service: str, namespace: str | None = None, port_name: str = "engine", api: Any = None
    ):
        self.service, self.port_name = service, port_name
        self.namespace = namespace or _current_namespace()
        self.api = api if api is not None else _discovery_api()

    def addresses(self) -> set[str]:
        slices = self.api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.service}"
        )
        out = set()
        for sl in slices.items:
            ports = [p.port for p in (sl.ports or []) if p.name in (self.port_name, None)]
            if not ports:
                continue
            for ep in sl.endpoints or []:
                cond = ep.conditions
                # ready unset means ready; a terminating endpoint is never ready (it drains).
                if cond is not None and cond.ready is False:
                    continue
                for addr in ep.addresses or []:
                    host = f"[{addr}]" if sl.address_type == "IPv6" else addr
                    out.add(f"tcp://{host}:{ports[0]}")
        return out


def _current_namespace() -> str:
    p = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return p.read_text().strip() if p.exists() else "default"


def _discovery_api() -> Any:
    require("k8s", "serve --discovery k8s")
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.DiscoveryV1Api()


def make_discovery(kind: str, target: str, port: int) -> Discovery:
    if kind == "file":
        return FileDiscovery(target)
    if kind == "dns":
        return DnsDiscovery(target, port)
    if kind == "k8s":
        return EndpointSliceDiscovery(target)
    raise ValueError(f"unknown discovery {kind!r}; available: file, dns, k8s")
