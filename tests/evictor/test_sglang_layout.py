"""The evictor's `sglang` layout: SGLang's HiCache file tier (flat `<sha256>_<suffix>.bin`
pages and `.<uuid4 hex>.tmp` temp files under <root>/sglang). Only those are ever
deleted; everything else on the volume is foreign."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from kvtier_evictor import cli
from kvtier_evictor.layouts import LAYOUTS, SGLANG, Kind
from kvtier_evictor.lock import LOCK_NAME
from kvtier_evictor.report import FREED, NOTHING_TO_DO
from tests.evictor.test_evictor import NOW, U, make_run
from tests.evictor.tree import key, kvtier_path, sglang_path, vllm_fs_path, write

ANCIENT = NOW - 10**6
HASH = key(1)

# Names SGLang 0.5.23's HiCacheFile writes (hicache_storage.py: key + config suffix).
SGLANG_PAGE_NAMES = [
    f"{HASH}_Qwen-Qwen3-0.6B_0_1.bin",  # TP 1
    f"{HASH}_meta-llama-Llama-3.1-8B-Instruct_3_8.bin",  # TP rank 3 of 8
    f"{HASH}_deepseek-ai-DeepSeek-V3.bin",  # MLA: one file for all TP ranks
    f"{HASH}_Qwen-Qwen3-32B_1_2_4_0.bin",  # PP 4, rank 0
    f"{HASH}_m_0_2_cp1_2.bin",  # attention context parallel
    f"{HASH}_m_tp8_dcp0_2_page64.bin",  # MLA with DCP
    f"{HASH}.mamba_Qwen-Qwen3-Next_0_1.bin",  # a pool page (mamba state)
    f"{HASH}.swa_google-gemma-3_0_1.bin",
    f"{HASH}_Qwen-Qwen3-0.6B-unified-token-major_0_1.bin",  # host pool format tag
    f"{HASH}__0_1.bin",  # no served model name
    f"{HASH}_my model.v2_0_1.bin",  # a served model name with a space and a dot
]

# Test ids are built at collection: every pytest-xdist worker must build the same ones.
FIXED_UUID = "3f47c128db704d99a6c984f446cb135c"


@pytest.mark.parametrize("name", SGLANG_PAGE_NAMES)
def test_sglang_page_names_are_blocks(name):
    assert SGLANG.classify(name) is Kind.BLOCK


def test_sglang_temp_name_is_uuid4_hex():
    assert SGLANG.classify(f".{uuid.uuid4().hex}.tmp") is Kind.TEMP


@pytest.mark.parametrize("name", [
    f"{HASH}.bin",  # no suffix: not a name HiCacheFile writes
    f"{HASH[:63]}_m_0_1.bin",  # 63 hex digits
    f"{HASH}0_m_0_1.bin",  # 65 hex digits
    f"{HASH.upper()}_m_0_1.bin",  # SGLang writes lowercase hex
    f"{HASH}_m_0_1.bin\n",  # a trailing newline
    f"{HASH}_m\n_0_1.bin",  # a control character in the model part
    f"{HASH}_m_0_1.bin.bak",
    f"{HASH}_m_0_1.kvb",
    f"{HASH}.MAMBA_m_0_1.bin",
    f".{HASH}_m_0_1.bin",
    f".{FIXED_UUID}.tmp\n",
    f".{FIXED_UUID[:31]}.tmp",
    f"{FIXED_UUID}.tmp",  # no leading dot
    f".{FIXED_UUID}.tmp.1",
    LOCK_NAME,
    "config.json",
])
def test_other_names_are_foreign(name):
    assert SGLANG.classify(name) is None


def test_only_the_sglang_directory_is_the_layout():
    assert SGLANG.dir_matches(0, "sglang")
    for name in ("sglang\n", "SGLang", "sglang2", "hicache", ".sglang"):
        assert not SGLANG.dir_matches(0, name)
    assert LAYOUTS["sglang"] is SGLANG


def sglang_tree(root, n: int = 10):
    # page i last used i hours ago: page n-1 is the oldest
    return [write(sglang_path(root, i), U, NOW - 3600 * (i + 1)) for i in range(n)]


def test_below_high_watermark_does_nothing(tmp_path):
    pages = sglang_tree(tmp_path)
    report = make_run(tmp_path, capacity=20 * U, layout=SGLANG).execute()  # 50%
    assert report.outcome == NOTHING_TO_DO
    assert all(p.exists() for p in pages)


def test_deletes_least_recently_used_pages_until_below_low(tmp_path):
    pages = sglang_tree(tmp_path)
    report = make_run(tmp_path, capacity=11 * U, layout=SGLANG).execute()  # 90.9% > 85
    assert report.outcome == FREED
    # below 70% of 11 units = 7.7 units: the 3 oldest pages go
    assert [p.exists() for p in pages] == [True] * 7 + [False] * 3
    assert report.layout == "sglang" and report.files_scanned == 10
    assert report.usage_after.percent < 70


def test_atime_refreshed_by_a_hit_and_min_idle_protect_a_page(tmp_path):
    pages = sglang_tree(tmp_path)
    os.utime(pages[-1], (NOW - 60 * 20, pages[-1].stat().st_mtime))  # read 20 min ago
    os.utime(pages[-2], (NOW - 60, NOW - 60))  # rewritten a minute ago
    make_run(tmp_path, capacity=11 * U, layout=SGLANG).execute()
    assert pages[-1].exists() and pages[-2].exists()
    assert [p.exists() for p in pages[:-2]] == [True] * 5 + [False] * 3


def test_foreign_files_are_never_touched(tmp_path):
    sglang_tree(tmp_path)
    d = tmp_path / "sglang"
    foreign = [
        write(tmp_path / f"{key(2)}_Qwen-Qwen3-0.6B_0_1.bin", 2 * U, ANCIENT),  # not in sglang/
        write(tmp_path / "other" / f"{key(3)}_Qwen-Qwen3-0.6B_0_1.bin", 2 * U, ANCIENT),
        write(d / "nested" / f"{key(4)}_Qwen-Qwen3-0.6B_0_1.bin", 2 * U, ANCIENT),
        write(d / f"{key(5)}.bin", 2 * U, ANCIENT),
        write(d / f"{key(6)}_Qwen-Qwen3-0.6B_0_1.bin\n", 2 * U, ANCIENT),
        write(d / f"{key(7)}_Qwen-Qwen3-0.6B_0_1.bin.bak", 2 * U, ANCIENT),
        write(d / "notes.txt", 2 * U, ANCIENT),
        write(tmp_path / "sglang\n" / f"{key(8)}_Qwen-Qwen3-0.6B_0_1.bin", 2 * U, ANCIENT),
        write(kvtier_path(tmp_path, 9), 2 * U, ANCIENT),
        write(vllm_fs_path(tmp_path, 10), 2 * U, ANCIENT),
        write(tmp_path / "lmcache" / "model@1@0@abc@bfloat16.pt", 2 * U, ANCIENT),
    ]
    target = tmp_path / "elsewhere.bin"
    write(target, 2 * U, ANCIENT)
    link = sglang_path(tmp_path, 500)
    link.symlink_to(target)
    os.utime(link, (ANCIENT, ANCIENT), follow_symlinks=False)
    report = make_run(tmp_path, capacity=20 * U, layout=SGLANG).execute()  # way over
    assert all(f.exists() for f in foreign), "a foreign file was deleted"
    assert link.is_symlink() and target.exists()
    assert report.files_deleted == 10  # every SGLang page, and nothing else
    assert d.is_dir()  # the storage directory itself stays, empty or not


def test_other_layouts_leave_sglang_pages_alone(tmp_path):
    pages = [write(sglang_path(tmp_path, i), U, ANCIENT) for i in range(4)]
    for name in ("kvtier", "vllm-fs", "lmcache"):
        make_run(tmp_path, capacity=2 * U, layout=LAYOUTS[name]).execute()
    assert all(p.exists() for p in pages)


def test_reaps_stale_temps_but_not_fresh_ones(tmp_path):
    sglang_tree(tmp_path)
    d = tmp_path / "sglang"
    stale = write(d / f".{uuid.uuid4().hex}.tmp", U // 2, NOW - 7200)
    fresh = write(d / f".{uuid.uuid4().hex}.tmp", U // 2, NOW - 60)
    odd = write(d / f".{uuid.uuid4().hex}.tmp.keep", U // 2, ANCIENT)
    outside = write(tmp_path / f".{uuid.uuid4().hex}.tmp", U // 2, ANCIENT)
    report = make_run(tmp_path, capacity=12 * U, layout=SGLANG).execute()
    assert not stale.exists() and fresh.exists() and odd.exists() and outside.exists()
    assert report.temp_files_reaped == 1


def test_stale_temps_alone_are_reaped_over_the_watermark(tmp_path):
    d = tmp_path / "sglang"
    temps = [write(d / f".{uuid.uuid4().hex}.tmp", U, NOW - 7200) for _ in range(4)]
    report = make_run(tmp_path, capacity=4 * U, layout=SGLANG).execute()
    assert report.temp_files_reaped == 4 and not any(t.exists() for t in temps)


def test_cli_runs_the_sglang_layout_in_budget_mode(tmp_path, capsys):
    past = time.time() - 10**6  # the CLI runs on the real clock
    pages = [write(sglang_path(tmp_path, i), U, past + i) for i in range(10)]
    keep = write(tmp_path / "sglang" / "README", U, past)
    code = cli.main(["--root", str(tmp_path), "--layout", "sglang",
                     "--capacity-bytes", str(11 * U), "--min-idle-seconds", "0",
                     "--ok-exit-zero"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "sglang"
    assert [p.exists() for p in pages] == [False] * 3 + [True] * 7
    assert keep.exists()
