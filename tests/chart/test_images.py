"""The images, as far as a machine without a Docker engine can test them: pinned,
non-root bases, and the Dockerfiles' install steps run in a fresh virtualenv."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCKERFILES = [ROOT / "Dockerfile", ROOT / "offload" / "Dockerfile"]
pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dockerfile_is_pinned_and_non_root(path):
    text = path.read_text()
    for base in re.findall(r"^FROM\s+(\S+)", text, re.M):
        assert re.search(r":\d+\.\d+\.\d+", base), f"{base} is not pinned to a version"
        assert "latest" not in base
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert not re.search(r"^ADD\s+https?://", text, re.M)


def source_copy(dest: Path) -> Path:
    """What the Dockerfile's build stage copies in, so a build writes nothing (egg-info,
    build/) into the working tree."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.so")
    for name in ("pyproject.toml", "README.md", "setup.py"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    for name in ("operator", "offload", "evictor"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def operator_wheel(tmp_path_factory) -> Path:
    """The wheel the operator Dockerfile's build stage makes (pip wheel of the source)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    wheels = tmp_path / "wheels"
    src = source_copy(tmp_path / "src")
    # The dev environment has setuptools: building with it skips fetching a fresh one.
    isolation = [] if importlib.util.find_spec("setuptools") is None else [
        "--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *isolation,
                    "-w", str(wheels), str(src)], check=True, timeout=300)
    (wheel,) = wheels.glob("kvtier-*.whl")
    return wheel


def test_the_operator_wheel_holds_the_three_packages_and_not_the_demo(operator_wheel):
    """The operator image installs this wheel and nothing else: no kvtier_demo (the demo
    and test harness, which needs kmock), no C sources as a package."""
    with zipfile.ZipFile(operator_wheel) as wheel:
        names = wheel.namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"kvtier_operator", "kvtier_offload", "kvtier_evictor",
                   "-".join(operator_wheel.name.split("-")[:2]) + ".dist-info"}, sorted(top)
    assert not [name for name in names if "kvtier_demo" in name]
    assert "kvtier_operator/cli.py" in names and "kvtier_operator/py.typed" in names


def test_the_operator_image_installs_only_the_wheel():
    """The image's last stage takes nothing from the source tree: only the wheels."""
    stages = re.split(r"^FROM\s", (ROOT / "Dockerfile").read_text(), flags=re.M)
    final = stages[-1]
    assert re.findall(r"^(?:COPY|ADD)\s.*$", final, re.M) == ["COPY --from=build /wheels /wheels"]
    # events: the evictor CronJob runs this image and publishes BlockRemoved (pyzmq, msgspec)
    assert "'kvtier[operator,events]'" in final and "--no-index" in final


def test_operator_image_install_steps_in_a_virtualenv(tmp_path, operator_wheel):
    """The build stage wheels the project; the evictor must then run with no dependencies
    at all (it is stdlib only), as the CronJob runs it from the operator image; the demo
    harness is not there to import."""
    wheel = operator_wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-deps", str(wheel)], check=True, timeout=300)
    evictor = venv / "bin" / "kvtier-evictor"
    assert (venv / "bin" / "kvtier").exists()
    help_text = subprocess.run([str(evictor), "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "--termination-log" in help_text
    run = subprocess.run([str(evictor), "--root", str(tmp_path / "missing")],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 1 and '"outcome":"error"' in run.stdout
    python = venv / "bin" / "python"
    for package, present in (("kvtier_evictor", True), ("kvtier_demo", False)):
        found = subprocess.run([str(python), "-I", "-c",
                                f"import importlib.util as u; print(u.find_spec({package!r}))"],
                               capture_output=True, text=True, check=True, cwd=tmp_path).stdout
        assert (found.strip() != "None") is present, (package, found)


def test_offload_image_entrypoint_installs_the_backend(tmp_path):
    """The offload image runs `python3 -m kvtier_offload install --target DIR` from a
    copy of offload/kvtier_offload on PYTHONPATH (see offload/Dockerfile)."""
    text = (ROOT / "offload" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python3", "-m", "kvtier_offload"]' in text
    assert "COPY offload/kvtier_offload /opt/kvtier/src/kvtier_offload" in text
    src = tmp_path / "opt-src"
    shutil.copytree(ROOT / "offload" / "kvtier_offload", src / "kvtier_offload")
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "kvtier_offload", "install", "--target",
                          str(target)], env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin",
                               "NUMBA_DISABLE_JIT": "1"},
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (target / "kvtier_offload" / "vllm_tier.py").exists()
