"""Read a `sh -c` command line with certainty, or say why not.

kvtier edits a shell script in one place only: at the end of the one top-level command
that starts the model server (after its last word: vLLM 0.32 wants the model as the first
word after `serve` when --served-model-name is given), where it adds constant or validated
text (never a raw value from a CR). Which server that is, is the engine's `EntryPoint`
(engines/vllm/entry.py, engines/sglang/entry.py). This module finds
that place, and refuses, with the reason, whenever it cannot be certain how the shell
will read the script up to there: a script it cannot fully parse (heredocs, backticks,
subshells, `case`, arithmetic, an unterminated quote), no entry point at the start of a
command, several entry points, or a mention of one it cannot vouch for (in quotes, a
nested `sh -c`, a command substitution). Comments are understood and ignored.

The scanner is one pass over the script, linear in its length (runs of ordinary
characters are skipped by simple character-class regexes, which cannot backtrack), and
it reads at most MAX_SCRIPT_CHARS.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier_operator.engines.cmdline.argv import program


@dataclass(frozen=True)
class EntryPoint:
    """How one model server is started, as the scanner needs it."""
    label: str  # for messages: "vLLM", "SGLang"
    # A literal every spelling of the entry point contains (a command without it is
    # skipped unread), and the word start a mention's offset points at.
    needle: str
    # entry_point_end(words, at): the index of the entry point's last word, else None.
    end: Callable[[Sequence[str], int], int | None]
    # Offsets of the needle of every place a text looks like it names the entry point.
    mentions: Callable[[str], list[int]]
    # `python -m` module words of the entry point (a mention points at them).
    modules: frozenset[str]


SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})
# Longer scripts are not read at all (a conflict): real launch scripts are far shorter,
# and the scan runs inside the admission webhook.
MAX_SCRIPT_CHARS = 16 * 1024
# A script kvtier edits names its entry point once (comments aside); more mentions than
# this are refused before the scan.
MAX_MENTIONS = 16

# Shell options before the script: these take the next word as their argument...
_OPTIONS_WITH_ARGUMENT = frozenset({"-o", "+o", "-O", "+O"})
# ...these take none (bash's long options that change nothing kvtier relies on).
_LONG_OPTIONS = frozenset({"--login", "--noprofile", "--norc", "--posix", "--noediting",
                           "--restricted", "--verbose"})
_OPTION_CLUSTER = re.compile(r"[-+][A-Za-z]+")

# Ordinary word characters in command text, blanks, and text inside double quotes.
_SPECIAL = frozenset(" \t\n'\"\\$`#();&|<>")
_WORD_RUN = re.compile(r"[^ \t\n'\"\\$`#();&|<>]+")
_BLANKS = re.compile(r"[ \t]+")
_DOUBLE_QUOTED_RUN = re.compile(r"[^\"\\$`]+")
# `${...}` read only when simple: no quotes, expansions, braces or newlines inside.
_SIMPLE_BRACED = re.compile(r"\$\{[^'\"`$\\{}()\n]*\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPECIAL_PARAMETER = frozenset("0123456789@*#?$!-")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# Stands for a word with quotes or expansions (a shell word has no NUL).
NOT_A_WORD = _NOT_A_WORD = "\0"
_REFUSED_COMMANDS = {
    "function": "a function definition",
    "case": "a case statement",
    "alias": "an alias",
}


def script_index(words: Sequence[str], at: int) -> int | str | None:
    """Where the script is in a `<shell> [options] -c SCRIPT [name [args...]]` command
    line that starts at words[at]: its index; None when words[at] is not a shell or the
    shell runs no `-c` script; a problem (str) when it is a shell kvtier cannot read."""
    if at >= len(words) or program(words[at]) not in SHELLS:
        return None
    shell = words[at]
    takes_script = False
    i = at + 1
    while i < len(words):
        word = words[i]
        if word in ("--", "-"):
            i += 1
            break
        if word in _OPTIONS_WITH_ARGUMENT:
            if i + 1 >= len(words):
                return f"{shell} option {word} has no argument"
            i += 2
            continue
        if word in _LONG_OPTIONS:
            i += 1
            continue
        if _OPTION_CLUSTER.fullmatch(word):
            letters = word[1:]
            with_argument = letters.count("o") + letters.count("O")
            if with_argument > 1 or (with_argument == 1 and letters[-1] not in "oO"):
                return f"cannot tell which word {shell} option cluster {word} takes"
            if "c" in letters:
                if word[0] == "+":
                    return f"{shell} option {word} is not -c"
                takes_script = True
            i += 2 if with_argument else 1
            continue
        if word[:1] in ("-", "+"):
            return f"{shell} option {word} is not one kvtier knows"
        break
    if not takes_script:
        return None
    if i >= len(words):
        return f"{shell} -c has no script"
    return i


@dataclass(frozen=True)
class EntryPointSearch:
    """Where options for the server go in a script (insert_at), or why kvtier will not
    say. `args`: the words of that command after the entry point, as the shell passes
    them where certain, NOT_A_WORD for a word with quotes, escapes or expansions."""
    insert_at: int | None
    problem: str = ""
    args: tuple[str, ...] = ()


class _Refused(Exception):
    pass


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# A word of a top-level command: (start, end, plain); plain words have no quotes, escapes
# or expansions, so the shell reads them as written.
_Word = tuple[int, int, bool]


class _Scanner:
    """One pass over a script: words of each top-level command, comments, candidates.

    Written for speed (it runs in the admission webhook): plain locals in the loop,
    tuples for words, and a command is looked at closely only if it contains the entry
    point's needle ("vllm", "sglang").
    """

    def __init__(self, script: str, entry: EntryPoint) -> None:
        self.s = script
        self.entry = entry
        self.comments: list[tuple[int, int]] = []
        # (offset of the needle the mention finder sees, offset just after the last word,
        # the words after the entry point)
        self.candidates: list[tuple[int, int, tuple[str, ...]]] = []

    def refuse(self, what: str, at: int) -> _Refused:
        return _Refused(f"the script has {what} (line {_line(self.s, at)}), which kvtier "
                        "does not parse")

    def text(self, word: _Word) -> str:
        return self.s[word[0]:word[1]] if word[2] else _NOT_A_WORD

    def command(self, words: list[_Word]) -> None:
        """Look at one top-level simple command: is it an entry point kvtier can edit?"""
        s = self.s
        entry = self.entry
        if not words or s.find(entry.needle, words[0][0], words[-1][1]) < 0:
            return
        k = 0
        while k < len(words) and _ASSIGNMENT.match(s, words[k][0], words[k][1]):
            k += 1
        if k < len(words) and self.text(words[k]) == "exec":
            k += 1
        texts = [self.text(w) for w in words[k:k + 12]]  # an entry point is a few words
        if texts and texts[0] in _REFUSED_COMMANDS:
            raise self.refuse(_REFUSED_COMMANDS[texts[0]], words[k][0])
        end = entry.end(texts, 0)
        if end is None:
            return
        module = next((words[k + j] for j in range(end + 1) if texts[j] in entry.modules),
                      None)
        mention = module[0] if module is not None else words[k][1] - len(entry.needle)
        # Options go after the command's last word, as in exec form: vLLM 0.32 refuses a
        # flag before the positional model when --served-model-name is given.
        args = tuple(self.text(w) for w in words[k + end + 1:])
        self.candidates.append((mention, words[-1][1], args))

    def scan(self) -> None:
        s = self.s
        n = len(s)
        word_run, blanks, quoted_run = _WORD_RUN.match, _BLANKS.match, _DOUBLE_QUOTED_RUN.match
        words: list[_Word] = []  # the top-level command being read
        start = -1  # where the open top-level word starts; -1: none open
        plain = True
        redirect = False  # the next top-level word is a redirection's target
        stack = ["command"]  # "command" (top level or inside $(...)) or "double-quoted"
        needle = self.entry.needle
        next_needle = s.find(needle)
        next_needle = n if next_needle < 0 else next_needle
        i = 0
        while i < n:
            if stack[-1] == "double-quoted":
                run = quoted_run(s, i)
                if run:
                    i = run.end()
                    continue
                c = s[i]
                if c == '"':
                    stack.pop()
                    i += 1
                elif c == "\\":
                    i += 2
                elif c == "`":
                    raise self.refuse("a backtick command substitution", i)
                else:
                    i = self.dollar(i, stack)
                continue
            top = len(stack) == 1
            c = s[i]
            if c not in _SPECIAL:
                if top and start < 0:
                    start, plain = i, True
                i = word_run(s, i).end()  # type: ignore[union-attr]
                continue
            if c in " \t\n;&|<>":
                # Characters that end a word (and maybe a command) at the top level.
                if top:
                    if c in "<>" and start >= 0 and plain and s[start:i].isdigit():
                        start = -1  # an io number (2>&1): not an argument
                    if start >= 0:
                        if redirect:
                            redirect = False
                        else:
                            words.append((start, i, plain))
                        start = -1
                if c in " \t":
                    i = blanks(s, i).end()  # type: ignore[union-attr]
                    continue
                if c in "<>":
                    if s.startswith("<<", i):
                        raise self.refuse("a here-document or here-string", i)
                    if top:
                        if redirect:
                            raise self.refuse("a redirection without a target", i)
                        redirect = True
                    i += 2 if s[i:i + 2] in (">>", ">&", "<&", "<>", ">|") else 1
                    continue
                two = s[i:i + 2]
                if two in (";;", ";&"):
                    raise self.refuse("a case statement", i)
                if top:
                    if redirect:
                        raise self.refuse("a redirection without a target", i)
                    if words:
                        if words[-1][1] > next_needle:  # else it cannot be an entry point
                            self.command(words)
                            next_needle = s.find(needle, i)
                            next_needle = n if next_needle < 0 else next_needle
                        words = []
                i += 2 if two in ("&&", "||", "|&") else 1
            elif c == "#":
                if top and start >= 0:
                    i += 1  # inside a word: an ordinary character
                elif not top:
                    raise self.refuse("a '#' inside $(...)", i)
                else:
                    end = s.find("\n", i)
                    end = n if end < 0 else end
                    self.comments.append((i, end))
                    i = end
            elif c == "'":
                if top:
                    start, plain = (i if start < 0 else start), False
                end = s.find("'", i + 1)
                if end < 0:
                    raise self.refuse("an unterminated single quote", i)
                i = end + 1
            elif c == '"':
                if top:
                    start, plain = (i if start < 0 else start), False
                stack.append("double-quoted")
                i += 1
            elif c == "\\":
                # An escaped character, or a continuation that joins the open word on.
                if i + 1 == n:  # escapes what kvtier would append: its option is mangled
                    raise self.refuse("a trailing unpaired backslash", i)
                if top and (start >= 0 or not s.startswith("\n", i + 1)):
                    start, plain = (i if start < 0 else start), False
                i += 2
            elif c == "$":
                if top:
                    start, plain = (i if start < 0 else start), False
                i = self.dollar(i, stack)
            elif c == "`":
                raise self.refuse("a backtick command substitution", i)
            elif c == "(":
                raise self.refuse("a '(' (subshell, function or pattern)", i)
            else:  # ")"
                if top:
                    raise self.refuse("an unmatched ')'", i)
                stack.pop()
                i += 1
        if len(stack) > 1:
            what = ("an unterminated double quote" if stack[-1] == "double-quoted"
                    else "an unterminated $(")
            raise self.refuse(what, n)
        if start >= 0:
            if not redirect:
                words.append((start, n, plain))
            redirect = False
        if redirect:
            raise self.refuse("a redirection without a target", n)
        self.command(words)

    def dollar(self, i: int, stack: list[str]) -> int:
        """Read the expansion at s[i] == '$'; return where reading goes on."""
        s = self.s
        nxt = s[i + 1:i + 2]
        if nxt == "(":
            if s.startswith("((", i + 1):
                raise self.refuse("an arithmetic expansion $((...))", i)
            stack.append("command")
            return i + 2
        if nxt == "{":
            braced = _SIMPLE_BRACED.match(s, i)
            if braced is None:
                raise self.refuse("a ${...} expansion with quotes or expansions inside", i)
            return braced.end()
        if nxt in ("'", '"') and stack[-1] == "command":
            raise self.refuse(f"a ${nxt}...{nxt} string", i)
        name = _NAME.match(s, i + 1)
        if name:
            return name.end()
        if nxt and nxt in _SPECIAL_PARAMETER:
            return i + 2
        return i + 1  # a lone '$' is an ordinary character


def find_entry_point(script: str, entry: EntryPoint) -> EntryPointSearch:
    """Where options for the server may be added to script: after the last word of the
    one top-level command that starts with its entry point, when the whole script is
    understood and mentions no other entry point outside comments."""
    label = entry.label
    if len(script) > MAX_SCRIPT_CHARS:
        return EntryPointSearch(None, f"the script is {len(script)} characters, more than "
                                      f"the {MAX_SCRIPT_CHARS} kvtier reads")
    mentions = entry.mentions(script)
    if not mentions:
        return EntryPointSearch(None, f"the script does not start {label} itself")
    if len(mentions) > MAX_MENTIONS:
        return EntryPointSearch(None, f"the script mentions {label}'s entry point "
                                      f"{len(mentions)} times; kvtier cannot tell which one "
                                      "runs")
    scanner = _Scanner(script, entry)
    try:
        scanner.scan()
    except _Refused as refused:
        return EntryPointSearch(None, str(refused))
    mentions = _outside(mentions, scanner.comments)
    candidates = scanner.candidates
    if len(candidates) > 1:
        lines = ", ".join(str(_line(script, c[0])) for c in candidates[:3])
        more = ", ..." if len(candidates) > 3 else ""
        return EntryPointSearch(None, f"the script starts {label} in {len(candidates)} places "
                                      f"(lines {lines}{more}); kvtier cannot tell which one "
                                      "runs")
    others = [m for m in mentions if not candidates or m != candidates[0][0]]
    if others:
        where = _line(script, others[0])
        if candidates:
            return EntryPointSearch(None, (
                f"the script also mentions {label}'s entry point on line {where}, inside quotes, "
                "a command substitution or after a keyword, where kvtier cannot tell whether "
                "it runs: reword or remove that mention"))
        return EntryPointSearch(None, (
            f"the script names {label}'s entry point only where kvtier cannot edit it with "
            f"certainty (line {where}: inside quotes, a command substitution, after a "
            "keyword, or split by quotes)"))
    if not candidates:
        return EntryPointSearch(None, f"the script does not start {label} itself")
    return EntryPointSearch(candidates[0][1], args=candidates[0][2])


def _outside(offsets: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """The offsets (ascending) that no span (ascending, disjoint) contains."""
    kept: list[int] = []
    k = 0
    for offset in offsets:
        while k < len(spans) and spans[k][1] <= offset:
            k += 1
        if not (k < len(spans) and spans[k][0] <= offset < spans[k][1]):
            kept.append(offset)
    return kept
