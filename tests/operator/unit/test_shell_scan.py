"""The shell reader injection relies on: shell options, the script scanner, mentions of
vLLM's entry point, the kubelet's rewrites; and how fast a huge script is classified."""

from __future__ import annotations

import time

import pytest

from kvtier_operator.context import RenderContext
from kvtier_operator.engines.cmdline import kube_expansion, shell
from kvtier_operator.engines.cmdline.argv import program_start
from kvtier_operator.engines.vllm import entry as vllm_entry
from kvtier_operator.engines.vllm.entry import ENTRY_POINT as VLLM_ENTRY
from kvtier_operator.render.pod import inject
from kvtier_operator.validation import parse_tpc
from tests.helpers import tpc_doc, vllm_pod

CTX = RenderContext(offload_image="reg/kvtier-offload:1", evictor_image="reg/kvtier:1")
OPTION = " OPT"


def edited(script: str) -> str:
    """script with OPTION where the scanner says options go; fails if it refuses."""
    found = shell.find_entry_point(script, VLLM_ENTRY)
    assert found.insert_at is not None, found.problem
    return script[:found.insert_at] + OPTION + script[found.insert_at:]


def problem(script: str) -> str:
    found = shell.find_entry_point(script, VLLM_ENTRY)
    assert found.insert_at is None, f"edited at {found.insert_at}"
    assert found.problem
    return found.problem


# ------------------------------------------------------------ shell options

@pytest.mark.parametrize(("words", "script_at"), [
    (["sh", "-c", "s"], 2),
    (["/bin/bash", "-c", "s", "name", "arg"], 2),
    (["bash", "-lc", "s"], 2),
    (["bash", "-ec", "s"], 2),
    (["sh", "-e", "-c", "s"], 3),
    (["sh", "-xe", "-c", "s"], 3),
    (["sh", "-c", "-e", "s"], 3),
    (["bash", "-o", "pipefail", "-c", "s"], 4),
    (["bash", "-eo", "pipefail", "-c", "s"], 4),
    (["bash", "--login", "-c", "s"], 3),
    (["sh", "-c", "--", "s"], 3),
    (["dash", "-c", "s"], 2),
    (["zsh", "-c", "s"], 2),
    (["ash", "-c", "s"], 2),
    (["sh", "run.sh"], None),  # a script file, not -c
    (["sh"], None),
    (["python3", "-c", "s"], None),
    (["vllm", "serve", "m"], None),
])
def test_script_index(words, script_at):
    assert shell.script_index(words, 0) == script_at


@pytest.mark.parametrize(("words", "needle"), [
    (["bash", "--rcfile", "f", "-c", "s"], "--rcfile is not one kvtier knows"),
    (["bash", "-oe", "x", "-c", "s"], "cannot tell which word"),
    (["sh", "-c"], "has no script"),
    (["sh", "-o"], "has no argument"),
    (["sh", "+c", "s"], "is not -c"),
])
def test_script_index_refuses_what_it_cannot_read(words, needle):
    found = shell.script_index(words, 0)
    assert isinstance(found, str) and needle in found


def test_script_index_after_a_launcher():
    words = ["tini", "--", "sh", "-c", "s"]
    assert shell.script_index(words, program_start(words)) == 4


# ------------------------------------------------------------ the scanner: edits

