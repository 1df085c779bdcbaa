"""The evictor CLI against a real 64 MiB tmpfs: statvfs-driven watermarks, end to end."""

from __future__ import annotations

import json
import os
import time

import pytest

from kvtier_evictor import cli
from tests.evictor.tree import kvtier_path
from tests.mounts import tmpfs

pytestmark = pytest.mark.privileged
MIB = 1024 * 1024


def test_cli_brings_a_full_tmpfs_below_the_low_watermark(tmp_path):
    with tmpfs(tmp_path / "vol", "64m") as vol:
        now = time.time()
        paths = []
        for i in range(58):  # 58 MiB of 64: about 91%
            p = kvtier_path(vol, i)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(os.urandom(MIB))
            os.utime(p, (now - 3600 - 60 * i, now - 3600 - 60 * i))  # file 57 is oldest
            paths.append(p)
        hot = kvtier_path(vol, 1000)
        hot.parent.mkdir(parents=True, exist_ok=True)
        hot.write_bytes(b"h" * MIB)  # just written: within minIdle, must survive
        st = os.statvfs(vol)
        assert (st.f_blocks - st.f_bfree) / st.f_blocks > 0.85
        log = tmp_path / "termination-log"
        code = cli.main(["--root", str(vol), "--termination-log", str(log)])
        report = json.loads(log.read_text())
        assert code == 3 and report["outcome"] == "freed"
        assert report["usage_before"]["percent"] > 85
        assert report["usage_after"]["percent"] < 70
        st = os.statvfs(vol)
        assert (st.f_blocks - st.f_bfree) / st.f_blocks < 0.70
        survivors = [p.exists() for p in paths]
        # LRU: every deleted file is older than every survivor
        assert survivors == sorted(survivors, reverse=True)
        assert hot.exists()


def test_inode_watermark_on_a_real_filesystem(tmp_path):
    with tmpfs(tmp_path / "vol", "64m", inodes=400) as vol:
        now = time.time()
        leaf = kvtier_path(vol, 0).parent  # one directory: directories cost inodes too
        leaf.mkdir(parents=True)
        for i in range(370):
            p = leaf / f"{i:064x}.kvb"
            p.write_bytes(b"x")
            os.utime(p, (now - 7200 + i, now - 7200 + i))
        log = tmp_path / "termination-log"
        code = cli.main(["--root", str(vol), "--termination-log", str(log),
                         "--dir-guard-seconds", "0"])
        report = json.loads(log.read_text())
        assert report["usage_before"]["inode_percent"] > 90
        assert report["outcome"] == "freed", report
        assert code == 3
        assert report["usage_after"]["inode_percent"] < 80
