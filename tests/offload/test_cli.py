"""`python -m kvtier_offload install` (the init container's command) and `probe`."""

from __future__ import annotations

import os
import subprocess
import sys

from kvtier_offload.cli import main


def test_install_copies_a_package_that_imports_from_the_target(tmp_path):
    target = tmp_path / "site"
    assert main(["install", "--target", str(target)]) == 0
    assert (target / "kvtier_offload" / "store.py").exists()
    assert not list(target.rglob("__pycache__"))
    # it imports from there in a clean interpreter that has no kvtier installed
    env = {"PYTHONPATH": str(target), "PATH": os.environ["PATH"]}
    site = sorted(p for p in sys.path if "site-packages" in p)[0]  # numpy lives there
    code = (f"import sys; sys.path.append({site!r}); import kvtier_offload.layout as m; "
            "print(m.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.startswith(str(target))


def test_install_twice_replaces_cleanly(tmp_path):
    assert main(["install", "--target", str(tmp_path)]) == 0
    assert main(["install", "--target", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvtier_offload"]


def test_probe_measures_and_judges(tmp_path, capsys):
    code = main(["probe", "--path", str(tmp_path), "--block-bytes", str(1 << 20),
                 "--total-bytes", str(8 << 20), "--threads", "2",
                 "--kv-bytes-per-token", "262144", "--prefill-tokens-per-second", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "store" in out and "GB/s" in out and "loading beats recomputing" in out
    assert os.listdir(tmp_path) == []  # the probe cleans up after itself


def test_install_keeps_an_extension_that_fits_this_node(tmp_path, capsys):
    from kvtier_offload import native

    if not native.AVAILABLE:
        import pytest

        pytest.skip(native.REASON)
    assert main(["install", "--target", str(tmp_path)]) == 0
    assert (tmp_path / "kvtier_offload" / "_native.abi3.so").exists()
    assert "refusing" not in capsys.readouterr().err


def test_install_refuses_an_extension_of_another_platform_and_falls_back(tmp_path, capsys,
                                                                         monkeypatch):
    # An image built for the wrong architecture (an amd64 layer on a GH200 node, say): the
    # extension is removed with a clear message, and the Python path still imports.
    import shutil

    from kvtier_offload import cli

    package = tmp_path / "src" / "kvtier_offload"
    shutil.copytree(cli.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    elf = bytearray(64)
    elf[:6] = b"\x7fELF\x02\x01"
    other = 183 if os.uname().machine == "x86_64" else 62
    elf[18:20] = other.to_bytes(2, "little")
    (package / "_native.abi3.so").write_bytes(bytes(elf))
    monkeypatch.setattr(cli, "PACKAGE", package)
    assert main(["install", "--target", str(tmp_path / "site")]) == 0
    err = capsys.readouterr().err
    assert f"refusing its C extension (it is built for ELF machine {other}" in err
    assert "Python path" in err
    assert not (tmp_path / "site" / "kvtier_offload" / "_native.abi3.so").exists()


def test_install_fails_the_init_container_where_no_digest_can_load(tmp_path, capsys,
                                                                  monkeypatch):
    # No extension in the image and no python-xxhash where the backend runs: the init
    # container fails, naming why, instead of a backend that misses every block.
    import shutil

    from kvtier_offload import cli

    package = tmp_path / "src" / "kvtier_offload"
    shutil.copytree(cli.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    monkeypatch.setattr(cli, "PACKAGE", package)
    # The dev install's editable finder would still find the extension by name beside the
    # source tree: turn it off the way an operator can.
    monkeypatch.setenv("KVTIER_OFFLOAD_NATIVE", "0")
    site = tmp_path / "site"
    site.mkdir()
    (site / "xxhash.py").write_text("raise ImportError('no python-xxhash in this image')\n")
    assert main(["install", "--target", str(site)]) == 1
    err = capsys.readouterr().err
    assert "but cannot run" in err
    assert "no block digest: KVTIER_OFFLOAD_NATIVE=0" in err
    assert "python-xxhash is not installed" in err
