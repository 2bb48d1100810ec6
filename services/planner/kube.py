"""`--scale-mode kubernetes`: the planner's decision as the two Deployments' replica counts.

One merge-patch of each Deployment's `scale` subresource (`PATCH .../deployments/NAME/scale`), with the pod's
service-account token; the chart's Role grants exactly `get` and `patch` on `deployments/scale` for those two
names, nothing else. A patch is sent only when the count changes from what this planner last set (or read).
"""

from __future__ import annotations

import argparse
import logging
import os

import httpx

from services.runtime.http import DeadlineClient
from services.telemetry import metrics

log = logging.getLogger("rackserve.planner")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubeScaler:
    def __init__(
        self,
        api: str,
        namespace: str,
        deployments: dict[str, str],
        token: str,
        verify: str | bool,
        timeout_s: float,
    ) -> None:
        self.namespace = namespace
        self.deployments = deployments  # pool -> Deployment name
        self.client = DeadlineClient(
            timeout_s,
            base_url=api.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"} if token else {},
            verify=verify,
        )
        self.last: dict[str, int] = {}

    @classmethod
    def in_cluster(cls, args: argparse.Namespace) -> KubeScaler:
        def read(name: str) -> str:
            path = os.path.join(SA_DIR, name)
            try:
                with open(path) as f:
                    return f.read().strip()
            except OSError as e:
                raise ValueError(f"--scale-mode kubernetes: cannot read {path}: {e.strerror}") from e

        namespace = args.kube_namespace or read("namespace")
        ca = os.path.join(SA_DIR, "ca.crt")
        return cls(
            args.kube_api,
            namespace,
            {"prefill": args.kube_prefill_deployment, "decode": args.kube_decode_deployment},
            read("token"),
            ca if os.path.exists(ca) else True,
            args.kube_timeout_s,
        )

    def _path(self, pool: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployments[pool]}/scale"

    async def replicas(self, pool: str) -> int:
        """The Deployment's replicas; httpx.HTTPError or ValueError when they cannot be read."""
        r = await self.client.get(self._path(pool))
        r.raise_for_status()
        return int(r.json().get("spec", {}).get("replicas", 0))

    async def apply(self, desired: tuple[int, int]) -> None:
        for pool, n in zip(("prefill", "decode"), desired, strict=True):
            try:
                if pool not in self.last:
                    self.last[pool] = await self.replicas(pool)
                if self.last[pool] == n:
                    continue
                r = await self.client.patch(
                    self._path(pool),
                    content=f'{{"spec":{{"replicas":{int(n)}}}}}',
                    headers={"Content-Type": "application/merge-patch+json"},
                )
                r.raise_for_status()
                log.info("planner: %s %s replicas %d -> %d", pool, self.deployments[pool], self.last[pool], n)
                self.last[pool] = n
            except (httpx.HTTPError, ValueError) as e:
                metrics.PLANNER_SCALE_ERRORS.labels(pool).inc()
                self.last.pop(pool, None)
                log.warning("planner: scaling %s to %d failed: %s", pool, n, e)

    async def close(self) -> None:
        await self.client.aclose()
