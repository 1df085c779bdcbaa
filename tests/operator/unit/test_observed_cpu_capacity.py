"""The CPU tier's capacity the engines report drives the router's LRU: taken only as a
positive, finite number, only from pods on the current config (#32 review)."""

from __future__ import annotations

import pytest

from kvtier_operator.engines.figures import CAPACITY_TOKENS, PodFigures
from kvtier_operator.engines.vllm.metrics import cpu_capacity, read
from kvtier_operator.observe import pod_view
from kvtier_operator.observe.observer import CacheObservation, on_config
from kvtier_operator.observe.window import PodHistory, WindowSum
from kvtier_operator.reconcile import reconcile
from kvtier_operator.status import observed_tiers
from tests.helpers import example
from tests.operator.unit.test_observe_file_tiers import kvtier_tpc, offloaded
from tests.operator.unit.test_reconcile import CTX, NOW, FakeGateway


def _info(tokens: str, size: str = "1048576") -> dict:
    return {"vllm:kv_offload_config_info": [(
        {"cpu_num_chunks": "4", "cpu_blocks_per_chunk": "8", "cpu_kv_cache_size_bytes": size,
         "cpu_kv_cache_size_tokens": tokens}, 1.0)]}


@pytest.mark.parametrize("tokens", ["-4096", "0", "inf", "-inf", "nan", "1e400"])
def test_a_capacity_that_is_not_a_positive_finite_number_is_absent(tokens):
    _, got, _ = cpu_capacity(_info(tokens, size=tokens))
    assert got is None
    f = read(_info(tokens, size=tokens), ("cpu", "storage"))
    assert (CAPACITY_TOKENS, "cpu") not in f.gauges


def _obs(*capacities: float) -> CacheObservation:
    return CacheObservation(window=WindowSum(gauges={(CAPACITY_TOKENS, "cpu"): list(capacities)}),
                            pods_read=len(capacities), pods_unreadable=0, problems=[],
                            observed_at=NOW, reads=True, pods_selected=len(capacities))


def test_status_takes_the_least_positive_finite_capacity():
    tpc = kvtier_tpc()
    assert observed_tiers(tpc, offloaded(tpc), _obs(-4096.0, float("inf")), None,
                          enabled=True).cpu_capacity_tokens is None
    assert observed_tiers(tpc, offloaded(tpc), _obs(-1.0, 8192.0, 16384.0), None,
                          enabled=True).cpu_capacity_tokens == 8192


def test_a_capacity_under_one_router_block_leaves_the_computed_one():
    doc = example("native-kvtier.yaml")
    doc["metadata"].update(uid="u-1", generation=1)
    out = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=_obs(3.0), observing=True)
    assert out.render_context.observed_cpu_blocks is None
    assert out.status.router_capacity.source == "computed"


def test_pods_on_an_old_config_give_no_capacity():
    figures = PodFigures(gauges={(CAPACITY_TOKENS, "cpu"): 4096.0, ("used_percent", "cpu"): 5.0})
    old = on_config(figures, current=False)
    assert (CAPACITY_TOKENS, "cpu") not in old.gauges and ("used_percent", "cpu") in old.gauges
    assert on_config(figures, current=True).gauges == figures.gauges
    h = PodHistory()
    h.add(0, old, 300)
    w = WindowSum()
    w.add(h, 0)
    assert (CAPACITY_TOKENS, "cpu") not in w.gauges


def test_the_observer_is_told_which_pods_carry_the_current_config():
    from kvtier_operator.handlers import OperatorConfig, observe_targets
    from kvtier_operator.render.pod import config_hash
    from kvtier_operator.validation import parse_tpc
    from tests.operator.unit.test_observe import body

    config = OperatorConfig(render=CTX)
    doc = body({"cpu": None})
    config.caches.observe("ADDED", doc)
    digest = config_hash(parse_tpc(doc), CTX)

    def pod(name, hash_):
        return pod_view({"metadata": {"name": name, "namespace": "ml", "uid": name,
                                      "annotations": {"kvtier.dev/cache": "cache",
                                                      "kvtier.dev/config-hash": hash_}},
                         "status": {"phase": "Running", "podIP": "10.0.0.1"}})

    (cache,) = observe_targets(config, lambda ns: [pod("new", digest), pod("old", "0ld")])
    assert {t.pod: t.current_config for t in cache.pods} == {"new": True, "old": False}
