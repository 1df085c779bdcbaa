"""Suite-wide fixtures and rules for running the suite in parallel.

The vLLM end-to-end fixtures (a tiny model and its tokens without offloading) are
session-scoped and shared by tests/e2e and tests/netfs; so are, module-scoped, the
recompute-bound comparisons' (tests/e2e/rounds.py: a costlier model, an engine without
offloading, the rounds' block files).

`make test` runs the suite on one pytest-xdist worker per core (`-n auto --dist
loadgroup`). Every test that uses the GlusterFS volume (marker `glusterfs` or the
`gluster` fixture) lives in tests/netfs and all of tests/netfs runs on one worker: only
one glusterd can run on a machine, so a second worker would find its port taken and
skip those tests. The scheduler below does that from the test ids; an `xdist_group`
mark cannot, since pytest 9.2's node ids no longer take the group suffix xdist 3.8
writes into them (its loadgroup then spreads a group over all workers, silently).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.fixtures import baseline, model, plain_tokens  # noqa: F401 (fixtures)
from tests.e2e.rounds import costly_model, engine_off, tier_blocks  # noqa: F401 (fixtures)

GLUSTERFS_GROUP = "glusterfs"
GLUSTERFS_DIR = "tests/netfs/"
# tests/s3 shares one S3 server (Ceph's RADOS Gateway, ~13 s to start): one worker runs it.
S3_GROUP = "s3"
S3_DIR = "tests/s3/"


def needs_glusterfs(item: pytest.Item) -> bool:
    return (item.get_closest_marker("glusterfs") is not None
            or "gluster" in getattr(item, "fixturenames", ()))


# Cost. `slow`: starts vLLM or SGLang (or imports them), GlusterFS, helm, a kopf operator
# against the in-process API server, compiles or runs subprocesses, or takes over a second.
# `make check` runs the rest (`-m "not slow"`, under a minute on 2 cores); `make test` all.
# By folder here, by module below where a fast folder holds a slow module, and by
# @pytest.mark.slow on single tests in fast modules. Every folder is one or the other, so
# a new or moved folder must be classified here (a test run says so).
FAST_DIRS = ("tests/operator/unit/", "tests/operator/webhook/", "tests/offload/", "tests/evictor/",
             "tests/docs/")
SLOW_DIRS = ("tests/operator/integration/", "tests/chart/", "tests/e2e/", "tests/netfs/",
             "tests/operator/engines/", "tests/offload/gpu/", "tests/s3/")
SLOW_MODULES = (
    "tests/evictor/test_events.py",  # imports vLLM (its event classes); live sockets
    "tests/offload/test_vllm_worker.py",  # vLLM's offloading worker, its CPU tier
    "tests/offload/test_vllm_worker_contract.py",
    "tests/offload/test_vllm_worker_files.py",  # multi-block files through vLLM's types
    "tests/offload/test_cudart_copy.py",  # the runtime batch copy through the worker
    "tests/offload/test_vllm032_shim.py",
    "tests/offload/test_gpu_check.py",  # scripts/gpu_check.py, in subprocesses
    "tests/offload/test_vllm_tier.py",
    "tests/offload/test_vllm_recompute.py",
    "tests/offload/test_vllm_recompute_bound.py",
    "tests/offload/test_vllm_tier_recompute_bound.py",  # vLLM's tiering manager
    "tests/offload/test_vllm_local_tier.py",
    "tests/offload/test_chained_tiers.py",  # engine processes, the operator's tiers
    "tests/offload/test_estale.py",  # compiles an LD_PRELOAD shim, runs subprocesses
    "tests/offload/test_syscalls.py",  # strace in a child per test
    "tests/offload/test_cli.py",  # the init container's install, in subprocesses
    "tests/operator/unit/test_cli.py",  # the kvtier CLI, in subprocesses
    "tests/operator/unit/test_sglang_parser.py",  # imports SGLang (about 10 s)
)
SLOW_PATHS = SLOW_DIRS + SLOW_MODULES


def is_slow_path(nodeid: str) -> bool:
    return nodeid.startswith(SLOW_PATHS)


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """Under exactly `-m "not slow"` (make check) a slow folder or module is not even
    imported: every test in it would be deselected, and importing vLLM or SGLang alone
    costs seconds per worker."""
    if config.getoption("markexpr", "").strip() != "not slow":
        return None
    try:
        relative = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    if collection_path.is_dir():
        relative += "/"
    return True if is_slow_path(relative) else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    strays = [item.nodeid for item in items
              if needs_glusterfs(item) and not item.nodeid.startswith(GLUSTERFS_DIR)]
    if strays:
        raise pytest.UsageError(
            f"tests that use the GlusterFS volume must live in {GLUSTERFS_DIR} (parallel "
            f"runs keep that directory on one worker): {', '.join(strays)}")
    unclassified = sorted({item.nodeid.split("::")[0] for item in items
                           if not item.nodeid.startswith(FAST_DIRS + SLOW_DIRS)})
    if unclassified:
        raise pytest.UsageError(
            "tests/conftest.py classifies every test folder as fast or slow (FAST_DIRS, "
            f"SLOW_DIRS); these are in neither: {', '.join(unclassified)}")
    for item in items:
        if is_slow_path(item.nodeid):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class OneGlusterfsWorker(LoadGroupScheduling):
        """loadgroup, with all of tests/netfs as one group and all of tests/s3 as
        another."""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(GLUSTERFS_DIR):
                return GLUSTERFS_GROUP
            if nodeid.startswith(S3_DIR):
                return S3_GROUP
            return str(super()._split_scope(nodeid))

    return OneGlusterfsWorker(config, log)
