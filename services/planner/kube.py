"""`--scale-mode kubernetes`: the planner's decision as the two Deployments' replica counts.

One merge-patch of each Deployment's `scale` subresource (`PATCH .../deployments/NAME/scale`), with the pod's
service-account token (re-read from its file every minute, as client-go does: the kubelet rotates a projected
token, and one read at start is refused once it expires, about an hour on); the chart's Role grants exactly `get`
and `patch` on `deployments/scale` for those two names, nothing else. A patch is sent only when the count changes
from what this planner last set or read; the planner reads both every decision (its base is what the Deployments
are set to), so a PATCH that failed, or a count set by hand since, is set again by the next step.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Generator

import httpx

from services.runtime.http import DeadlineClient
from services.telemetry import metrics

log = logging.getLogger("rackserve.planner")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_REREAD_S = 60.0


class FileToken(httpx.Auth):
    """A Bearer token from a file, read again once `reread_s` have passed since the last read. A read that fails
    keeps the last token (the file is replaced atomically, but a reader can still miss it)."""

    def __init__(self, path: str, reread_s: float = TOKEN_REREAD_S) -> None:
        self.path = path
        self.reread_s = reread_s
        self._token = self._read()
        self._read_at = time.monotonic()

    def _read(self) -> str:
        with open(self.path) as f:
            return f.read().strip()

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if time.monotonic() - self._read_at >= self.reread_s:
            try:
                self._token = self._read()
            except OSError as e:
                log.warning("planner: cannot re-read %s (%s); keeping the last token", self.path, e.strerror)
            self._read_at = time.monotonic()
        request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


class KubeScaler:
    def __init__(
        self,
        api: str,
        namespace: str,
        deployments: dict[str, str],
        token: str | FileToken,
        verify: str | bool,
        timeout_s: float,
    ) -> None:
        """`token`: a fixed Bearer token ("" for none), or a FileToken read again as it rotates."""
        self.namespace = namespace
        self.deployments = deployments  # pool -> Deployment name
        self.client = DeadlineClient(
            timeout_s,
            base_url=api.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"} if isinstance(token, str) and token else {},
            auth=token if isinstance(token, FileToken) else None,
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
        read("token")  # a missing token is an error at start
        return cls(
            args.kube_api,
            namespace,
            {"prefill": args.kube_prefill_deployment, "decode": args.kube_decode_deployment},
            FileToken(os.path.join(SA_DIR, "token")),
            ca if os.path.exists(ca) else True,
            args.kube_timeout_s,
        )

    def _path(self, pool: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployments[pool]}/scale"

    async def replicas(self, pool: str) -> int:
        """The Deployment's replicas, also what the next `apply` compares with; httpx.HTTPError or ValueError
        when they cannot be read."""
        r = await self.client.get(self._path(pool))
        r.raise_for_status()
        self.last[pool] = int(r.json().get("spec", {}).get("replicas", 0))
        return self.last[pool]

    async def read(self, pool: str) -> int | None:
        """`replicas`, with a failed read logged and counted as a failed call (a scale error); None then."""
        try:
            return await self.replicas(pool)
        except (httpx.HTTPError, ValueError) as e:
            metrics.PLANNER_SCALE_ERRORS.labels(pool).inc()
            log.warning("planner: reading %s's replicas failed: %s", pool, e)
            return None

    async def apply(self, desired: tuple[int, int]) -> None:
        """Set both Deployments' replicas. Steps down go first, and a step down that fails holds back the steps
        up: a rebalance (one pool down, the other up) never leaves more pods than the budget, whichever PATCH
        the API server refuses. The next decision, stepping from the Deployments' replicas, sends them again."""
        wanted = dict(zip(("prefill", "decode"), desired, strict=True))
        for pool in wanted:
            if pool not in self.last:
                await self.read(pool)
        if any(pool not in self.last for pool in wanted):
            return
        down = [p for p, n in wanted.items() if n < self.last[p]]
        up = [p for p, n in wanted.items() if n > self.last[p]]
        for pool in down:
            if not await self._patch(pool, wanted[pool]) and up:
                log.warning(
                    "planner: not scaling %s up while %s's step down is not set", " and ".join(up), pool
                )
                return
        for pool in up:
            await self._patch(pool, wanted[pool])

    async def _patch(self, pool: str, n: int) -> bool:
        try:
            r = await self.client.patch(
                self._path(pool),
                content=f'{{"spec":{{"replicas":{int(n)}}}}}',
                headers={"Content-Type": "application/merge-patch+json"},
            )
            r.raise_for_status()
        except (httpx.HTTPError, ValueError) as e:
            metrics.PLANNER_SCALE_ERRORS.labels(pool).inc()
            self.last.pop(pool, None)
            log.warning("planner: scaling %s to %d failed: %s", pool, n, e)
            return False
        log.info("planner: %s %s replicas %d -> %d", pool, self.deployments[pool], self.last[pool], n)
        self.last[pool] = n
        return True

    async def close(self) -> None:
        await self.client.aclose()
