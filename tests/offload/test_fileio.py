"""Block files on their own (fileio.BlockFiles and helpers): atomic writes, reads that
refuse anything but a whole regular file, the batch path's plumbing, and the probes."""

from __future__ import annotations

import errno
import mmap
import os
import socket
import time

import numpy as np
import pytest

from kvtier_offload import batchio, fileio, probes
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, BadBlock, decode_header
from kvtier_offload.fileio import BlockFiles, NotAFile
from kvtier_offload.layout import Layout

FP = "00112233aabbccdd"
SIZE = 16 * 1024
KEY = bytes(range(32)) + b"\0\0\0\1"


def aligned_block(seed: int, size: int = SIZE) -> memoryview:
    buf = mmap.mmap(-1, size)
    buf[:] = np.random.default_rng(seed).bytes(size)
    return memoryview(buf)


@pytest.fixture(params=[False, True], ids=["buffered", "direct"])
def files(request, tmp_path) -> BlockFiles:
    layout = Layout(str(tmp_path), FP)
    layout.ensure_dir(layout.base)
    if request.param and not probes.probe_o_direct(layout.base):
        pytest.skip("no O_DIRECT on this filesystem")
    return BlockFiles(layout, direct=request.param)


def temp_files(root: str) -> list[str]:
    return [name for _, _, names in os.walk(root) for name in names if name.endswith(".tmp")]


def test_a_written_block_reads_back_with_its_header(files):
    data = aligned_block(1)
    path = files.layout.path(KEY)
    files.write(KEY, data, path)  # its fan-out directory does not exist yet
    dest = aligned_block(2)
    header, st = files.read(dest, path)
    assert bytes(dest) == bytes(data) and st.st_size == HEADER_SIZE + SIZE
    assert decode_header(header, FP, KEY, SIZE) == digest(data)
    assert temp_files(files.layout.root) == []


def test_unaligned_memory_is_bounced(files):
    backing = bytearray(SIZE + 3)
    data = memoryview(backing)[3:]
    data[:] = bytes(aligned_block(3))
    path = files.layout.path(KEY)
    files.write(KEY, data, path)
    dest = memoryview(bytearray(SIZE + 5))[5:]
    header, _ = files.read(dest, path)
    assert bytes(dest) == bytes(data)
    assert decode_header(header, FP, KEY, SIZE) == digest(data)


def test_a_failed_write_publishes_nothing_and_leaves_no_temp_file(files, monkeypatch):
    def full(fd, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "writev", full)
    path = files.layout.path(KEY)
    with pytest.raises(OSError) as raised:
        files.write(KEY, aligned_block(4), path)
    assert raised.value.errno == errno.ENOSPC
    assert not os.path.exists(path) and temp_files(files.layout.root) == []


def test_short_writes_are_resumed_by_write_all(tmp_path, monkeypatch):
    real = os.writev
    monkeypatch.setattr(fileio.os, "writev", lambda fd, bufs: real(fd, [bytes(bufs[0][:7])]))
    path = tmp_path / "f"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fileio.write_all(fd, [b"0123456789", memoryview(b"abcdefghij"), b"XY"])
    finally:
        os.close(fd)
    assert path.read_bytes() == b"0123456789abcdefghijXY"


