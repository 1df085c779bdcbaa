"""`python -m kvtier_offload prepare-dir`: the tier's own directory on a fresh volume made
writable for the model servers' group (setgid, 2775), nothing inside touched, no symlink
followed; and a non-root writer in that group can then write there."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier_offload.cli import main
from kvtier_offload.tier_dir import PrepareError, prepare

GID = 4242
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another "
                               "group needs root (as the init container runs)")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@ROOT_ONLY
def test_creates_the_tier_directory_for_the_group(tmp_path):
    path = prepare(str(tmp_path), "lmcache", GID)
    assert path == f"{tmp_path}/lmcache"
    st = os.stat(path)
    assert st.st_gid == GID and st.st_uid == 0
    assert stat.S_IMODE(st.st_mode) == 0o2775  # whatever the umask


@ROOT_ONLY
def test_the_mount_itself_and_an_existing_directory_are_fixed_not_their_contents(tmp_path):
    (tmp_path / "old").mkdir(mode=0o755)
    (tmp_path / "old" / "block.bin").write_bytes(b"x")
    os.chmod(tmp_path, 0o755)
    prepare(str(tmp_path), "", GID)
    assert _mode(tmp_path) == 0o2775 and os.stat(tmp_path).st_gid == GID
    # Not recursive: what was there keeps its owner, group and mode.
    assert _mode(tmp_path / "old") == 0o755 and os.stat(tmp_path / "old").st_gid == 0
    assert os.stat(tmp_path / "old" / "block.bin").st_gid == 0


def test_a_symlink_in_the_tiers_place_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "sglang").symlink_to(target)
    with pytest.raises(PrepareError, match="is a symlink or not a directory"):
        prepare(str(volume), "sglang", GID)
    assert _mode(target) == 0o700 and os.stat(target).st_gid == os.getegid()


@pytest.mark.parametrize("relative", ["../up", "a/../b", "/abs"])
def test_paths_leaving_the_mount_are_refused(tmp_path, relative):
    with pytest.raises(PrepareError, match="relative path below the mount"):
        prepare(str(tmp_path), relative, GID)


def test_cli_says_why_and_exits_1(tmp_path, capsys):
    assert main(["prepare-dir", "--mount", str(tmp_path / "missing"), "--group",
                 str(GID)]) == 1
    assert "cannot open the volume" in capsys.readouterr().err


@ROOT_ONLY
def test_cli_prepares(tmp_path, capsys):
    assert main(["prepare-dir", "--mount", str(tmp_path), "--dir", "lmcache", "--group",
                 str(GID)]) == 0
    assert "is group 4242, mode 2775" in capsys.readouterr().out


@ROOT_ONLY
@pytest.mark.slow
def test_a_non_root_writer_in_the_group_can_write_there_and_its_files_keep_the_group():
    # As the model server: another uid, the fsGroup as a supplementary group, umask 022.
    # (A volume root the other uid can reach: pytest's tmp_path is below a 700 directory.)
    tmp_path = Path(tempfile.mkdtemp(prefix="kvtier-tier-dir-"))
    os.chmod(tmp_path, 0o755)
    try:
        _non_root_writer(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _non_root_writer(tmp_path: Path) -> None:
    script = (
        "import os, sys\n"
        f"os.setgroups([{GID}]); os.setgid(65532); os.setuid(65532); os.umask(0o022)\n"
        "d = sys.argv[1]\n"
        "os.makedirs(os.path.join(d, 'fp', 'ab'))\n"
        "open(os.path.join(d, 'fp', 'ab', 'k.bin'), 'wb').write(b'kv')\n")
    before = subprocess.run([sys.executable, "-c", script, str(tmp_path / "lmcache")],
                            capture_output=True, text=True, check=False)
    assert before.returncode != 0  # no directory yet, and the volume root is root's 755
    prepare(str(tmp_path), "lmcache", GID)
    after = subprocess.run([sys.executable, "-c", script, str(tmp_path / "lmcache")],
                           capture_output=True, text=True, check=False)
    assert after.returncode == 0, after.stderr
    written = tmp_path / "lmcache" / "fp" / "ab" / "k.bin"
    assert os.stat(written).st_gid == GID  # setgid: the group the evictor deletes with
    assert os.stat(tmp_path / "lmcache" / "fp").st_mode & stat.S_ISGID
