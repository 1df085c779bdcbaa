"""Suite-wide fixtures and rules for running the suite in parallel.

The vLLM end-to-end fixtures (a tiny model and its tokens without offloading) are
session-scoped and shared by tests/e2e and tests/netfs.

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

GLUSTERFS_GROUP = "glusterfs"
GLUSTERFS_DIR = "tests/netfs/"
# tests/s3 shares one S3 server (Ceph's RADOS Gateway, ~13 s to start): one worker runs it.
S3_GROUP = "s3"
S3_DIR = "tests/s3/"


def needs_glusterfs(item: pytest.Item) -> bool:
    return (item.get_closest_marker("glusterfs") is not None
            or "gluster" in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    strays = [item.nodeid for item in items
              if needs_glusterfs(item) and not item.nodeid.startswith(GLUSTERFS_DIR)]
    if strays:
        raise pytest.UsageError(
            f"tests that use the GlusterFS volume must live in {GLUSTERFS_DIR} (parallel "
            f"runs keep that directory on one worker): {', '.join(strays)}")


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
