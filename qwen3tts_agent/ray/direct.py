"""Serve's direct ingress: each engine replica serves its own port, with no Serve proxy in the way.

With `RAY_SERVE_ENABLE_DIRECT_INGRESS=1` in the environment of a Ray cluster's processes (read once, when
each Serve process starts: `serve-ray --direct-ingress` sets it for the Ray instance it starts; `ray start`
needs it exported on every node), every replica of an application's ingress deployment starts an HTTP
server of its own on a port the Serve controller hands out (`RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT` to
`..._MAX_HTTP_PORT`, 30000-31000 by default), bound to the host of Serve's `http_options`. The proxy still
runs (on the head node only) and still routes. A client on a replica's port talks to that replica's app
directly: no Ray call between the proxy and the replica for every WebSocket message, but also no
`router.LoadAwareRouter` (whoever connects picks the replica) and no Serve-side queue in front of it.

Which replica listens where is known only to the controller: `direct_ingress` reads it (Ray 2.60's private
API, wrapped here and nowhere else), for `serve-ray`'s start-up lines and the app's `GET /v1/replicas`.
docs/ray.md ("Direct ingress") says when to use it and what an operator must add (a load balancer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
# How long a stopping replica keeps its port open at least, so load balancers see it draining (Serve's
# `/-/healthz` answers 503 DRAINING meanwhile) before it goes: Ray's default is 30 s. A Ray instance that
# `serve-ray` starts gets LOCAL_DRAINING_PERIOD_S unless the variable is set (docs/ray.md).
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
LOCAL_DRAINING_PERIOD_S = 5.0
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def enabled_in_environment() -> bool:
    """Whether this process's environment asks for direct ingress (as Serve's own processes read it)."""
    return os.environ.get(DIRECT_INGRESS_ENV, "0") == "1"


@dataclass(frozen=True)
class DirectEndpoint:
    """One replica's own server: `ws` for `/v1/stream` (append the path), `http` for the HTTP routes."""

    replica: str  # the id in the `x-qwen3tts-replica` header
    host: str
    port: int
    route_prefix: str = "/"

    def _base(self, scheme: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        prefix = "" if self.route_prefix in ("", "/") else self.route_prefix.rstrip("/")
        return f"{scheme}://{host}:{self.port}{prefix}"

    @property
    def ws(self) -> str:
        return self._base("ws")

    @property
    def http(self) -> str:
        return self._base("http")

    def to_dict(self) -> dict[str, Any]:
        return {"replica": self.replica, "ws": self.ws, "http": self.http, "host": self.host, "port": self.port}


@dataclass(frozen=True)
class DirectIngress:
    """What the Serve controller says: `enabled` (None: it could not be asked, `error` says why) and the
    direct endpoints of the application's running ingress replicas, sorted by replica id."""

    enabled: bool | None
    endpoints: list[DirectEndpoint] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"direct_ingress": self.enabled, "replicas": [e.to_dict() for e in self.endpoints]}
        if self.error is not None:
            body["error"] = self.error
        return body


def direct_ingress(app_name: str, deployment: str, *, timeout_s: float = 10.0) -> DirectIngress:
    """The direct endpoints of `app_name`'s ingress replicas (those of `deployment`), from Serve's controller.

    Private API of Ray 2.60, kept to this one function: the controller actor (`SERVE_CONTROLLER_ACTOR` in the
    `serve` namespace), its `_direct_ingress_enabled` flag (read through `__ray_call__`), `get_http_config` (the
    host the replicas' servers bind) and `get_target_groups` (every application's: one target per running replica
    whose port is allocated: the node's IP, the port, the replica's actor name `SERVE_REPLICA::app#deployment#id`).
    Targets that are not this deployment's replicas (Serve lists its proxies while an application has no
    running replica) are left out. The host of an endpoint is the bind host unless that is a wildcard
    (0.0.0.0, ::), then the replica's node IP. Fails soft: any error gives `enabled=None` and its text.

    Blocking (Ray calls): from async code, run it on a thread.
    """
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        enabled_ref: Any = controller.__ray_call__.remote(lambda c: bool(c._direct_ingress_enabled))
        enabled, http_options, groups = ray.get(
            [enabled_ref, controller.get_http_config.remote(), controller.get_target_groups.remote()],
            timeout=timeout_s,
        )
        if not enabled:
            return DirectIngress(enabled=False)
        return DirectIngress(enabled=True, endpoints=target_endpoints(groups, str(http_options.host or ""), app_name, deployment))
    except Exception as exc:  # noqa: BLE001 - private API: whatever changed, say so and go on
        lines = [line for line in str(exc).splitlines() if line.strip()]  # a remote error's last line says what
        return DirectIngress(enabled=None, error=f"{type(exc).__name__}: {lines[-1] if lines else ''}")


def target_endpoints(groups: list[Any], bind_host: str, app_name: str, deployment: str) -> list[DirectEndpoint]:
    """The HTTP targets of `app_name`'s target groups that are `deployment`'s replicas, sorted by replica id."""
    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    endpoints = []
    for group in groups:
        if group.app_name != app_name or str(getattr(group.protocol, "value", group.protocol)) != "HTTP":
            continue
        for target in group.targets:
            if target.name.startswith(prefix):
                host = target.ip if bind_host in _WILDCARD_HOSTS else bind_host
                endpoints.append(DirectEndpoint(target.name.removeprefix(prefix), host, int(target.port),
                                                group.route_prefix))
    return sorted(endpoints, key=lambda e: e.replica)
