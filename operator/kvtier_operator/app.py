"""`kvtier operator`: the kopf operator process, standalone, with liveness and metrics."""

from __future__ import annotations

import dataclasses
import logging
import os

import kopf
from kubernetes import client, config
from prometheus_client import start_http_server

from kvtier_operator.context import (
    DEFAULT_OFFLOAD_IMAGE,
    DEFAULT_OPERATOR_IMAGE,
    RenderContext,
)
from kvtier_operator.gateway import Gateway
from kvtier_operator.handlers import OperatorConfig, register
from kvtier_operator.observe.observer import ObserveSettings
from kvtier_operator.validation.host_paths import parse_allowed
from kvtier_operator.validation.object_endpoints import parse_allowed_endpoints
from kvtier_operator.webhook import register_server


def config_from_env(env: dict[str, str] | None = None) -> OperatorConfig:
    env = dict(os.environ if env is None else env)
    return OperatorConfig(
        render=RenderContext(
            # KVTIER_SIDECAR_IMAGE: the name before 0.2, still read (deprecated).
            offload_image=env.get("KVTIER_OFFLOAD_IMAGE") or env.get("KVTIER_SIDECAR_IMAGE")
            or DEFAULT_OFFLOAD_IMAGE,
            evictor_image=env.get("KVTIER_OPERATOR_IMAGE", DEFAULT_OPERATOR_IMAGE),
            image_pull_policy=env.get("KVTIER_IMAGE_PULL_POLICY", "IfNotPresent"),
            allowed_host_paths=parse_allowed(env.get("KVTIER_ALLOWED_HOST_PATHS")),
            allowed_object_endpoints=parse_allowed_endpoints(
                env.get("KVTIER_ALLOWED_OBJECT_ENDPOINTS")),
        ),
        drift_interval=float(env.get("KVTIER_DRIFT_INTERVAL_SECONDS", "60")),
        observe=observe_settings(env),
        reference_namespaces=frozenset(
            n.strip() for n in env.get("KVTIER_REFERENCE_NAMESPACES", "").split(",") if n.strip()),
    )


def observe_settings(env: dict[str, str]) -> ObserveSettings:
    """KVTIER_OBSERVE_* (the Helm values' observe block); interval 0: observation off."""
    d = ObserveSettings()

    def get(name: str, default: float) -> float:
        return float(env.get(f"KVTIER_OBSERVE_{name}", default))

    return ObserveSettings(
        interval=get("INTERVAL_SECONDS", d.interval), timeout=get("TIMEOUT_SECONDS", d.timeout),
        max_bytes=int(get("MAX_BODY_BYTES", d.max_bytes)),
        max_series=int(get("MAX_SERIES", d.max_series)),
        concurrency=int(get("CONCURRENCY", d.concurrency)),
        window=get("WINDOW_SECONDS", d.window),
        prometheus_url=env.get("KVTIER_OBSERVE_PROMETHEUS_URL") or None)


def api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def run(metrics_port: int, liveness: str, namespaces: list[str], json_logs: bool,
        webhook_port: int, webhook_cert_dir: str) -> None:
    kopf.configure(verbose=False, log_format=kopf.LogFormat.JSON if json_logs
                   else kopf.LogFormat.FULL)
    logging.getLogger("kvtier_operator").setLevel(logging.INFO)
    registry = kopf.OperatorRegistry()
    shared: dict[str, Gateway] = {}

    def gateway() -> Gateway:
        if "gw" not in shared:
            shared["gw"] = Gateway(api_client())
        return shared["gw"]

    operator_config = dataclasses.replace(config_from_env(), namespaced=bool(namespaces))
    register(registry, operator_config, gateway)
    if webhook_port:
        register_server(registry, operator_config.caches, operator_config.conflicts,
                        operator_config.render, "0.0.0.0", webhook_port, webhook_cert_dir)
    if metrics_port:
        start_http_server(metrics_port)
    kopf.run(registry=registry, standalone=True, clusterwide=not namespaces,
             namespaces=namespaces, liveness_endpoint=liveness)
