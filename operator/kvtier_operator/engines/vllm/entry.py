"""How a command line starts vLLM's OpenAI server: the entry point's words, and where
a text mentions one.

Two questions with two strictness levels. `entry_point_end` recognises the exact words
of an entry point (kvtier edits only there). `mention_offsets` finds every place a text
looks like it names one, however quoted, so that a mention kvtier cannot vouch for (in
quotes, a nested `sh -c`, a command substitution) is noticed instead of ignored. Both
are linear in the text: no regex here can backtrack over a long run of whitespace.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvtier_operator.engines.cmdline.argv import PYTHON, PYTHON_FLAGS, program
from kvtier_operator.engines.cmdline.shell import EntryPoint

# `python -m <module>` spellings of vLLM's OpenAI server; the CLI module takes `serve`.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CLI_MODULE = "vllm.entrypoints.cli.main"
# A mention: "vllm" with a module suffix, or followed (over blanks, quotes and
# backslashes) by the word "serve". A regex with a literal head, so Python's search skips
# to each "vllm" in C; the blank run can only be rescanned up to the next "v", so the
# search stays linear (no name-character check before "vllm": such a check defeats that
# skip, and counting "myvllm serve" as a mention only makes kvtier more careful).
_MENTION = re.compile(
    r"vllm(?:\.entrypoints\.(?:openai\.api_server|cli\.main)"
    r"|[ \t\r\n\\'\"]+serve(?![A-Za-z0-9_.\-]))"
)


def entry_point_end(words: Sequence[str], at: int) -> int | None:
    """When words[at:] start vLLM's server, the index of the entry point's last word (the
    one options may follow), else None: `vllm serve`, `python[3] -m <server module>` or
    `python[3] -m <cli module> serve`, the program named by path or by name."""
    if at >= len(words):
        return None
    name = program(words[at])
    if name == "vllm":
        return at + 1 if at + 1 < len(words) and words[at + 1] == "serve" else None
    if not PYTHON.fullmatch(name):
        return None
    k = at + 1
    while k < len(words) and words[k] in PYTHON_FLAGS:
        k += 1
    if k + 1 >= len(words) or words[k] != "-m":
        return None
    if words[k + 1] == SERVER_MODULE:
        return k + 1
    if words[k + 1] == CLI_MODULE and k + 2 < len(words) and words[k + 2] == "serve":
        return k + 2
    return None


def mention_offsets(text: str) -> list[int]:
    """Offsets of the "vllm" of every mention of an entry point in text."""
    return [m.start() for m in _MENTION.finditer(text)]


def mentions_entry_point(text: str) -> bool:
    return _MENTION.search(text) is not None


# How the `sh -c` scanner (cmdline/shell.py) recognises vLLM's server.
ENTRY_POINT = EntryPoint(label="vLLM", needle="vllm", end=entry_point_end,
                         mentions=mention_offsets,
                         modules=frozenset({SERVER_MODULE, CLI_MODULE}))
