"""The operator reconciles an SGLang HiCache cache against kmock (real kopf, real HTTP,
real client): the claim, the evictor CronJob with the sglang layout, the router config
in SGLang pages, and the injected SGLang pods counted by their config hash."""

from __future__ import annotations

import pytest

from kvtier_operator.render.pod import config_hash
from kvtier_operator.validation import parse_tpc
from tests.operator.integration.harness import CTX, condition, operator, setup, until
from tests.operator.integration.test_operator import cache, configmap, cronjob, pvc, seed, tpc_obj

pytestmark = pytest.mark.timeout(120)
SPEC = {"engine": "sglang", "sglang": {"pageSize": 64}, "cpu": {"size": "400Gi"},
        "router": {"enabled": True}}


async def test_sglang_cache_reconciles(kmock):
    setup(kmock)
    seed(kmock, cache(SPEC))
    async with operator(kmock):
        status = await until(lambda: tpc_obj(kmock)["status"]["conditions"], what="status")
        claim = await until(lambda: pvc(kmock), what="pvc")
        cj = await until(lambda: cronjob(kmock), what="cronjob")
        cm = await until(lambda: configmap(kmock), what="configmap")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    args = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--layout") + 1] == "sglang"
    plugins = cm["data"]["tiered-prefix-cache-plugins.yaml"]
    assert "blockSizeTokens: 64" in plugins and "blockSizeTokens: 16" not in plugins
    assert "lruCapacityPerServer: 25600" in plugins  # 400Gi / (256 KiB x 64)
    body = tpc_obj(kmock)
    assert condition(body, "Ready")["observedGeneration"] == 1
    assert body["status"]["configHash"] == config_hash(parse_tpc(cache(SPEC)), CTX)
    assert [c["type"] for c in status][:2] == ["Ready", "StorageReady"]


async def test_invalid_sglang_spec_becomes_a_condition(kmock):
    setup(kmock)
    seed(kmock, cache({**SPEC, "router": {"enabled": True, "blockSize": 16}}))
    async with operator(kmock):
        body = await until(lambda: (b := tpc_obj(kmock)) and b.get("status") and b,
                           what="status")
    ready = condition(body, "Ready")
    assert ready["status"] == "False"
    assert "spec.router.blockSize 16 differs from spec.sglang.pageSize 64" in ready["message"]