@pytest.mark.parametrize(("script", "expected"), [
    ("vllm serve m", "vllm serve m OPT"),
    ("exec vllm serve m", "exec vllm serve m OPT"),
    ("exec vllm serve", "exec vllm serve OPT"),
    ("exec /usr/local/bin/vllm serve m", "exec /usr/local/bin/vllm serve m OPT"),
    ("exec vllm  \t serve\tm", "exec vllm  \t serve\tm OPT"),
    ("set -e\nexec vllm serve m\n", "set -e\nexec vllm serve m OPT\n"),
    ("pip list; vllm serve m", "pip list; vllm serve m OPT"),
    ("true && vllm serve m || exit 1", "true && vllm serve m OPT || exit 1"),
    ("vllm serve m & wait", "vllm serve m OPT & wait"),
    ("vllm serve m 2>&1 | tee /tmp/log", "vllm serve m OPT 2>&1 | tee /tmp/log"),
    ("vllm serve>log", "vllm serve OPT>log"),
    ("exec >/tmp/log 2>&1\nexec vllm serve m", "exec >/tmp/log 2>&1\nexec vllm serve m OPT"),
    ("A=1 B='x y' exec vllm serve m", "A=1 B='x y' exec vllm serve m OPT"),
    ("VLLM_LOGGING_LEVEL=DEBUG vllm serve m", "VLLM_LOGGING_LEVEL=DEBUG vllm serve m OPT"),
    # the model stays the first word after serve (vLLM 0.32 insists with
    # --served-model-name); options go after the command's last word
    ("exec vllm serve m --served-model-name x", "exec vllm serve m --served-model-name x OPT"),
    ("vllm serve m >log 2>&1 --port 1", "vllm serve m >log 2>&1 --port 1 OPT"),
    # continuation lines
    ("exec vllm serve \\\n  m \\\n  --port 8000\n", "exec vllm serve \\\n  m \\\n  --port 8000 OPT\n"),
    ("exec vllm \\\n  serve m", "exec vllm \\\n  serve m OPT"),
    # comments are understood and ignored
    ("# start vllm serve below\nexec vllm serve m", "# start vllm serve below\nexec vllm serve m OPT"),
    ("exec vllm serve m # not 'vllm serve'", "exec vllm serve m OPT # not 'vllm serve'"),
    ("echo a;# vllm serve\nvllm serve m", "echo a;# vllm serve\nvllm serve m OPT"),
    # quotes, escapes and expansions before and after
    ("echo 'it''s' \"a \\\"b\\\" $HOME ${PORT:-8000} $1 $@ $$\"; exec vllm serve m",
     "echo 'it''s' \"a \\\"b\\\" $HOME ${PORT:-8000} $1 $@ $$\"; exec vllm serve m OPT"),
    ('H=$(hostname -i); exec vllm serve m --host "$H"',
     'H=$(hostname -i); exec vllm serve m --host "$H" OPT'),
    ('X="$(echo "$(date)")"; vllm serve m', 'X="$(echo "$(date)")"; vllm serve m OPT'),
    ("exec vllm serve m --name 'a;b' \"c d\" \\; x", "exec vllm serve m --name 'a;b' \"c d\" \\; x OPT"),
    ("echo a#b\nvllm serve m", "echo a#b\nvllm serve m OPT"),
    ("echo { x }; vllm serve m", "echo { x }; vllm serve m OPT"),
    # python module forms
    ("exec python3 -m vllm.entrypoints.openai.api_server --model m",
     "exec python3 -m vllm.entrypoints.openai.api_server --model m OPT"),
    ("python -u -m vllm.entrypoints.cli.main serve m",
     "python -u -m vllm.entrypoints.cli.main serve m OPT"),
    ("exec python3.12 -m vllm.entrypoints.openai.api_server",
     "exec python3.12 -m vllm.entrypoints.openai.api_server OPT"),
])
def test_scanner_edits_the_one_entry_point(script, expected):
    assert edited(script) == expected


# ------------------------------------------------------------ the scanner: refusals

