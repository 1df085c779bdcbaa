"""The evictor on real files: LRU order, minIdle, temp and directory reaping, foreign
files, concurrent writers, errors, the lock, budget mode, the report and exit codes."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvtier_evictor import cli, evict
from kvtier_evictor.evict import Config, Run
from kvtier_evictor.layouts import KVTIER, LMCACHE, VLLM_FS
from kvtier_evictor.lock import LOCK_NAME
from kvtier_evictor.report import (
    ABOVE_LOW_WATERMARK,
    ERROR,
    FREED,
    NOTHING_TO_DO,
    EvictionReport,
)
from kvtier_evictor.scan import LruSelection
from tests.evictor.tree import FP, FilesUsage, key, kvtier_path, vllm_fs_path, write

NOW = 1_900_000_000.0
KB = 1024
U = 16 * KB  # block-aligned, so allocated bytes equal file sizes


def make_run(root: Path, capacity: int, layout=KVTIER, now: float = NOW, **cfg) -> Run:
    settings = {"min_idle_seconds": 600, "temp_guard_seconds": 3600,
                "dir_guard_seconds": 600, "threads": 4, **cfg}
    config = Config(root=str(root), layout=layout, **settings)
    return Run(config, clock=lambda: now, usage_source=FilesUsage(root, capacity))


def lru_tree(root: Path, n: int = 10) -> list[Path]:
    # file i last used i hours ago: file n-1 is the oldest
    return [write(kvtier_path(root, i), U, NOW - 3600 * (i + 1)) for i in range(n)]


def test_below_high_watermark_does_nothing(tmp_path):
    files = lru_tree(tmp_path)
    report = make_run(tmp_path, capacity=20 * U).execute()  # 50% used
    assert report.outcome == NOTHING_TO_DO
    assert report.files_scanned == 0  # no scan at all below the watermark
    assert all(f.exists() for f in files)


def test_deletes_least_recently_used_until_below_low(tmp_path):
    files = lru_tree(tmp_path)  # 100 KiB in 10 files
    report = make_run(tmp_path, capacity=11 * U).execute()  # 90.9% > 85
    assert report.outcome == FREED
    # to get below 70% of 110 KiB = 77 KiB, delete 3 files (the 3 oldest)
    assert [f.exists() for f in files] == [True] * 7 + [False] * 3
    assert report.files_deleted == 3
    assert report.usage_before.percent > 85 and report.usage_after.percent < 70
    assert report.files_scanned == 10


def test_last_use_is_later_of_atime_and_mtime(tmp_path):
    files = lru_tree(tmp_path)
    oldest = files[-1]
    st = oldest.stat()
    os.utime(oldest, (st.st_atime, NOW - 60 * 30))  # rewritten 30 minutes ago
    make_run(tmp_path, capacity=11 * U).execute()
    assert oldest.exists()
    assert not files[-4].exists()  # the next-oldest went instead


def test_hit_refreshed_atime_protects_file(tmp_path):
    files = lru_tree(tmp_path)
    os.utime(files[-1], (NOW - 60 * 20, files[-1].stat().st_mtime))  # read 20 min ago
    make_run(tmp_path, capacity=11 * U).execute()
    assert files[-1].exists()


def test_min_idle_is_never_violated(tmp_path):
    files = [write(kvtier_path(tmp_path, i), U, NOW - 60) for i in range(10)]
    report = make_run(tmp_path, capacity=10 * U).execute()  # 100% used, all hot
    assert report.outcome == ABOVE_LOW_WATERMARK
    assert report.skipped_recent == 10 and report.files_deleted == 0
    assert all(f.exists() for f in files)


def test_reaps_stale_temps_but_not_fresh_ones(tmp_path):
    lru_tree(tmp_path)
    k = key(99)
    leaf = kvtier_path(tmp_path, 0).parent
    stale = write(leaf / f".{k}.kvb.deadbeef.tmp", U // 2, NOW - 7200)
    fresh = write(leaf / f".{k}.kvb.cafef00d.tmp", U // 2, NOW - 60)
    report = make_run(tmp_path, capacity=23 * U // 2).execute()
    assert not stale.exists() and fresh.exists()
    assert report.temp_files_reaped == 1


def test_removes_old_empty_dirs_only_inside_layout(tmp_path):
    files = lru_tree(tmp_path)
    base = tmp_path / "kvtier" / "v1" / FP
    old_empty = base / "ff" / "ee"
    young_empty = base / "ff" / "dd"
    for d in (old_empty, young_empty):
        d.mkdir(parents=True)
    os.utime(old_empty, (NOW - 7200, NOW - 7200))
    os.utime(young_empty, (NOW - 10, NOW - 10))
    empty_fp = tmp_path / "kvtier" / "v1" / "fedcba9876543210"
    empty_fp.mkdir()
    os.utime(empty_fp, (NOW - 7200, NOW - 7200))
    report = make_run(tmp_path, capacity=11 * U).execute()
    assert not old_empty.exists() and young_empty.exists()
    assert empty_fp.exists()  # fingerprint directories are never removed
    # the three oldest files went, and with them the fan-out directories they emptied
    emptied = {d for f in files[-3:] for d in (f.parent, f.parent.parent)}
    assert report.files_deleted == 3 and not any(d.exists() for d in emptied)
    assert report.dirs_removed == 1 + len(emptied)


def test_foreign_files_are_never_touched(tmp_path):
    lru_tree(tmp_path)
    ancient = NOW - 10**6
    foreign = [
        write(tmp_path / "kvtier" / "v1" / FP / "config.json", 2 * U, ancient),
        write(tmp_path / "kvtier" / "v1" / FP / "ab" / "cd" / "notes.txt", 2 * U, ancient),
        write(tmp_path / "kvtier" / "v1" / FP / "ab" / f"{key(1)}.kvb", 2 * U, ancient),
        write(tmp_path / "models" / "ab" / "cd" / f"{key(2)}.kvb", 2 * U, ancient),
        write(tmp_path / "kvtier" / "v2" / FP / "ab" / "cd" / f"{key(3)}.kvb", 2 * U, ancient),
        write(tmp_path / "checkpoint.safetensors", 2 * U, ancient),
    ]
    target = tmp_path / "elsewhere.kvb"
    write(target, 2 * U, ancient)
    link = kvtier_path(tmp_path, 500)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    os.utime(link, (ancient, ancient), follow_symlinks=False)
    report = make_run(tmp_path, capacity=20 * U).execute()  # 310/300: way over
    assert all(f.exists() for f in foreign), "a foreign file was deleted"
    assert link.is_symlink() and target.exists()
    assert report.files_deleted == 10  # every real block file, and nothing else


def test_vllm_fs_layout(tmp_path):
    files = [write(vllm_fs_path(tmp_path, i), U, NOW - 3600 * (i + 1)) for i in range(10)]
    leaf = files[0].parent
    stale_tmp = write(leaf / f"{key(0)}.bin_12345678901.tmp", U, NOW - 7200)
    config = write(tmp_path / "Qwen_Qwen3-0.6B_0123456789ab" / "config.json", U // 4, NOW - 10**6)
    kvtier_file = write(kvtier_path(tmp_path, 7), U, NOW - 10**6)
    report = make_run(tmp_path, capacity=14 * U, layout=VLLM_FS).execute()
    assert report.outcome == FREED
    assert not stale_tmp.exists() and config.exists() and kvtier_file.exists()
    assert not files[-1].exists() and files[0].exists()


def test_lmcache_layout(tmp_path):
    d = tmp_path / "lmcache"
    files = [write(d / f"model@1@0@{key(i)[:16]}@bfloat16.pt", U, NOW - 3600 * (i + 1))
             for i in range(10)]
    other = write(tmp_path / "other.pt", U, NOW - 10**6)
    report = make_run(tmp_path, capacity=12 * U, layout=LMCACHE).execute()
    assert report.outcome == FREED
    assert other.exists() and files[0].exists() and not files[-1].exists()


def test_file_used_between_scan_and_delete_is_kept(tmp_path):
    files = lru_tree(tmp_path)

    class TouchingRun(Run):
        def _reap_temps(self, paths):  # runs after the scan, before deletion
            os.utime(files[-1], (NOW - 5, files[-1].stat().st_mtime))
            super()._reap_temps(paths)

    config = Config(root=str(tmp_path), layout=KVTIER, min_idle_seconds=600, threads=2)
    report = TouchingRun(config, clock=lambda: NOW,
                         usage_source=FilesUsage(tmp_path, 11 * U)).execute()
    assert files[-1].exists()
    assert report.skipped_changed == 1


def test_concurrent_writer_during_a_run(tmp_path):
    now = time.time()  # this run uses the real clock
    for i in range(200):
        write(kvtier_path(tmp_path, i), U, now - 3600 * (i + 1))
    stop = threading.Event()
    written: list[Path] = []
    errors: list[Exception] = []

    def writer():
        i = 1000
        while not stop.is_set():
            try:
                path = kvtier_path(tmp_path, i)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.stem}.kvb.{i:08x}.tmp")
                tmp.write_bytes(b"\x02" * 4 * KB)
                os.replace(tmp, path)
                written.append(path)
                i += 1
            except Exception as err:  # the test fails below if anything breaks
                errors.append(err)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        report = Run(Config(root=str(tmp_path), layout=KVTIER, min_idle_seconds=600, threads=4),
                     clock=time.time,
                     usage_source=FilesUsage(tmp_path, 210 * U)).execute()
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert report.errors == 0
    assert report.outcome in (FREED, ABOVE_LOW_WATERMARK)
    assert report.files_deleted > 0
    assert all(p.exists() for p in written), "a freshly written file was deleted"


def test_permission_error_is_counted_and_others_still_go(tmp_path, monkeypatch):
    files = lru_tree(tmp_path)
    real_unlink = os.unlink

    def unlink(path, *a, **kw):  # the evictor unlinks a name relative to its directory
        if os.path.basename(str(path)) == files[-1].name:
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    report = make_run(tmp_path, capacity=11 * U).execute()
    assert report.errors == 1 and "Permission denied" in report.error_messages[0]
    assert files[-1].exists() and not files[-2].exists()
    assert report.outcome in (FREED, ABOVE_LOW_WATERMARK)


def test_unreadable_directory_is_an_error_not_a_crash(tmp_path, monkeypatch):
    lru_tree(tmp_path)
    real_open = os.open
    bad = kvtier_path(tmp_path, 0).parent.parent

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        # the scan opens each directory by name in its parent (as root, chmod cannot deny)
        where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else ""
        if os.path.join(where, path) == str(bad):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_)
    report = make_run(tmp_path, capacity=10 * U).execute()
    assert report.errors >= 1 and any("Permission denied" in m for m in report.error_messages)


def test_lock_blocks_a_second_run_and_stale_lock_is_taken_over(tmp_path):
    lru_tree(tmp_path)
    lock = tmp_path / LOCK_NAME
    lock.write_text("{}")
    report = make_run(tmp_path, capacity=11 * U).execute()
    assert report.outcome == ERROR and "another evictor run holds" in report.error_messages[0]
    assert lock.exists()
    os.utime(lock, (time.time() - 7200, time.time() - 7200))
    report = make_run(tmp_path, capacity=11 * U).execute()
    assert report.outcome == FREED
    assert not lock.exists()  # released after the run


GOOD_BODY = '{"pid": 1, "host": "evictor-0", "since": 0, "token": "ab"}'


@pytest.mark.parametrize(("body", "age", "held"), [
    (GOOD_BODY, -30, True),  # a node's clock a little ahead: still held
    (GOOD_BODY, -86400 * 365 * 50, False),  # touch -d 2076: forged, taken over
    (GOOD_BODY, -61, False),
    ("", 5, True),  # a run that just created it and is writing its body
    ("", 30, False),  # nobody's lock: an empty file left at the name
    ("not json", 30, False),
    ('{"pid": 1}', 30, False),
    ("x" * 5000, 30, False),
    (GOOD_BODY, 30, True),
    (GOOD_BODY, 7200, False),  # not refreshed for longer than the stale timeout
])
def test_only_a_believable_lock_stops_a_run(tmp_path, body, age, held):
    lru_tree(tmp_path)
    lock = tmp_path / LOCK_NAME
    lock.write_text(body)
    when = time.time() - age
    os.utime(lock, (when, when))
    report = make_run(tmp_path, capacity=11 * U).execute()
    if held:
        assert report.outcome == ERROR and "another evictor run holds" in report.error_messages[0]
        assert report.lock_held_seconds == pytest.approx(age, abs=2)
        assert lock.exists()
    else:
        assert report.outcome == FREED and report.lock_held_seconds is None
        assert not lock.exists()  # taken over, then released after the run


def test_a_lock_at_a_fifo_never_hangs_the_run(tmp_path):
    lru_tree(tmp_path)
    os.mkfifo(tmp_path / LOCK_NAME)
    when = time.time() - 30
    os.utime(tmp_path / LOCK_NAME, (when, when))
    report = make_run(tmp_path, capacity=11 * U).execute()
    assert report.outcome == FREED


def test_a_directory_the_run_empties_goes_in_the_same_run_if_it_was_old_before(tmp_path):
    files = lru_tree(tmp_path)
    young = files[-1].parent  # a writer created or removed a name here just now
    os.utime(young, (NOW - 10, NOW - 10))
    report = make_run(tmp_path, capacity=11 * U).execute()
    assert report.files_deleted == 3 and not any(f.exists() for f in files[-3:])
    assert young.is_dir() and young.parent.is_dir()  # within the guard: kept
    for f in files[-3:-1]:  # their directories were old before the run's deletions
        assert not f.parent.exists() and not f.parent.parent.exists()
    assert report.dirs_removed == 4


def test_dry_run_deletes_nothing(tmp_path):
    files = lru_tree(tmp_path)
    # Directories young enough to stay: the plan is then the files' bytes alone (this
    # test's usage counts files only, where a real statvfs counts directories too).
    report = make_run(tmp_path, capacity=11 * U, dry_run=True,
                      dir_guard_seconds=10**9).execute()
    assert report.files_deleted == 3 and report.dry_run
    assert all(f.exists() for f in files)


def test_budget_mode_measures_the_cache_itself(tmp_path):
    files = lru_tree(tmp_path)
    write(tmp_path / "huge-foreign-file", 100 * U, NOW)  # not ours: not counted
    run = make_run(tmp_path, capacity=10**9, capacity_bytes=11 * U)
    report = run.execute()
    assert report.usage_source == "budget"
    assert report.usage_before.used_bytes == 10 * U
    assert report.outcome == FREED
    assert sum(not f.exists() for f in files) == 3
    assert report.usage_after.used_bytes == 7 * U


def test_inode_watermark_triggers_eviction(tmp_path):
    files = lru_tree(tmp_path)
    run = make_run(tmp_path, capacity=10**9)
    run._statvfs = FilesUsage(tmp_path, 10**9, inodes=11)  # 10/11 inodes = 91% > 90%
    report = run.execute()
    assert report.outcome == FREED
    # below 80% of 11 inodes = 8.8: two oldest files go
    assert sum(not f.exists() for f in files) == 2


def test_selection_is_bounded_by_what_must_be_freed():
    sel = LruSelection(bytes_needed=3000, files_needed=0)
    for i in range(100_000):
        sel.offer(float(i % 9973) + i / 1e6, 1000, f"/f{i}")
    assert len(sel) == 3
    assert [c.last_use for c in sel.oldest_first()] == sorted(c.last_use for c in sel.oldest_first())
    assert sel.oldest_first()[0].last_use < 1.0


def test_report_round_trip_and_termination_limit():
    report = EvictionReport(outcome=FREED, files_deleted=5,
                            error_messages=[f"unlink /x/{i}: Permission denied" * 5
                                            for i in range(50)], errors=50)
    back = EvictionReport.from_json(report.to_json())
    assert back == report
    short = report.to_json(limit=4096)
    assert len(short.encode()) <= 4096
    assert json.loads(short)["errors"] == 50
    with pytest.raises(ValueError):
        EvictionReport.from_json("[1, 2]")


# ---------------------------------------------------------------- the CLI

def run_cli(tmp_path, *args) -> tuple[int, dict]:
    log = tmp_path / "termination-log"
    code = cli.main(["--root", str(tmp_path / "vol"), "--termination-log", str(log), *args])
    return code, json.loads(log.read_text())


def test_cli_exit_codes(tmp_path, monkeypatch):
    vol = tmp_path / "vol"
    files = lru_tree(vol)
    for f in files:  # real clock for the CLI: make them old relative to now
        os.utime(f, (f.stat().st_atime - NOW + time.time(),) * 2)
    monkeypatch.setattr("kvtier_evictor.evict.statvfs_usage",
                        lambda root: FilesUsage(vol, 11 * U)())
    code, report = run_cli(tmp_path, "--high-watermark", "95", "--low-watermark", "50")
    assert (code, report["outcome"]) == (0, NOTHING_TO_DO)
    code, report = run_cli(tmp_path)
    assert (code, report["outcome"]) == (3, FREED)
    assert report["files_deleted"] == 3
    monkeypatch.setattr("kvtier_evictor.evict.statvfs_usage",
                        lambda root: FilesUsage(vol, 75 * U // 10)())
    code, report = run_cli(tmp_path, "--min-idle-seconds", str(10**8))
    assert (code, report["outcome"]) == (2, ABOVE_LOW_WATERMARK)
    code, _ = run_cli(tmp_path, "--ok-exit-zero")
    assert code == 0
    code = cli.main(["--root", str(tmp_path / "missing")])
    assert code == 1
    assert cli.main(["--root", str(vol), "--low-watermark", "90"]) == 1


def test_operator_cronjob_args_parse_with_the_evictor_cli():
    from kvtier_operator.context import RenderContext
    from kvtier_operator.render.cronjob import render_cronjob
    from kvtier_operator.validation import parse_tpc
    from tests.helpers import tpc_doc

    for spec in ({}, {"eviction": {"capacity": "ClaimSize"}}, {"storage": {"backend": "vllm-fs"}},
                 {"connector": "lmcache"}):
        cj = render_cronjob(parse_tpc(tpc_doc(spec)), RenderContext())
        container = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
        args = cli.build_parser().parse_args(container["args"])
        assert args.root == "/kv-cache" and args.ok_exit_zero


def test_auto_threads_stay_single_on_a_fast_filesystem(tmp_path):
    from kvtier_evictor.scan import ScanRules, scan

    lru_tree(tmp_path, n=300)
    rules = ScanRules(now=NOW, min_idle_seconds=600, temp_guard_seconds=3600,
                      dir_guard_seconds=600)
    assert scan(str(tmp_path), KVTIER, rules, None, threads=0).threads == 1


def test_auto_threads_go_parallel_on_a_slow_filesystem(tmp_path, monkeypatch):
    from kvtier_evictor import scan as scan_module

    lru_tree(tmp_path, n=300)
    real_scandir = os.scandir

    def slow_scandir(path="."):
        time.sleep(0.002)  # a network filesystem's round trip
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", slow_scandir)
    rules = scan_module.ScanRules(now=NOW, min_idle_seconds=600, temp_guard_seconds=3600,
                                  dir_guard_seconds=600)
    totals = scan_module.scan(str(tmp_path), KVTIER, rules, None, threads=0)
    assert totals.threads == scan_module.AUTO_THREADS
    assert totals.files == 300


def test_auto_threads_stay_single_where_calls_are_slow_on_a_cpu_not_on_the_volume(
        tmp_path, monkeypatch):
    # A loaded node makes every call slower on the wall clock, but the time goes to a CPU
    # (or to waiting for one), not to waiting on the volume: threads would not help, so
    # the probe must not read it as a slow filesystem (it picked 16 under two CPU hogs).
    from kvtier_evictor import scan as scan_module

    lru_tree(tmp_path, n=300)
    real_scandir = os.scandir

    def busy_scandir(path="."):
        end = time.perf_counter() + 0.002  # as long as the slow volume's round trip
        while time.perf_counter() < end:
            pass
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", busy_scandir)
    rules = scan_module.ScanRules(now=NOW, min_idle_seconds=600, temp_guard_seconds=3600,
                                  dir_guard_seconds=600)
    assert scan_module.scan(str(tmp_path), KVTIER, rules, None, threads=0).threads == 1


def test_past_the_candidate_bound_the_run_frees_in_passes_in_lru_order(tmp_path):
    # 200 files to free 60% of: with at most 25 candidates held, the run scans again until
    # below the low watermark, deleting exactly what an unbounded run deletes.
    unbounded, bounded = tmp_path / "a", tmp_path / "b"
    files_a, files_b = lru_tree(unbounded, 200), lru_tree(bounded, 200)
    one = make_run(unbounded, capacity=210 * U, low_watermark=40).execute()
    many = make_run(bounded, capacity=210 * U, low_watermark=40, max_candidates=25).execute()
    assert one.outcome == many.outcome == FREED
    assert one.passes == 1 and many.passes > 3
    assert many.files_deleted == one.files_deleted
    assert [f.exists() for f in files_b] == [f.exists() for f in files_a]
    kept = [f.exists() for f in files_b]
    assert kept == sorted(kept, reverse=True)  # only the oldest went
    assert many.files_scanned == 200 and many.usage_after.percent <= 40


TWO_MILLION = """
import resource, sys
from kvtier_evictor.scan import LruSelection
bound = int(sys.argv[1])
selection = LruSelection(bytes_needed=10**15, files_needed=0, max_files=bound)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for start in range(0, 2_000_000, 4096):
    selection.offer_many([(float(i % 977_123), 4096, f"/v/{i:08x}.kvb", 1, i)
                          for i in range(start, min(start + 4096, 2_000_000))])
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(len(selection), selection.capped, grew // 1024, selection.oldest_first()[0].last_use)
"""


@pytest.mark.timeout(120)
def test_the_candidates_held_stay_under_the_bound_at_two_million_files():
    # Two million offers, every one needed: the selection holds at most its bound, so the
    # evictor's memory does not grow with the tree (at ~350 bytes a candidate, 2M would be
    # ~700 MiB, past the CronJob's 512Mi).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TWO_MILLION, "200000"], capture_output=True,
                         text=True, check=True, timeout=110).stdout.split()
    held, capped, grew_mib, oldest = int(out[0]), out[1], int(out[2]), float(out[3])
    assert held == 200_000 and capped == "True" and oldest == 0.0
    assert grew_mib < 100, f"the selection grew the process by {grew_mib} MiB"


def test_the_files_of_one_directory_are_deleted_through_one_open_chain(tmp_path, monkeypatch):
    """#37: deleting through directory handles must not open the directory chain again
    for every file (on a network filesystem each open is a round trip): twelve files of
    one directory, each directory on the way opened once."""
    from kvtier_evictor import anchored

    leaf = tmp_path / "kvtier" / "v1" / FP / "ab" / "cd"
    files = [write(leaf / f"abcd{key(i)[4:]}.kvb", U, NOW - 3600 * (i + 1)) for i in range(40)]
    opened: list[str] = []
    real_open = os.open

    def counting(path, flags, *args, **kwargs):
        if flags == anchored._BELOW_FLAGS:
            opened.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    report = make_run(tmp_path, capacity=41 * U, threads=1).execute()
    assert report.files_deleted == 12 and sum(not f.exists() for f in files) == 12
    assert sorted(opened) == sorted(["kvtier", "v1", FP, "ab", "cd"]), opened


class OverheadUsage(FilesUsage):
    """A volume that charges each file more than its allocated bytes (GlusterFS: the
    brick's xattr blocks and gfid link come to ~35 KB per 8 KiB file at 5,000 files)."""

    def __init__(self, root: Path, capacity: int, per_file: int) -> None:
        super().__init__(root, capacity)
        self.per_file = per_file

    def __call__(self):
        usage = super().__call__()
        return type(usage)(used_bytes=usage.used_bytes + usage.used_inodes * self.per_file,
                           capacity_bytes=usage.capacity_bytes,
                           used_inodes=usage.used_inodes,
                           capacity_inodes=usage.capacity_inodes)


@pytest.mark.parametrize("ratio", [2, 3, 5, 8])
@pytest.mark.parametrize("threads", [1, 4])
def test_lru_order_holds_where_a_file_frees_more_than_its_size(tmp_path, threads, ratio,
                                                              monkeypatch):
    # 600 files of 16 KiB, each costing the volume `ratio` times its size, one per
    # directory, in path order unrelated to their age. A plan sized on file sizes alone
    # is several times too long; deleted in path order, it stops at the low watermark part
    # way and leaves old files behind while newer ones went. The deleted files must be the
    # oldest ones (issue #37: LRU >= 0.99).
    monkeypatch.setattr(evict, "CHECK_SECONDS", 0.0)  # usage re-read between pieces
    monkeypatch.setattr(evict, "PIECE", 4)
    monkeypatch.setattr(evict, "CALIBRATE_FILES", 100)
    n, per_file = 600, (ratio - 1) * U
    files = [write(kvtier_path(tmp_path, i), U, NOW - 60 * (i + 1)) for i in range(n)]
    capacity = int(n * (U + per_file) / 0.9)  # 90% used
    config = Config(root=str(tmp_path), layout=KVTIER, min_idle_seconds=0,
                    temp_guard_seconds=3600, dir_guard_seconds=600, threads=threads)
    report = Run(config, clock=lambda: NOW,
                 usage_source=OverheadUsage(tmp_path, capacity, per_file)).execute()
    assert report.outcome == FREED
    gone = [i for i, f in enumerate(files) if not f.exists()]
    # file i is older the larger i is: the share of deleted files among the oldest ones
    lru = sum(i >= n - len(gone) for i in gone) / len(gone)
    assert lru >= 0.99, (lru, len(gone))
