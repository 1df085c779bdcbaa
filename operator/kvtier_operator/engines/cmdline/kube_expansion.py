"""Kubernetes' `$(VAR)` expansion of a container's command, args and env values.

The kubelet replaces `$(NAME)` with the value of the container's env var NAME (env
values see the entries before them), turns `$$` into `$`, and leaves everything else as
written. Values kvtier writes there must therefore have every `$` doubled, or a CR could
make the kubelet splice a secret into them (`/mnt/$(HF_TOKEN)`).
"""

from __future__ import annotations

from collections.abc import Collection


def escape(value: str) -> str:
    """value, written so that the kubelet's expansion gives it back unchanged."""
    return value.replace("$", "$$")


def first_rewrite(text: str, defined: Collection[str], end: int) -> str | None:
    """The first `$$` or `$(NAME)` (NAME in defined) starting in text[:end], which the
    kubelet rewrites before a shell reads the text; None if there is none."""
    i = text.find("$", 0, end)
    while i >= 0:
        nxt = text[i + 1:i + 2]
        if nxt == "$":
            return "$$"
        if nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                return None  # no reference can follow an unclosed one
            if text[i + 2:close] in defined:
                return text[i:close + 1]
            i = text.find("$", close + 1, end)
        else:
            i = text.find("$", i + 1, end)
    return None
