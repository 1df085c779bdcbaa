"""SGLang command lines: the entry points kvtier recognises, the flags it reads, and the
flags it adds in `--flag=value` form (render/sglang_entry.py, render/sglang_flags.py).

Edited command lines are run under a real shell with stub `sglang`/`python3`/`python`
programs that record their argv, so what SGLang would receive is checked, not the text.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtier_operator.engines.cmdline import shell
from kvtier_operator.engines.sglang.entry import (
    entry_point_end,
    mention_offsets,
    mentions_entry_point,
)
from kvtier_operator.engines.sglang.flags import Flag, Forbidden, add_flags, existing_flags
from kvtier_operator.engines.vllm.entry import ENTRY_POINT as VLLM_ENTRY
from tests.operator.unit.test_inject_hostile import kube_expand

FLAGS = [
    Flag("--enable-hierarchical-cache", None, "spec.cpu", aliases=("--enable-hicache",)),
    Flag("--hicache-size", "25", "spec.cpu.size"),
    Flag("--hicache-write-policy", "write_through", "spec.sglang.writePolicy"),
    Flag("--page-size", "64", "spec.sglang.pageSize"),
    Flag("--hicache-storage-backend", "file", "spec.storage"),
]
WORDS = ["--enable-hierarchical-cache", "--hicache-size=25",
         "--hicache-write-policy=write_through", "--page-size=64",
         "--hicache-storage-backend=file"]
EXTRA = Forbidden("--hicache-storage-backend-extra-config", "its max_size would turn on "
                  "SGLang's own evictor")
MARK = "PWNED"


@pytest.mark.parametrize(("words", "end"), [
    (["sglang", "serve", "m"], 1),
    (["/usr/local/bin/sglang", "serve"], 1),
    (["python3", "-m", "sglang.launch_server", "--model-path", "m"], 2),
    (["python", "-u", "-m", "sglang.launch_server"], 3),
    (["python3.12", "-m", "sglang.launch_server"], 2),
    (["/opt/venv/bin/python3", "-B", "-u", "-m", "sglang.launch_server"], 4),
    (["sglang"], None),
    (["sglang", "generate"], None),
    (["sglang", "version"], None),
    (["python3", "-m", "sglang.launch_server_v2"], None),
    (["python3", "-m", "sglang.cli.main", "serve"], None),  # no __main__ there: runs nothing
    (["python3", "-c", "import sglang.launch_server"], None),
    (["python3", "launch_server.py"], None),
    (["vllm", "serve", "m"], None),
    (["mysglang", "serve"], None),
], ids=lambda v: str(v))
def test_entry_points(words, end):
    assert entry_point_end(words, 0) == end


def test_mentions():
    text = ("sglang serve m; python3 -m sglang.launch_server; 'sglang' \"serve\"; "
            "sglang\\\n serve; sglang.launch_server_x; sglang servers; sglang-router; "
            "sglang.srt")
    starts = [i for i in range(len(text)) if text.startswith("sglang", i)][:4]
    assert mention_offsets(text) == starts
    assert not mentions_entry_point("sglang-router --port 1; pip install sglang; sglang version")


def container(command: list[str] | None, args: list[str] | None = None,
              env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "sglang", "image": "lmsysorg/sglang:v0.5.23"}
    if command is not None:
        c["command"] = command
    if args is not None:
        c["args"] = args
    if env is not None:
        c["env"] = env
    return c


LLMD_ARGS = ["--model-path=Qwen/Qwen3-32B", "--tensor-parallel-size=2", "--port=8000",
             "--enable-metrics"]


@pytest.mark.parametrize(("command", "args"), [
    (["python3", "-m", "sglang.launch_server"], LLMD_ARGS),
    (["sglang", "serve"], ["Qwen/Qwen3-32B", "--tp=2"]),
    (["sglang", "serve", "Qwen/Qwen3-32B"], None),
    (["tini", "--", "python3", "-m", "sglang.launch_server"], ["--model-path", "m"]),
    (["env", "A=1", "sglang", "serve", "m"], None),
], ids=["llm-d", "serve-args", "serve-command", "tini", "env"])
def test_exec_form_gets_the_flags_appended(command, args):
    c = container(command, args)
    assert add_flags(c, FLAGS) == []
    assert c["command"] == command
    assert c["args"] == [*(args or []), *WORDS]
    assert existing_flags(c, FLAGS) == ({
        "--enable-hierarchical-cache": None, "--hicache-size": "25",
        "--hicache-write-policy": "write_through", "--page-size": "64",
        "--hicache-storage-backend": "file"}, [])


def test_flags_already_given_with_the_same_value_stay_as_written():
    args = ["--model-path", "m", "--enable-hicache", "--hicache-size", "25", "--page-size=064"]
    c = container(["python3", "-m", "sglang.launch_server"], list(args))
    assert add_flags(c, FLAGS) == []
    assert c["args"] == [*args, "--hicache-write-policy=write_through",
                         "--hicache-storage-backend=file"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--page-size=32"], "passes --page-size=32; kvtier needs --page-size=64 (from "
                         "spec.sglang.pageSize)"),
    (["--page-size", "16"], "passes --page-size=16"),
    (["--hicache-size=25", "--hicache-size=40"], "passes --hicache-size=40"),  # last wins
    (["--hicache-storage-backend=mooncake"], "--hicache-storage-backend=file"),
    (["--hicache-write-policy", "write_back"], "write_back"),
    (["--page-si=64"], "abbreviation of --page-size: write the flag in full"),
    (["--hicache-storage-backend-e", "{}"], "abbreviation of --hicache-storage-backend-extra"),
    (["--hicache-storage-backend-extra-config={\"max_size\":\"1G\"}"],
     "its max_size would turn on SGLang's own evictor"),
    (["--config", "/etc/sglang.yaml"], "--config: it merges flags from a file"),
    (["--enable-hierarchical-cache=true"], "takes no value"),
    (["--page-size"], "--page-size without a value"),
    (["--page-size", "--port=1"], "--page-size without a value"),
    (["--page-size=$(PAGE)"], "a value kvtier cannot read"),
    (["--served-model-name=x--page-size"], None),  # glued: not a flag, not a mention
    (["--served-model-name", "a --page-size=3"], "where kvtier cannot read it"),
    (["m", "--", "--port=1"], "passes '--' to SGLang"),
], ids=lambda v: str(v)[:40])
def test_user_flags_that_disagree_are_problems_and_nothing_changes(args, needle):
    c = container(["sglang", "serve"], list(args), env=[{"name": "PAGE", "value": "64"}])
    before = copy.deepcopy(c)
    problems = add_flags(c, FLAGS, forbidden=(EXTRA, Forbidden("--config", "it merges flags "
                                                              "from a file")))
    if needle is None:
        assert problems == []
        return
    assert problems and any(needle in p for p in problems), problems
    assert c == before


def test_a_value_kvtier_would_write_must_be_plain():
    for value in ("25; touch x", "$(HF_TOKEN)", "a b", "'x'", "x\n", "`id`", ""):
        c = container(["sglang", "serve", "m"])
        problems = add_flags(c, [Flag("--hicache-size", value, "spec.cpu.size")])
        assert problems and "spec.cpu.size must be a plain value" in problems[0]
        assert "args" not in c


# ---------------------------------------------------------------- sh -c scripts

@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stubs")
    for program in ("sglang", "python3", "python"):
        stub = root / program
        stub.write_text('#!/bin/sh\nprintf \'%s\\0\' "$0" "$@" > "$STUB_CALLS/call.$$"\n')
        stub.chmod(0o755)
    return root


def run(c: dict[str, Any], stubs: Path, workdir: Path) -> list[list[str]]:
    env = {e["name"]: kube_expand(e.get("value", ""), {}) for e in c.get("env") or []}
    words = [kube_expand(str(w), env) for w in (c.get("command") or []) + (c.get("args") or [])]
    calls = workdir / "calls"
    calls.mkdir()
    subprocess.run(words, cwd=workdir, timeout=20, check=False, stdin=subprocess.DEVNULL,
                   capture_output=True, env={**env, "PATH": f"{stubs}:/usr/bin:/bin",
                                             "STUB_CALLS": str(calls), "HOME": str(workdir)})
    return [f.read_bytes().decode().split("\0")[:-1] for f in sorted(calls.iterdir())]


SCRIPTS_EDITED = [
    ("one-line", ["sh", "-c", "exec python3 -m sglang.launch_server --model-path m"], None),
    ("serve", ["bash", "-c"], ["exec sglang serve m --port 8000"]),
    ("multi-line", ["/bin/bash", "-ec"],
     ["set -e\nexport SGLANG_LOG=1\n# sglang serve is started below\n"
      "exec python3 -m sglang.launch_server \\\n  --model-path=m \\\n  --tp=2\n"]),
    ("pipe", ["bash", "-o", "pipefail", "-c", "sglang serve m 2>&1 | cat"], None),
    ("env-model", ["sh", "-c", 'exec sglang serve "$MODEL" --port=8000'], None),
    ("given-already", ["sh", "-c", "exec sglang serve m --page-size=64 --enable-hicache"],
     None),
]


@pytest.mark.parametrize("shape", SCRIPTS_EDITED, ids=[s[0] for s in SCRIPTS_EDITED])
def test_scripts_are_edited_and_sglang_gets_each_flag_once(shape, stubs, tmp_path):
    _, command, args = shape
    c = container(copy.deepcopy(command), copy.deepcopy(args),
                  env=[{"name": "MODEL", "value": "m"}])
    assert add_flags(c, FLAGS) == []
    calls = run(c, stubs, tmp_path)
    assert len(calls) == 1, calls
    argv = calls[0]
    start = argv.index("serve") + 1 if "serve" in argv else argv.index(
        "sglang.launch_server") + 1
    values, problems = existing_flags(container(["sglang", "serve"], argv[start:]), FLAGS)
    assert problems == []
    assert values == {"--enable-hierarchical-cache": None, "--hicache-size": "25",
                      "--hicache-write-policy": "write_through", "--page-size": "64",
                      "--hicache-storage-backend": "file"}
    for word in WORDS[1:]:  # each once, in --flag=value form
        name = word.split("=")[0]
        assert sum(a.split("=")[0] == name for a in argv) == 1, argv


SCRIPTS_REFUSED = [
    ("quoted-flag", ["sh", "-c", 'exec sglang serve m "--page-size=32"'],
     "where kvtier cannot read it"),
    ("flag-in-variable", ["sh", "-c", "exec sglang serve m --page-size=$PAGE"],
     "where kvtier cannot read it"),
    ("value-in-variable", ["sh", "-c", "exec sglang serve m --page-size $PAGE"],
     "a value kvtier cannot read"),
    ("echo-first", ["sh", "-c", 'echo "sglang serve"; exec sglang serve m'],
     "also mentions SGLang's entry point"),
    ("nested-sh", ["sh", "-c", "sh -c 'exec sglang serve m'"], "only where kvtier cannot"),
    ("two-servers", ["sh", "-c", "sglang serve a || sglang serve b"], "starts SGLang in 2"),
    ("after-keyword", ["sh", "-c", "if true; then exec sglang serve m; fi"],
     "only where kvtier cannot"),
    ("backticks", ["sh", "-c", "exec sglang serve `cat /m`"], "backtick"),
    ("heredoc", ["sh", "-c", "cat <<EOF\nx\nEOF\nexec sglang serve m"], "here-document"),
    ("kube-reference", ["sh", "-c", "exec sglang serve $(MODEL) --port 1"],
     "which Kubernetes rewrites"),
    ("no-sglang", ["sh", "-c", "exec vllm serve m"], "does not start SGLang"),
    ("unknown-shell-option", ["bash", "--rcfile", "x", "-c", "exec sglang serve m"], "not one kvtier knows"),
    ("hostile-comment-flag", ["sh", "-c", "exec sglang serve m # --page-size=1"],
     "where kvtier cannot read it"),
]


@pytest.mark.parametrize("shape", SCRIPTS_REFUSED, ids=[s[0] for s in SCRIPTS_REFUSED])
def test_scripts_kvtier_cannot_read_are_refused_unchanged(shape):
    _, command, needle = shape
    c = container(copy.deepcopy(command), env=[{"name": "MODEL", "value": "m"}])
    before = copy.deepcopy(c)
    problems = add_flags(c, FLAGS)
    assert problems and needle in problems[0], problems
    assert c == before


HOSTILE_VALUES = [f"1;touch {MARK}", f"$(touch {MARK})", f"`touch {MARK}`",
                  f"1\ntouch {MARK}", f"1 && touch {MARK}", f"'; touch {MARK}; '",
                  "$(HF_TOKEN)", f"$${{IFS}}touch$${{IFS}}{MARK}"]


@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_hostile_values_never_reach_the_script(value, stubs, tmp_path):
    c = container(["sh", "-c", "exec sglang serve m"], env=[{"name": "HF_TOKEN",
                                                             "value": "secret"}])
    problems = add_flags(c, [Flag("--hicache-size", value, "spec.cpu.size")])
    assert problems  # refused, not quoted
    assert c["command"] == ["sh", "-c", "exec sglang serve m"]
    run(c, stubs, tmp_path)
    assert not (tmp_path / MARK).exists()


def test_script_scanner_still_reads_vllm_by_default():
    found = shell.find_entry_point("exec vllm serve m --port 1", VLLM_ENTRY)
    assert found.insert_at == len("exec vllm serve m --port 1")
    assert found.args == ("m", "--port", "1")
    assert shell.find_entry_point("exec sglang serve m", VLLM_ENTRY).problem == (
        "the script does not start vLLM itself")


@pytest.mark.parametrize("container", [
    # exec form: the kubelet expands $(EXTRA) into one argv word, the flag itself
    {"command": ["python3", "-m", "sglang.launch_server"], "args": ["--model-path=m", "$(EXTRA)"]},
    # sh -c: the shell splits an unquoted $EXTRA into words
    {"command": ["sh", "-c", "exec sglang serve m $EXTRA"]},
])
def test_a_managed_flag_hidden_in_an_env_value_is_a_problem(container):
    """A managed or refused flag in an env var's value may reach SGLang's command line
    through an expansion kvtier cannot read: refused, naming the env var."""
    container = {"name": "s", **container, "env": [{
        "name": "EXTRA", "value": '--hicache-storage-backend-extra-config={"max_size":"1G"}'}]}
    flags = [Flag("--page-size", "64", "spec.sglang.pageSize")]
    forbidden = [Forbidden("--hicache-storage-backend-extra-config", "no")]
    before = copy.deepcopy(container)
    problems = add_flags(container, flags, forbidden)
    assert any("EXTRA" in p and "--hicache-storage-backend-extra-config" in p
               for p in problems), problems
    assert container == before
    # An env var that mentions no managed flag is fine.
    container["env"][0]["value"] = "--trust-remote-code"
    assert add_flags(container, flags, forbidden) == []