def test_a_short_file_is_truncated_and_a_missing_one_not_found(files):
    path = files.layout.path(KEY)
    with pytest.raises(FileNotFoundError):
        files.read(memoryview(bytearray(SIZE)), path)
    files.write(KEY, aligned_block(5, SIZE // 2), path)
    dest = aligned_block(6)
    with pytest.raises(BadBlock, match="truncated"):
        files.read(dest, path)
    assert bytes(dest) == bytes(aligned_block(6))  # refused before a byte was read


def test_a_file_cut_short_after_its_size_was_checked_is_truncated(files, monkeypatch):
    path = files.layout.path(KEY)
    files.write(KEY, aligned_block(5, SIZE // 2), path)
    real = os.fstat

    def grown(fd):  # the size as it was before another writer cut the file short
        st = list(real(fd))
        st[6] = HEADER_SIZE + SIZE  # st_size
        return os.stat_result(st)

    monkeypatch.setattr(fileio.os, "fstat", grown)
    with pytest.raises(BadBlock, match="truncated: read"):
        files.read(aligned_block(6), path)


@pytest.mark.parametrize("kind", ["FIFO", "directory", "symlink", "socket"])
def test_anything_but_a_regular_file_is_not_a_file_and_never_read(files, tmp_path, kind):
    path = files.layout.path(KEY)
    files.layout.ensure_dir(os.path.dirname(path))
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * (HEADER_SIZE + SIZE))
    holder = None
    if kind == "FIFO":
        os.mkfifo(path)  # opening it for reading must not wait for a writer
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "symlink":
        os.symlink(target, path)
    else:
        holder = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(os.path.dirname(path))  # a socket's path must be short
        try:
            holder.bind(os.path.basename(path))
        finally:
            os.chdir(cwd)
    try:
        with pytest.raises(NotAFile) as raised:
            files.read(aligned_block(7), path)
        assert raised.value.kind == kind and raised.value.reason == "not-a-file"
        assert files.regular_file_at(path) is False
        assert files.remove_bad(path, raised.value) is True
        assert not os.path.lexists(path) and target.exists()  # the name went, no target
    finally:
        if holder is not None:
            holder.close()


def test_a_directory_with_entries_is_not_removed(tmp_path):
    files = BlockFiles(Layout(str(tmp_path), FP), direct=False)
    full = files.layout.path(KEY)
    os.makedirs(full)
    open(os.path.join(full, "inside"), "wb").close()
    assert files.remove_bad(full, NotAFile("directory")) is False
    assert os.path.isdir(full)


def test_touch_refreshes_atime_at_most_once_per_interval(tmp_path):
    files = BlockFiles(Layout(str(tmp_path), FP), direct=False)
    path = files.layout.path(KEY)
    files.write(KEY, aligned_block(1), path)
    os.utime(path, (1000.0, 1000.0))
    files.touch(path, os.stat(path), interval=60.0)
    st = os.stat(path)
    assert st.st_atime > time.time() - 60 and st.st_mtime == 1000.0
    os.utime(path, (time.time() - 10, 1000.0))
    before = os.stat(path).st_atime
    files.touch(path, os.stat(path), interval=60.0)  # touched 10 s ago: left alone
    assert os.stat(path).st_atime == before


def test_advance_drops_bytes_across_views():
    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"hi")]
    fileio.advance(views, 5)
    assert [bytes(v) for v in views] == [b"fg", b"hi"]
    fileio.advance(views, 4)
    assert views == []


@pytest.mark.skipif(not batchio.AVAILABLE, reason=batchio.UNAVAILABLE_REASON or "-")
def test_the_batch_path_writes_reads_and_makes_fan_out_directories(files):
    keys = [bytes([i]) * 4 + KEY[4:] for i in range(3)]  # three fan-out directories
    blocks = [aligned_block(10 + i) for i in range(3)]
    addresses = np.array([batchio.address(b) for b in blocks], dtype=np.int64)
    sizes = np.full(3, SIZE, dtype=np.int64)
    seconds = np.zeros(3)
    status = files.write_batch(keys, addresses, sizes, seconds)
    assert status.tolist() == [batchio.DONE] * 3 and (seconds > 0).all()
    again = files.write_batch(keys, addresses, sizes, np.zeros(3))
    assert again.tolist() == [batchio.EXISTS] * 3
    dests = [aligned_block(20 + i) for i in range(3)]
    status, last_used = files.read_batch(
        keys, np.array([batchio.address(d) for d in dests], dtype=np.int64), sizes,
        np.zeros(3))
    assert status.tolist() == [batchio.DONE] * 3 and (last_used > 0).all()
    assert [bytes(d) for d in dests] == [bytes(b) for b in blocks]
    # and the Python path reads what the batch wrote
    dest = aligned_block(30)
    header, _ = files.read(dest, files.layout.path(keys[1]))
    assert bytes(dest) == bytes(blocks[1])
    assert decode_header(header, FP, keys[1], SIZE) == digest(dest)


def test_probes_leave_nothing_behind_and_say_when_they_cannot_tell(tmp_path):
    assert isinstance(probes.probe_o_direct(str(tmp_path)), bool)
    seconds = probes.file_seconds(str(tmp_path), o_direct=False)
    assert seconds is not None and seconds > 0
    assert os.listdir(tmp_path) == []
    assert probes.file_seconds(str(tmp_path / "missing"), o_direct=False) is None
    assert probes.probe_o_direct(str(tmp_path / "missing")) is False
