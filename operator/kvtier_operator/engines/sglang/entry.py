"""How a command line starts SGLang's server: the entry point's words, and where a text
mentions one (sglang 0.5.23).

The two spellings are `sglang serve [model] [options]` (the `sglang` console script,
sglang/cli/main.py) and `python[3] -m sglang.launch_server [options]`. Like
engines/vllm/entry.py: `entry_point_end` recognises the exact words kvtier edits after;
`mention_offsets` finds every place a text looks like it names one, however quoted, so a
mention kvtier cannot vouch for is noticed. Both are linear in the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvtier_operator.engines.cmdline.argv import PYTHON, PYTHON_FLAGS, program
from kvtier_operator.engines.cmdline.shell import EntryPoint

LAUNCH_MODULE = "sglang.launch_server"
PROGRAM = "sglang"
# "sglang.launch_server" as a whole module name, or "sglang" followed (over blanks,
# quotes and backslashes) by the word "serve". A literal head, so the search skips to
# each "sglang" in C; the blank run cannot contain an "s", so it is read once.
_MENTION = re.compile(
    r"sglang(?:\.launch_server(?![A-Za-z0-9_.])"
    r"|[ \t\r\n\\'\"]+serve(?![A-Za-z0-9_.\-]))"
)


def entry_point_end(words: Sequence[str], at: int) -> int | None:
    """When words[at:] start SGLang's server, the index of the entry point's last word,
    else None: `sglang serve` or `python[3] [-u ...] -m sglang.launch_server`, the
    program named by path or by name."""
    if at >= len(words):
        return None
    name = program(words[at])
    if name == PROGRAM:
        return at + 1 if at + 1 < len(words) and words[at + 1] == "serve" else None
    if not PYTHON.fullmatch(name):
        return None
    k = at + 1
    while k < len(words) and words[k] in PYTHON_FLAGS:
        k += 1
    if k + 1 < len(words) and words[k] == "-m" and words[k + 1] == LAUNCH_MODULE:
        return k + 1
    return None


def mention_offsets(text: str) -> list[int]:
    """Offsets of the "sglang" of every mention of an entry point in text."""
    return [m.start() for m in _MENTION.finditer(text)]


def mentions_entry_point(text: str) -> bool:
    return _MENTION.search(text) is not None


SGLANG = EntryPoint(label="SGLang", needle="sglang", end=entry_point_end,
                    mentions=mention_offsets, modules=frozenset({LAUNCH_MODULE}))
