"""The README's commands work: every command it shows runs here, or is shown under a
sentence saying it needs a cluster (and then is a kubectl or helm command). `.ci/run`
runs the quick start's commands, in the README's order."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
CLUSTER_TOOLS = {"kubectl", "helm"}


@dataclass(frozen=True)
class Block:
    intro: str  # the paragraph just above the block
    commands: tuple[str, ...]


def _paragraph_above(lines: list[str], i: int) -> str:
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    above: list[str] = []
    while j >= 0 and lines[j].strip() and not lines[j].startswith("    "):
        above.insert(0, lines[j].strip())
        j -= 1
    return " ".join(above)


def code_blocks(text: str) -> list[Block]:
    """The README's indented code blocks, each command without its trailing comment."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            intro, body = _paragraph_above(lines, i), []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i])
                i += 1
            commands = tuple(c for c in (re.sub(r"\s+#.*$", "", b).strip() for b in body) if c)
            blocks.append(Block(intro, commands))
        else:
            i += 1
    return blocks


BLOCKS = code_blocks(README)
NEEDS_CLUSTER = re.compile(r"needs? a (Kubernetes )?cluster", re.I)
LOCAL = [c for b in BLOCKS if not NEEDS_CLUSTER.search(b.intro) for c in b.commands]
CLUSTER = [c for b in BLOCKS if NEEDS_CLUSTER.search(b.intro) for c in b.commands]
INLINE_MAKE = sorted(set(re.findall(r"`(make [^`]+)`", README)))


def test_the_parser_finds_the_quick_start_and_the_cluster_commands():
    assert BLOCKS[0].commands == ("make demo", "make test")
    assert any(c.startswith("helm install kvtier charts/kvtier") for c in CLUSTER)
    assert any(c.startswith("kubectl apply -f examples/") for c in CLUSTER)


@pytest.mark.parametrize("command", CLUSTER)
def test_commands_marked_as_needing_a_cluster_are_cluster_commands(command):
    assert shlex.split(command)[0] in CLUSTER_TOOLS, (
        f"{command!r} sits under 'needs a cluster' but is not a kubectl/helm command")
    for word in shlex.split(command):
        if word.startswith(("examples/", "charts/")):
            assert (ROOT / word).exists(), f"{command!r}: {word} does not exist"


def _run_local(command: str) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    for word in argv:
        if re.fullmatch(r"(examples|charts|docs)/\S+", word.split("=")[-1]):
            assert (ROOT / word.split("=")[-1]).exists(), f"{command!r}: no {word}"
    if argv[0] == "make":
        # A dry run: the target exists and its recipe expands (make demo and make test
        # themselves are what .ci/run runs, checked below).
        return subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=False)
    if argv[0].startswith(".venv/bin/"):
        tool = Path(sys.executable).parent / argv[0].removeprefix(".venv/bin/")
        return subprocess.run([str(tool), *argv[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=False)
    raise AssertionError(f"the README shows {command!r}, which this test cannot check: run "
                         "it here, or put it under a sentence saying it needs a cluster")


@pytest.mark.parametrize("command", LOCAL + INLINE_MAKE)
@pytest.mark.slow
def test_every_local_command_runs(command):
    result = _run_local(command)
    assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stderr}"
    assert result.stdout.strip(), f"{command!r} printed nothing"


def test_ci_runs_the_quick_start_in_order():
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert steps == list(BLOCKS[0].commands)