@pytest.mark.parametrize(("script", "needle"), [
    # mentions it cannot vouch for
    ('echo "starting vllm serve"; exec vllm serve m', "also mentions"),
    ("echo 'vllm serve'; exec vllm serve m", "also mentions"),
    ('echo \\"vllm serve\\"; exec vllm serve m', "also mentions"),
    ("echo a#vllm serve; exec vllm serve m", "also mentions"),  # '#' inside a word
    ("exec vllm serve m; echo vllm serve", "also mentions"),
    ("sh -c 'exec vllm serve m'", "only where kvtier cannot edit"),
    ('sh -c "exec vllm serve m"', "only where kvtier cannot edit"),
    ('exec "vllm" serve m', "only where kvtier cannot edit"),
    ("exec vllm 'serve' m", "only where kvtier cannot edit"),
    ("exec vllm serve\\\nm", "only where kvtier cannot edit"),  # the continuation joins
    ("echo start \\\nvllm serve m", "only where kvtier cannot edit"),
    ("X=$(vllm serve m)", "only where kvtier cannot edit"),
    ('X="$(vllm serve m)"; exec vllm serve m', "also mentions"),
    ("if true; then exec vllm serve m; fi", "only where kvtier cannot edit"),
    ("exec A=1 vllm serve m", "only where kvtier cannot edit"),
    ("nohup vllm serve m", "only where kvtier cannot edit"),
    ("{ vllm serve m; }", "only where kvtier cannot edit"),
    ("echo > vllm serve", "only where kvtier cannot edit"),
    ("exec python3 -c 'import vllm.entrypoints.openai.api_server'", "only where"),
    # zero or several entry points
    ("", "does not start vLLM itself"),
    ("exec python server.py --vllm", "does not start vLLM itself"),
    ("vllm serve a; vllm serve b", "starts vLLM in 2 places (lines 1, 1)"),
    ("vllm serve a\nexec vllm serve b", "starts vLLM in 2 places (lines 1, 2)"),
    ("vllm serve a || vllm serve b", "starts vLLM in 2 places"),
    # what it does not parse
    ("cat <<EOF\nvllm serve\nEOF\nexec vllm serve m", "here-document"),
    ("cat <<'EOF'\nx\nEOF\nexec vllm serve m", "here-document"),
    ("cat <<<x; exec vllm serve m", "here-document or here-string"),
    ("echo `date`; exec vllm serve m", "backtick"),
    ('echo "`date`"; exec vllm serve m', "backtick"),
    ("(vllm serve m)", "'('"),
    ("f() { vllm serve m; }; f", "'('"),
    ("function f { vllm serve m; }; f", "function definition"),
    ("case $x in a) vllm serve m;; esac", "unmatched ')'"),
    ("case $x in\n a) exec vllm serve m;;\nesac", "unmatched ')'"),
    ("exec vllm serve m;; x", "case statement"),
    ("alias vllm=true\nvllm serve m", "alias"),
    ("exec vllm serve m; exit 1 )", "unmatched ')'"),
    ("echo $((1+2)); exec vllm serve m", "arithmetic"),
    ("echo ${x:-$(date)}; exec vllm serve m", "${...}"),
    ("echo ${x:-'a'}; exec vllm serve m", "${...}"),
    ("echo $'a\\nb'; exec vllm serve m", "$'...' string"),
    ("echo $(date; exec vllm serve m", "unterminated $("),
    ('echo "x; exec vllm serve m', "unterminated double quote"),
    ("echo 'x; exec vllm serve m", "unterminated single quote"),
    ("echo $(echo a # c\n); exec vllm serve m", "'#' inside $(...)"),
    ("exec vllm serve m >", "redirection without a target"),
    # N8: the appended option would be escaped into a positional argument
    ("exec vllm serve m \\", "trailing unpaired backslash"),
    ("vllm serve m --port 8000 \\", "trailing unpaired backslash"),
    ("echo > ; exec vllm serve m", "redirection without a target"),
])
def test_scanner_refuses_with_the_reason(script, needle):
    assert needle in problem(script)


def test_refusals_name_the_line():
    assert "(line 3)" in problem("set -e\necho ok\ncat <<EOF\nx\nEOF\nexec vllm serve m")


def test_scanner_refuses_many_mentions_unread():
    script = "# vllm serve\n" * shell.MAX_MENTIONS + "exec vllm serve m"
    assert "mentions vLLM's entry point 17 times" in problem(script)
    assert edited("# vllm serve\n" * (shell.MAX_MENTIONS - 1) + "exec vllm serve m")


def test_scanner_refuses_long_scripts_unread():
    script = "exec vllm serve m" + " " * shell.MAX_SCRIPT_CHARS
    assert f"more than the {shell.MAX_SCRIPT_CHARS} kvtier reads" in problem(script)


# ------------------------------------------------------------ mentions and entry points

def test_mentions():
    text = ("vllm serve; /usr/bin/vllm  \\\n serve; 'vllm' \"serve\"; vllm servex; vllm-router "
            "serve; python -m vllm.entrypoints.openai.api_server; vllm.entrypoints.cli.main")
    starts = [0, text.index("vllm  "), text.index("vllm'"), text.index("vllm.entrypoints.o"),
              text.index("vllm.entrypoints.c")]
    assert vllm_entry.mention_offsets(text) == starts
    assert not vllm_entry.mentions_entry_point("vllm-router; vllm; serve; python app.py --vllm")


@pytest.mark.parametrize(("words", "end"), [
    (["vllm", "serve", "m"], 1),
    (["/opt/venv/bin/vllm", "serve"], 1),
    (["python3", "-m", "vllm.entrypoints.openai.api_server"], 2),
    (["python", "-u", "-B", "-m", "vllm.entrypoints.cli.main", "serve", "m"], 5),
    (["vllm", "bench"], None),
    (["vllm"], None),
    (["python3", "-m", "vllm.entrypoints.cli.main"], None),
    (["python3", "-X", "dev", "-m", "vllm.entrypoints.openai.api_server"], None),
    (["pythonista", "-m", "vllm.entrypoints.openai.api_server"], None),
])
def test_entry_point_end(words, end):
    assert vllm_entry.entry_point_end(words, 0) == end


