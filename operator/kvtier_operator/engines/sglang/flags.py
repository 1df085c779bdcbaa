"""Read the flags an SGLang container already passes, and add kvtier's, in `--flag=value`
form (llm-d keeps SGLang flags in that form; its benchmark tooling reads them so).

Pure: `add_flags` edits the container dict it is given only when it returns no problems.
A flag the user already passes with the value kvtier needs stays as written; with another
value it is a problem (the caller reports a conflict), never silently overridden.

SGLang parses its command line with argparse (sglang/srt/server_args.py,
prepare_server_args), so:
- `--flag=value` and `--flag value` both set a flag, and the last occurrence wins;
- a unique prefix of a flag is that flag (allow_abbrev): kvtier refuses abbreviations of
  the flags it manages, since it cannot tell what else they might abbreviate;
- `--config FILE` merges flags from a file kvtier cannot read: refused;
- everything after `--` is positional.

Only plain words are read (exec form argv, or a `sh -c` script's words without quotes or
expansions); a managed flag mentioned anywhere else in the command text (quoted, inside
an expansion, glued to another word) is a problem rather than a guess.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier_operator.engines.cmdline import kube_expansion, shell
from kvtier_operator.engines.cmdline.argv import program_start
from kvtier_operator.engines.sglang.entry import SGLANG, entry_point_end

FIX = ("run SGLang in exec form (command: [python3, -m, sglang.launch_server], args: "
       "[--flag=value, ...]), or start a line of the script with `exec sglang serve`")
# Every word kvtier writes: a flag and a value of plain characters, nothing a shell or
# the kubelet would read specially.
_SAFE_WORD = re.compile(r"--[a-z0-9][a-z0-9-]*(?:=[A-Za-z0-9_.:+/-]+)?\Z", re.ASCII)
# A flag-looking token that starts a word (or follows a quote, `=`, `$`...): linear, with a
# literal head.
_FLAG_TOKEN = re.compile(r"(?<![A-Za-z0-9_\-])--([A-Za-z0-9][A-Za-z0-9_\-]*)", re.ASCII)
_INTEGER = re.compile(r"[+-]?[0-9]+\Z", re.ASCII)


@dataclass(frozen=True)
class Flag:
    """A flag kvtier needs: `--name=value`, or `--name` alone when value is None (a
    switch). `origin` names where the value comes from, for messages."""
    name: str
    value: str | None
    origin: str
    aliases: tuple[str, ...] = ()

    def word(self) -> str:
        return self.name if self.value is None else f"{self.name}={self.value}"


@dataclass(frozen=True)
class Forbidden:
    """A flag that must not be passed at all, and why (said to the user)."""
    name: str
    why: str


# kvtier cannot see flags that come from a file.
CONFIG_FILE = Forbidden("--config", "it merges flags from a file kvtier cannot read; pass "
                                    "the flags on the command line instead")


@dataclass
class _Reading:
    values: dict[str, str | None]  # managed flag name -> the last value given
    problems: list[str]


def _same(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    if _INTEGER.match(a) and _INTEGER.match(b):
        return int(a) == int(b)
    return a == b


def _read(args: Sequence[str], text: str, flags: Sequence[Flag],
          forbidden: Sequence[Forbidden], defined: Collection[str], name: str,
          env: Sequence[dict[str, Any]] = ()) -> _Reading:
    """The managed flags in args; `env`: the container's env entries, whose values an
    expansion on the command line ($(NAME) for the kubelet, $NAME for a shell) may turn
    into flags kvtier cannot see, so a managed flag in one is a problem."""
    by_name: dict[str, Flag | Forbidden] = {}
    for flag in flags:
        for spelling in (flag.name, *flag.aliases):
            by_name[spelling] = flag
    for ban in forbidden:
        by_name[ban.name] = ban

    def resolve(word_name: str) -> Flag | Forbidden | str | None:
        """The managed flag a `--name` means, a problem for an abbreviation of one, or
        None for a flag kvtier does not manage."""
        if word_name in by_name:
            return by_name[word_name]
        meant = sorted(full for full in by_name if full.startswith(word_name))
        if meant:
            return (f"container {name!r} passes {word_name}, which SGLang reads as an "
                    f"abbreviation of {meant[0]}: write the flag in full")
        return None

    reading = _Reading(values={}, problems=[])
    mentioned = sum(1 for m in _FLAG_TOKEN.finditer(text)
                    if resolve("--" + m.group(1)) is not None)
    read = 0
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if not word.startswith("--") or word == "--":
            continue
        word_name, eq, value = word.partition("=")
        target = resolve(word_name)
        if target is None:
            continue
        read += 1
        if isinstance(target, str):
            reading.problems.append(target)
            continue
        if isinstance(target, Forbidden):
            reading.problems.append(f"container {name!r} passes {word_name}: {target.why}")
            continue
        if target.value is None:
            if eq:
                reading.problems.append(f"container {name!r} passes {word}, but {word_name} "
                                        "takes no value: write it alone")
                continue
            reading.values[target.name] = None
            continue
        if not eq:
            if i >= len(args) or (args[i].startswith("-") and not _INTEGER.match(args[i])):
                reading.problems.append(f"container {name!r} passes {word_name} without a "
                                        "value")
                continue
            value = args[i]
            i += 1
        if shell.NOT_A_WORD in value or kube_expansion.first_rewrite(
                value, defined, len(value)) is not None:
            reading.problems.append(
                f"container {name!r} passes {word_name} with a value kvtier cannot read (an "
                f"expansion or quotes): write it as plain {target.name}=VALUE")
            continue
        reading.values[target.name] = value
    for var in env:
        env_value = var.get("value")
        hidden = sorted({"--" + m.group(1) for m in _FLAG_TOKEN.finditer(str(env_value or ""))
                         if resolve("--" + m.group(1)) is not None})
        if hidden:
            reading.problems.append(
                f"container {name!r} has env {var.get('name')} mentioning "
                f"{', '.join(hidden)}, which kvtier manages: an expansion of it would reach "
                "SGLang where kvtier cannot read it; pass each as a plain --flag=value word")
    if mentioned > read:
        reading.problems.append(
            f"container {name!r} mentions a flag kvtier manages ("
            + ", ".join(sorted({f.name for f in flags} | {b.name for b in forbidden}))
            + ") where kvtier cannot read it (inside quotes or an expansion, or glued to "
            "another word): write each as a plain --flag=value word")
    return reading


@dataclass(frozen=True)
class CommandLine:
    """Where SGLang's options are in a container, or why kvtier cannot tell."""
    args: tuple[str, ...]  # the words after the entry point
    text: str  # the text managed flags are counted in
    script_at: int | None  # index of the `sh -c` script among command+args, if one
    insert_at: int  # where options go in that script
    problem: str = ""


