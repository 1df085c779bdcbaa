"""Evictor schedules: kvtier accepts only what Kubernetes' CronJob validation accepts.

Kubernetes parses a CronJob's schedule with robfig/cron v3's standard parser.
`robfig_accepts` below restates that parser's rules (parser.go, spec.go: Parse,
normalizeFields, getField, getRange, parseIntOrName, mustParseInt, parseDescriptor, and
the bounds minute 0-59, hour 0-23, dom 1-31, month 1-12/jan-dec, dow 0-6/sun-sat) so the
generated expression can be checked against it on many schedules.
"""

from __future__ import annotations

import random
import re

import pytest

from kvtier_operator.api.cron import DESCRIPTORS, SCHEDULE

_MONTHS = {m: i + 1 for i, m in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"])}
_DAYS = {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
_BOUNDS = [(0, 59, {}), (0, 23, {}), (1, 31, {}), (1, 12, _MONTHS), (0, 6, _DAYS)]
_GO_ATOI = re.compile(r"[+-]?[0-9]+")


def _atoi(text: str) -> int | None:
    """Go's strconv.Atoi for what fits an int64; None where it errors."""
    if not _GO_ATOI.fullmatch(text):
        return None
    value = int(text)
    return value if -(2**63) <= value < 2**63 else None


def _int_or_name(text: str, names: dict[str, int]) -> int | None:
    if text.lower() in names:
        return names[text.lower()]
    value = _atoi(text)
    return None if value is None or value < 0 else value


def _range_ok(expr: str, low: int, high: int, names: dict[str, int]) -> bool:
    range_and_step = expr.split("/")
    low_and_high = range_and_step[0].split("-")
    if low_and_high[0] in ("*", "?"):
        start, end = low, high
    else:
        start = _int_or_name(low_and_high[0], names)
        if start is None or len(low_and_high) > 2:
            return False
        end = start if len(low_and_high) == 1 else _int_or_name(low_and_high[1], names)
        if end is None:
            return False
    if len(range_and_step) > 2:
        return False
    step = 1
    if len(range_and_step) == 2:
        parsed = _int_or_name(range_and_step[1], {})
        if parsed is None:
            return False
        step = parsed
        if len(low_and_high) == 1:
            end = high
    return low <= start <= end <= high and step > 0


def robfig_accepts(spec: str) -> bool:
    """robfig/cron v3 ParseStandard, less TZ=/CRON_TZ= (Kubernetes refuses those in the
    schedule and wants the timeZone field) and @every (kvtier refuses it)."""
    if not spec or spec.startswith(("TZ=", "CRON_TZ=")):
        return False
    if spec.startswith("@"):
        return spec in DESCRIPTORS
    fields = spec.split()  # Go's strings.Fields
    if len(fields) != 5:
        return False
    return all(
        _range_ok(expr, low, high, names)
        for field, (low, high, names) in zip(fields, _BOUNDS, strict=True)
        for expr in field.split(",") if expr  # strings.FieldsFunc drops empty elements
    )


def kvtier_dialect(spec: str) -> bool:
    """robfig_accepts, within the documented narrowing of kvtier/cron.py."""
    if not robfig_accepts(spec):
        return False
    if spec.startswith("@"):
        return True
    if spec != spec.strip(" ") or re.search(r"[^ \S]", spec):  # spaces only between fields
        return False
    for index, field in enumerate(spec.split()):
        for expr in field.split(","):
            if not expr:
                return False
            head, _, step = expr.partition("/")
            if step and not re.fullmatch(r"0?[1-9]|[1-9][0-9]", step):
                return False
            parts = head.split("-")
            if parts[0] in ("*", "?"):
                if len(parts) > 1 or (parts[0] == "?" and index not in (2, 4)):
                    return False
                continue
            if not all(re.fullmatch(r"[0-9]{1,2}|[A-Za-z]{3}", p) for p in parts):
                return False
    return True


VALID = ["*/5 * * * *", "0 * * * *", "15 3 * * 1-5", "0 */2 * * *", "0 0 1 1 *",
         "0 0 ? * MON-FRI", "30 2 * jan,jul sun", "0 0 31 12 sat", "59 23 * * 0",
         "1-59/2 0-23/3 1-31/7 1-12/2 0-6/2", "5/15 * * * *", "0 9-17 * * 1,3,5",
         "00 00 01 01 *", "0 0 * * Sun-Sat", "0 0 1 dec *", "0  0  *  *  *", *DESCRIPTORS]
# What croniter (kvtier's old check) accepts but Kubernetes refuses, and what both refuse.
REFUSED = ["0 0 L * *", "0 0 * * 5#3", "0 0 15W * *", "* * * * 7", "5-1 * * * *",
           "0 0 * * sat-sun", "0 0 1 dec-jan *", "*/0 * * * *", "61 * * * *", "0 24 * * *",
           "0 0 0 * *", "0 0 * 13 *", "@every 1h", "@reboot", "@Hourly", " @hourly",
           "@hourly ", "TZ=UTC 0 0 * * *", "CRON_TZ=UTC 0 0 * * *", "", "* * * *",
           "* * * * * *", "; rm -rf /", "* * * * *\n", "* * * * *; id", "$(id) * * * *",
           "H * * * *", "? * * * *", "1-2-3 * * * *", "1/2/3 * * * *", "0 0 * * mon-",
           "0 0 * * -mon", "1,,2 * * * *", "*-5 * * * *", "+5 * * * *", "100 * * * *",
           "0 0 * * funday", "0\t0 * * *  *"]


@pytest.mark.parametrize("spec", VALID)
def test_valid_schedules_are_accepted(spec):
    assert robfig_accepts(spec) and kvtier_dialect(spec)
    assert SCHEDULE.holds(spec)
    assert SCHEDULE.check(spec) == spec


@pytest.mark.parametrize("spec", REFUSED, ids=repr)
def test_refused_schedules(spec):
    assert not SCHEDULE.holds(spec)
    with pytest.raises(ValueError, match="must be a five-field cron schedule"):
        SCHEDULE.check(spec)


def test_the_reference_parser_knows_robfig_quirks():
    # Kubernetes accepts these; kvtier's narrower dialect does not need them.
    for spec in ("*-5 * * * *", "+5 * * * *", "1,,2 * * * *", "? ? ? ? ?", "0\t0 * * *",
                 "0 0 1 1/100 *", "005 * * * *"):
        assert robfig_accepts(spec), spec
        assert not SCHEDULE.holds(spec), spec
    for spec in ("0 0 L * *", "0 0 * * 5#3", "0 0 15W * *", "* * * * 7", "5-1 * * * *"):
        assert not robfig_accepts(spec), spec


_VALID_ATOMS = [["0", "5", "05", "30", "59", "*"], ["0", "12", "23", "*", "09"],
                ["1", "15", "31", "*", "?"], ["1", "6", "12", "jan", "Dec", "*"],
                ["0", "3", "6", "mon", "SUN", "Sat", "*", "?"]]
_ODD_ATOMS = ["?", "L", "W", "#", "7", "60", "32", "13", "24", "foo", "+5", "", "100", "-1",
              "005", "0"]


def _random_schedule(rng: random.Random) -> str:
    def atom(index: int) -> str:
        return rng.choice(_VALID_ATOMS[index] if rng.random() < 0.85 else _ODD_ATOMS)

    def element(index: int) -> str:
        text = atom(index)
        if rng.random() < 0.3:
            text += "-" + atom(index)
        if rng.random() < 0.2:
            text += "/" + rng.choice(["1", "2", "5", "15", "07", "99", "0", "100", "x", ""])
        return text

    def field(index: int) -> str:
        return ",".join(element(index) for _ in range(rng.choice([1, 1, 1, 2])))

    count = rng.choice([5] * 12 + [4, 6])
    fields = [field(i % 5) for i in range(count)]
    return rng.choice([" "] * 12 + ["  ", "\t"]).join(fields)


def test_kvtier_accepts_exactly_its_dialect_of_what_kubernetes_accepts():
    rng = random.Random(20)
    accepted = refused_by_kubernetes = 0
    for _ in range(4000):
        spec = _random_schedule(rng)
        holds = SCHEDULE.holds(spec)
        assert not holds or robfig_accepts(spec), f"Kubernetes would refuse {spec!r}"
        assert holds == kvtier_dialect(spec), spec
        accepted += holds
        refused_by_kubernetes += not robfig_accepts(spec)
    assert accepted > 150 and refused_by_kubernetes > 1000  # the generator reaches both sides