@pytest.mark.parametrize(("words", "start"), [
    (["vllm", "serve"], 0),
    (["tini", "--", "vllm", "serve"], 2),
    (["/usr/bin/dumb-init", "vllm", "serve"], 1),
    (["env", "A=1", "B=", "vllm", "serve"], 3),
    ([], 0),
])
def test_program_start(words, start):
    assert program_start(words) == start


# ------------------------------------------------------------ the kubelet's rewrites

def test_kube_escape_and_rewrites():
    assert kube_expansion.escape("/mnt/$(X)/$$") == "/mnt/$$(X)/$$$$"
    script = "echo $(date) $(HOME2) $x; exec vllm serve $(MODEL)"
    assert kube_expansion.first_rewrite(script, {"MODEL"}, 30) is None
    assert kube_expansion.first_rewrite(script, {"MODEL"}, len(script)) == "$(MODEL)"
    assert kube_expansion.first_rewrite(script, {"date"}, 30) == "$(date)"
    assert kube_expansion.first_rewrite("echo $$; x", set(), 10) == "$$"
    assert kube_expansion.first_rewrite("echo $(A; $(B)", {"B"}, 14) is None  # "A; $(B" is one name


# ------------------------------------------------------------ speed

def fastest_ms(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


HUGE = 2_500_000


@pytest.mark.parametrize("unit", ["vllm ", "vllm\t\t\t\t\t\t\t\t", "vllm serve ", "xvllm serve ",
                                  "'vllm' ", "a;", "$(a)", "#vllm serve\n"])
def test_a_huge_script_is_classified_fast(unit):
    script = unit * (HUGE // len(unit))
    assert fastest_ms(lambda: shell.find_entry_point(script, VLLM_ENTRY)) < 50


@pytest.mark.parametrize("unit", ["vllm ", "vllm\t\t\t\t\t\t\t\t", "vllm serve ", "a;"])
@pytest.mark.parametrize("container_name", [None, "vllm"])
def test_a_pod_with_a_huge_script_is_refused_fast(unit, container_name):
    script = unit * (HUGE // len(unit)) + "\nexec vllm serve m"
    pod = vllm_pod(command=["sh", "-c", script], args=None)
    tpc = parse_tpc(tpc_doc({"containerName": container_name}))
    result = inject(tpc, pod, CTX)
    assert result.conflicts and not result.changed
    assert "longer than" in result.conflicts[0]
    assert fastest_ms(lambda: inject(tpc, pod, CTX)) < 50


@pytest.mark.parametrize("unit", ["a;", "a\n", "a ", "x>y ", "$(a)", '"$(a)"', "'x'", '"x"',
                                  "${a} ", "$a$b$c ", "a=b ", "\\\n", "\\x", "# c\n",
                                  "a;b|c&&d||"])
def test_the_longest_script_read_is_classified_fast(unit):
    """Scripts as long as kvtier reads, built from the tokens that cost the scan most, the
    entry point last so that everything before it is read."""
    tail = "\nexec vllm serve m"
    script = unit * ((shell.MAX_SCRIPT_CHARS - len(tail)) // len(unit)) + tail
    assert len(script) <= shell.MAX_SCRIPT_CHARS
    assert shell.find_entry_point(script, VLLM_ENTRY).insert_at == len(script)
    # about 20 ms on an idle 2-core VM; the bound leaves room for a loaded machine
    assert fastest_ms(lambda: shell.find_entry_point(script, VLLM_ENTRY)) < 100


@pytest.mark.parametrize("unit", ["a;", "x>y ", "$(a)", '"x"', "a b c d "])
@pytest.mark.slow
def test_the_scan_is_linear(unit, monkeypatch):
    """With the length cap lifted 16-fold, the time grows about 16-fold, not 256-fold."""
    tail = "\nexec vllm serve m"
    big = 16 * shell.MAX_SCRIPT_CHARS
    monkeypatch.setattr(shell, "MAX_SCRIPT_CHARS", big)
    script = unit * ((big - len(tail)) // len(unit)) + tail
    assert shell.find_entry_point(script, VLLM_ENTRY).insert_at == len(script)
    assert fastest_ms(lambda: shell.find_entry_point(script, VLLM_ENTRY), repeat=2) < 2000
