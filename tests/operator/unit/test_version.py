"""One version: kvtier_operator.__version__. Everything that cannot read it is a copy,
and a copy that drifts fails here."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import yaml

import kvtier_evictor
import kvtier_offload
from kvtier_operator import __version__
from kvtier_operator.context import DEFAULT_OFFLOAD_IMAGE, DEFAULT_OPERATOR_IMAGE
from tests.helpers import ROOT


def test_the_version_is_a_release_number():
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_pyproject_reads_the_version_from_the_operator_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "kvtier_operator.__version__"}


def test_the_chart_and_its_images_carry_the_version():
    chart = yaml.safe_load((ROOT / "charts" / "kvtier" / "Chart.yaml").read_text())
    assert str(chart["version"]) == __version__, "bump charts/kvtier/Chart.yaml version"
    assert str(chart["appVersion"]) == __version__, "bump charts/kvtier/Chart.yaml appVersion"
    values = yaml.safe_load((ROOT / "charts" / "kvtier" / "values.yaml").read_text())
    for image in ("image", "offloadImage"):
        assert values[image]["tag"] == "", f"values.yaml {image}.tag must default to appVersion"


def test_the_other_packages_and_the_default_images_carry_the_version():
    assert kvtier_evictor.__version__ == __version__, "bump kvtier_evictor.__version__"
    assert kvtier_offload.__version__ == __version__, "bump kvtier_offload.__version__"
    assert DEFAULT_OPERATOR_IMAGE.endswith(f":{__version__}")
    assert DEFAULT_OFFLOAD_IMAGE.endswith(f":{__version__}")


def test_make_images_tags_with_the_version():
    out = subprocess.run(["make", "-s", "-n", "--no-print-directory", "images",
                          f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                         text=True, check=False).stdout
    assert f"kvtier-operator:{__version__}" in out and f"kvtier-offload:{__version__}" in out
