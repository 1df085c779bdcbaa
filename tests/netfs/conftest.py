"""One GlusterFS volume for the whole session (start-up costs seconds, paid once)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.glusterfs import GlusterUnavailable, GlusterVolume, gluster_volume, leftovers


@pytest.fixture(scope="session")
def gluster() -> GlusterVolume:
    base = Path(tempfile.mkdtemp(prefix="kvtier-gluster-"))
    try:
        with gluster_volume(base) as vol:
            yield vol
    except GlusterUnavailable as e:
        pytest.skip(f"no GlusterFS volume here: {e}")
    left = leftovers(base, vol.name)
    assert not left, f"the GlusterFS volume left things behind: {left}"


@pytest.fixture
def nodes(gluster, request):
    """Mount A and mount B, each a fresh directory of the volume for this test."""
    sub = request.node.name.replace("[", "-").replace("]", "")
    a, b = gluster.mounts[0] / sub, gluster.mounts[1] / sub
    a.mkdir()
    yield a, b
    shutil.rmtree(a, ignore_errors=True)
