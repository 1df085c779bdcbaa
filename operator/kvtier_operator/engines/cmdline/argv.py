"""A container's command line as words, and the program it runs: what every engine's
entry-point reader shares (engines/<engine>/entry.py name the entry points)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# Container command lines longer than this are not read (this runs in the webhook; the
# mention search takes up to ~25 ms per MiB; a `sh -c` script is capped lower still).
MAX_COMMAND_CHARS = 256 * 1024
# `python`, `python3`, `python3.12`: an interpreter that may run `-m <module>`.
PYTHON = re.compile(r"python(?:3(?:\.[0-9]+)?)?")
# Interpreter options that take no argument, allowed between `python` and `-m`.
PYTHON_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-S", "-E", "-I", "-P"})


def words(container: dict[str, Any]) -> list[str]:
    return [str(p) for p in (container.get("command") or []) + (container.get("args") or [])]


def command_line(container: dict[str, Any]) -> str:
    return " ".join(words(container))


def program(word: str) -> str:
    """The program a command word names: its last path component."""
    return word.rsplit("/", 1)[-1]


# Launchers that run the rest of their command line as given.
_LAUNCHERS = frozenset({"tini", "dumb-init"})
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.DOTALL)


def program_start(words: Sequence[str]) -> int:
    """Index of the program a command line runs, past one launcher: `tini [--]`,
    `dumb-init [--]` or `env NAME=value...`."""
    if not words:
        return 0
    name = program(words[0])
    if name in _LAUNCHERS:
        return 2 if len(words) > 1 and words[1] == "--" else 1
    if name == "env":
        i = 1
        while i < len(words) and _ENV_ASSIGNMENT.fullmatch(words[i]):
            i += 1
        return i
    return 0


def prefix_program(container: dict[str, Any], prefix: Sequence[str]) -> str:
    """Run `prefix` in front of the container's program, in exec form: the prefix goes
    right before the program (past a launcher, which stays PID 1), so the process runs
    `prefix... program args...`. Only where the program is in the container's own
    `command` (without one the image's entrypoint runs, which kvtier cannot read). Returns
    why not, changing nothing; already prefixed is fine."""
    name = container.get("name")
    command = [str(p) for p in container.get("command") or []]
    start = program_start(command)
    if start >= len(command):
        return (f"container {name!r} sets no command (or only a launcher), so its image's "
                "entrypoint starts the engine and kvtier cannot tell what it runs: give the "
                "full command in exec form (command: [vllm, serve], args: [...])")
    if command[start:start + len(prefix)] == list(prefix):
        return ""
    container["command"] = [*command[:start], *prefix, *command[start:]]
    return ""