def command_line(container: dict[str, Any]) -> CommandLine:
    """Find SGLang's entry point in the container's command line (exec form or one
    `sh -c` script)."""
    name = container.get("name")
    words = [str(p) for p in (container.get("command") or []) + (container.get("args") or [])]
    start = program_start(words)
    script_at = shell.script_index(words, start)
    if isinstance(script_at, str):
        return CommandLine((), "", None, 0, f"container {name!r}: {script_at}; {FIX}")
    if script_at is not None:
        script = words[script_at]
        found = shell.find_entry_point(script, SGLANG)
        if found.insert_at is None:
            return CommandLine((), "", None, 0, f"container {name!r} runs a shell script "
                               f"kvtier will not edit: {found.problem}; {FIX}")
        defined = {e.get("name") for e in container.get("env") or []}
        rewritten = kube_expansion.first_rewrite(script, defined, found.insert_at)
        if rewritten is not None:
            return CommandLine((), "", None, 0, (
                f"container {name!r}'s script has {rewritten} before SGLang's entry point's "
                "end, which Kubernetes rewrites before the shell runs; write $NAME for an "
                f"env var instead, or {FIX}"))
        return CommandLine(found.args, script, script_at, found.insert_at)
    end = entry_point_end(words, start)
    if end is None:
        return CommandLine((), "", None, 0, (
            f"cannot tell how container {name!r} starts SGLang (its command line is neither "
            f"an entry point kvtier knows nor a `sh -c` script); {FIX}"))
    args = tuple(words[end + 1:])
    if "--" in args:
        return CommandLine((), "", None, 0, (
            f"container {name!r} passes '--' to SGLang, after which kvtier's flags would "
            "be read as arguments: remove it"))
    return CommandLine(args, " ".join(args), None, 0)


def existing_flags(container: dict[str, Any], flags: Sequence[Flag],
                   forbidden: Sequence[Forbidden] = (CONFIG_FILE,)
                   ) -> tuple[dict[str, str | None], list[str]]:
    """The managed flags the container passes (name -> value, None for a switch), and
    the problems met reading them."""
    found = command_line(container)
    if found.problem:
        return {}, [found.problem]
    env = container.get("env") or []
    defined = {e.get("name") for e in env}
    reading = _read(found.args, found.text, flags, forbidden, defined,
                    str(container.get("name")), env)
    return reading.values, reading.problems


def add_flags(container: dict[str, Any], flags: Sequence[Flag],
              forbidden: Sequence[Forbidden] = (CONFIG_FILE,)) -> list[str]:
    """Give SGLang `flags` in the container: appended after its last argument (exec form
    args, or the end of the command in a `sh -c` script). A flag already passed with the
    same value is kept as written. Returns the problems; with any, nothing changes."""
    name = container.get("name")
    found = command_line(container)
    if found.problem:
        return [found.problem]
    env = container.get("env") or []
    defined = {e.get("name") for e in env}
    reading = _read(found.args, found.text, flags, forbidden, defined, str(name), env)
    problems = list(reading.problems)
    missing: list[str] = []
    for flag in flags:
        if flag.name in reading.values:
            have = reading.values[flag.name]
            if not _same(have, flag.value):
                shown = flag.name if have is None else f"{flag.name}={have}"
                problems.append(f"container {name!r} passes {shown}; kvtier needs "
                                f"{flag.word()} (from {flag.origin}): remove it from the pod "
                                "or make the two agree")
            continue
        word = flag.word()
        if not _SAFE_WORD.match(word):
            problems.append(f"kvtier will not write {word!r} into container {name!r}: "
                            f"{flag.origin} must be a plain value")
            continue
        missing.append(word)
    if problems:
        return problems
    if not missing:
        return []
    command = [str(p) for p in container.get("command") or []]
    args = [str(p) for p in container.get("args") or []]
    if found.script_at is None:
        container["args"] = [*args, *missing]
        return []
    script = (command + args)[found.script_at]
    script = script[:found.insert_at] + " " + " ".join(missing) + script[found.insert_at:]
    if found.script_at < len(command):
        command[found.script_at] = script
        container["command"] = command
    else:
        args[found.script_at - len(command)] = script
        container["args"] = args
    return []
