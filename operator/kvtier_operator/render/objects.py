"""All objects the operator owns for one TieredPrefixCache, in apply order."""

from __future__ import annotations

from typing import Any

from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.context import RenderContext
from kvtier_operator.render.cronjob import render_cronjob
from kvtier_operator.render.object_evictor import render_object_evictor
from kvtier_operator.render.pvc import render_pvc
from kvtier_operator.render.router import render_router_configmap


def render_objects(tpc: TieredPrefixCache, ctx: RenderContext,
                   observed_cpu_blocks: int | None = None) -> list[dict[str, Any]]:
    """`observed_cpu_blocks`: the CPU tier's capacity the engines report, in router
    blocks (status observation), which the router config uses over the computed one."""
    rendered = [render_pvc(tpc), render_cronjob(tpc, ctx), render_object_evictor(tpc, ctx),
                render_router_configmap(tpc, observed_cpu_blocks)]
    return [obj for obj in rendered if obj is not None]
