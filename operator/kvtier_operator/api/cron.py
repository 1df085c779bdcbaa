"""CronJob schedules in the dialect Kubernetes accepts, as one regular expression.

Kubernetes validates a CronJob's schedule with robfig/cron v3's standard parser: five
fields (minute 0-59, hour 0-23, day of month 1-31, month 1-12 or jan-dec, day of week
0-6 or sun-sat), each a comma-separated list of `*`, a value, or a range `a-b` with
a <= b, each optionally stepped with `/n` (n >= 1; `a/n` means a to the field's maximum);
`?` means `*`; names are case-insensitive; descriptors such as @hourly stand alone.
It refuses `L`, `W`, `#`, day of week 7, backwards ranges and step 0, which other cron
dialects (croniter's among them) accept.

kvtier accepts a subset of that dialect, so nothing it accepts is refused later: fields
separated by spaces; `?` only in day of month and day of week; values of one or two
digits; steps 1-99; no `@every` (kvtier wants calendar schedules), `@reboot`, `TZ=` or
`CRON_TZ=` (the CronJob's own timeZone field is the place for a zone). The expression is
built once here: the model matches it and the CRD carries it as a CEL rule, so the API
server, the webhook and `kvtier render` give the same answer.
"""

from __future__ import annotations

from kvtier_operator.api.rules import Rule

DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
MAX_LENGTH = 128
_MESSAGE = (
    "must be a five-field cron schedule in the dialect of Kubernetes CronJobs (minute "
    "0-59, hour 0-23, day of month 1-31, month 1-12 or jan-dec, day of week 0-6 or "
    "sun-sat; `*`, lists, ranges a-b with a <= b, steps /n) or one of @hourly, @daily, "
    "@weekly, @monthly, @yearly; write e.g. '*/5 * * * *' (no L, W, #, day of week 7, "
    "@every, @reboot or TZ=)"
)

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def _any_case(name: str) -> str:
    return "".join(f"[{c}{c.upper()}]" for c in name)


def _digits(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _int_range(lo: int, hi: int) -> str:
    """Decimal spellings of lo..hi (0 <= lo <= hi <= 99); one-digit values may be 0-padded."""
    parts = []
    if lo <= 9:
        parts.append(f"0?{_digits(lo, min(hi, 9))}")
    for tens in range(max(lo, 10) // 10, hi // 10 + 1):
        first = max(lo, tens * 10) % 10
        last = min(hi, tens * 10 + 9) % 10
        parts.append(f"{tens}{_digits(first, last)}")
    return "|".join(parts)


class _Field:
    def __init__(self, low: int, high: int, names: tuple[str, ...] = (), first_name: int = 0,
                 question: bool = False) -> None:
        self.low, self.high, self.question = low, high, question
        self.names = {first_name + i: name for i, name in enumerate(names)}

    def spell(self, lo: int, hi: int) -> str:
        """Every spelling of the values lo..hi: numbers and names."""
        names = [_any_case(name) for n, name in sorted(self.names.items()) if lo <= n <= hi]
        return "|".join([_int_range(lo, hi), *names])

    def regex(self) -> str:
        step = "(?:/(?:0?[1-9]|[1-9][0-9]))?"
        star = "[*?]" if self.question else "[*]"
        ranges = "|".join(f"(?:{self.spell(n, n)})(?:-(?:{self.spell(n, self.high)}))?"
                          for n in range(self.low, self.high + 1))
        element = f"(?:{star}|{ranges}){step}"
        return f"{element}(?:,{element})*"


_FIELDS = (
    _Field(0, 59),
    _Field(0, 23),
    _Field(1, 31, question=True),
    _Field(1, 12, _MONTHS, first_name=1),
    _Field(0, 6, _DAYS, question=True),
)


def _build() -> str:
    fields = " +".join(f"(?:{f.regex()})" for f in _FIELDS)
    descriptors = "|".join(DESCRIPTORS)
    return f"^(?:{descriptors}|{fields})$"


SCHEDULE = Rule(_build(), MAX_LENGTH, _MESSAGE)
