"""What carries out the planner's decisions: the fleet's own launcher (local processes or Ray actors:
the router starts and drains them) or Kubernetes (the scale subresource of the workers' StatefulSet or
Deployment, through the official client; the cluster's controller starts and stops the pods)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from tokenmill.cluster.router import in_pool
from tokenmill.extras import require

log = logging.getLogger(__name__)


class ScaleConnector(Protocol):
    def counts(self) -> tuple[int, int, int]:
        """Workers serving, starting, draining."""
        ...

    async def scale_to(self, target: int) -> None: ...


class FleetConnector:
    """Workers this process launches: LaunchingRouter (local processes) or RayRouter (Ray actors), all
    of them or one pool of a disaggregated fleet ("prefill" or "decode"). Scaling down drains: the
    worker gets no new requests, finishes its own, then stops."""

    def __init__(
        self,
        router: Any,  # noqa: ANN401
        drain_timeout_s: float = 600.0,
        pool: str | None = None,
    ) -> None:
        self.router = router
        self.drain_timeout_s = drain_timeout_s
        self.pool = pool
        self._drains: set[asyncio.Task] = set()

    def counts(self) -> tuple[int, int, int]:
        return self.router.fleet_counts(self.pool)

    async def scale_to(self, target: int) -> None:
        serving, starting, _ = self.counts()
        current = serving + starting
        for _ in range(target - current):
            await (self.router.add_worker(self.pool) if self.pool else self.router.add_worker())
        if target < current:
            live = [w for w in self.router.workers if not w.retired and w.serving() and in_pool(w, self.pool)]
            # The least busy workers go first: the least to wait for, the least KV lost.
            for w in sorted(live, key=lambda w: (len(w.active), -w.slot))[: current - target]:
                task = asyncio.get_running_loop().create_task(
                    self.router.remove_worker(w, self.drain_timeout_s)
                )
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)


class KubernetesConnector:
    """Sets `spec.replicas` of the workers' StatefulSet (or Deployment) through its scale subresource.

    No cluster runs here: tests check the request this sends against a stand-in for the client's
    AppsV1Api. Scale-down drains through the pod's termination: the controller sends SIGTERM, the
    worker finishes its requests within terminationGracePeriodSeconds (deploy/kubernetes)."""

    def __init__(
        self,
        name: str,
        namespace: str = "default",
        kind: str = "StatefulSet",
        api: Any = None,  # noqa: ANN401 - kubernetes.client.AppsV1Api, or a stand-in
        router: Any = None,  # noqa: ANN401 - to count serving workers (discovery follows the pods)
    ) -> None:
        if kind not in ("StatefulSet", "Deployment"):
            raise ValueError(f"kind must be StatefulSet or Deployment, got {kind!r}")
        if api is None:
            require("k8s", "the planner's Kubernetes connector")
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.AppsV1Api()
        self.name, self.namespace, self.kind, self.api, self.router = name, namespace, kind, api, router

    def _read(self) -> int:
        read = (
            self.api.read_namespaced_stateful_set_scale
            if self.kind == "StatefulSet"
            else self.api.read_namespaced_deployment_scale
        )
        return int(read(self.name, self.namespace).spec.replicas or 0)

    def counts(self) -> tuple[int, int, int]:
        replicas = self._read()
        if self.router is None:
            return replicas, 0, 0
        serving, _, draining = self.router.fleet_counts()
        return serving, max(replicas - serving, 0), draining

    async def scale_to(self, target: int) -> None:
        patch = (
            self.api.patch_namespaced_stateful_set_scale
            if self.kind == "StatefulSet"
            else self.api.patch_namespaced_deployment_scale
        )
        body = {"spec": {"replicas": int(target)}}
        await asyncio.to_thread(patch, self.name, self.namespace, body)
        log.info("planner: %s/%s %s scaled to %d", self.namespace, self.name, self.kind, target)
