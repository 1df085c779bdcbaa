"""Kubernetes resource quantities ("100Gi", "1.5T", 2048) as exact byte counts.

Every function here is safe on any input: the text is checked against the quantity
grammar and its magnitude is bounded BEFORE any conversion, so a value such as
"1e1000000" (which Python would turn into a million-digit integer, a minute of CPU) is a
quick ValueError. Pods' memory values reach `quantity_bytes` from the pod webhook, so it
must never hang whatever a pod says.
"""

from __future__ import annotations

import math
import re

GIB = 1024**3
MIB = 1024**2

# Kubernetes holds a quantity's value as an int64 (resource.Quantity.Value()).
MAX_BYTES = 2**63 - 1
MAX_LENGTH = 64

# Kubernetes' quantity grammar (apimachinery resource.ParseQuantity).
_GRAMMAR = re.compile(
    r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"": 0, "n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_LOG10_2 = math.log10(2)

# ---------------------------------------------------------------- CR sizes
# A size in a TieredPrefixCache (cpu.size, pvc.size, maxSizePerReplica) is bounded by
# syntax, so the CRD's pattern and the model agree exactly: at most 18 digits before the
# decimal point counting the suffix's power of ten (k/Ki 3, M/Mi 6, G/Gi 9, T/Ti 12,
# P/Pi 15, E/Ei 18, eN N), at most 9 decimal places, positive. Every such value is below
# about 1.15e18 bytes (999Pi); 1Ei and more is refused. No node has that much memory and
# no volume that much space (the largest filesystems in service hold well under 1 EB).
CR_MAX_DIGITS = 18
CR_MAX_LENGTH = 32
CR_MAX_INT = 10**CR_MAX_DIGITS - 1
CR_MESSAGE = (
    "must be a positive quantity of bytes such as 100Gi, 1.5Ti, 512Mi or 200G, with at most "
    "18 digits before the decimal point counting the suffix's power of ten (k/Ki 3, M/Mi 6, "
    "G/Gi 9, T/Ti 12, P/Pi 15, E/Ei 18, eN N: 999Pi at most, about 1Ei) and at most 9 "
    "decimal places; no '-', m/u/n suffix or space"
)
_SUFFIXES = {0: "", 3: "k|Ki", 6: "M|Mi", 9: "G|Gi", 12: "T|Ti", 15: "P|Pi", 18: "E|Ei"}


def _cr_regex() -> str:
    # A number below 1 (0.5, .25) fits every suffix and exponent up to 18.
    nonzero_fraction = "|".join(f"{'0' * k}[1-9][0-9]{{0,{8 - k}}}" for k in range(9))
    below_one = f"0*[.](?:{nonzero_fraction})"
    suffix_any = "|".join(s for s in _SUFFIXES.values() if s)
    exponent_any = "[eE](?:[+]?0*(?:[0-9]|1[0-8])|-0*[0-9]{1,2})"
    forms = [f"{below_one}(?:{suffix_any}|{exponent_any})?"]

    def at_least_one(digits: int) -> str:
        return f"0*[1-9][0-9]{{0,{digits - 1}}}(?:[.][0-9]{{0,9}})?"

    for power, suffix in _SUFFIXES.items():
        if power < CR_MAX_DIGITS:
            forms.append(f"{at_least_one(CR_MAX_DIGITS - power)}(?:{suffix})" if suffix
                         else at_least_one(CR_MAX_DIGITS))
    forms.append(f"{at_least_one(CR_MAX_DIGITS)}[eE]-0*[0-9]{{1,2}}")
    for n in range(CR_MAX_DIGITS):
        forms.append(f"{at_least_one(CR_MAX_DIGITS - n)}[eE][+]?0*{n}")
    return "^[+]?(?:" + "|".join(forms) + ")$"


CR_QUANTITY_REGEX = _cr_regex()
_CR_QUANTITY = re.compile(CR_QUANTITY_REGEX)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "...'"


def _not_a_quantity(value: object) -> ValueError:
    return ValueError(f"{_shown(value)} is not a Kubernetes quantity; write e.g. 100Gi, 512Mi "
                      "or 2T")


def quantity_bytes(value: str | int) -> int:
    """Bytes in a quantity, rounded up; a quick ValueError on anything else.

    The value must fit an int64, as in Kubernetes; the check comes before any conversion,
    so a huge exponent or digit string costs no more than a short one.
    """
    if isinstance(value, bool):
        raise _not_a_quantity(value)
    if isinstance(value, int):
        if abs(value) > MAX_BYTES:
            raise _too_large(value)
        return value
    if not isinstance(value, str):
        raise _not_a_quantity(value)
    if len(value) > MAX_LENGTH:
        raise ValueError(f"{_shown(value)} is {len(value)} characters; a Kubernetes quantity "
                         f"of at most {MAX_LENGTH} is expected, e.g. 100Gi")
    match = _GRAMMAR.fullmatch(value)
    if match is None:
        raise _not_a_quantity(value)
    sign, number, suffix = match.group(1), match.group(2), match.group(3) or ""
    whole, _, fraction = number.partition(".")
    mantissa = int(whole + fraction or "0")  # at most 64 digits
    if mantissa == 0:
        return 0
    twos = _BINARY.get(suffix, 0)
    tens = -len(fraction) + (_DECIMAL[suffix] if suffix in _DECIMAL else
                             0 if suffix in _BINARY else int(suffix[1:]))
    # log10 of the magnitude, within one: decide before building any big number.
    magnitude = len(str(mantissa)) + tens + twos * _LOG10_2
    if magnitude > 20:
        raise _too_large(value)
    if magnitude < -2:  # below 0.1 in size: rounds up to 1 (or to 0 when negative)
        return 0 if sign == "-" else 1
    numerator = mantissa * 2**twos * 10 ** max(tens, 0)
    denominator = 10 ** max(-tens, 0)
    result = -(numerator // denominator) if sign == "-" else -(-numerator // denominator)
    if abs(result) > MAX_BYTES:
        raise _too_large(value)
    return result


def _too_large(value: object) -> ValueError:
    return ValueError(f"{_shown(value)} is more than 2^63-1 bytes (8Ei), more than any node "
                      "or volume holds; write e.g. 100Gi")


def normalize_quantity(value: object) -> str:
    """A CR size: an int or string within CR_QUANTITY_REGEX, kept in the user's spelling."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{_shown(value)} is not a Kubernetes quantity; write it as a string "
                         "such as 100Gi or 512Mi")
    if isinstance(value, int):
        if not 0 < value <= CR_MAX_INT:
            raise ValueError(f"{_shown(value)} " + CR_MESSAGE if value > 0
                             else f"{value} must be positive; write e.g. 100Gi")
        return str(value)
    if len(value) <= CR_MAX_LENGTH and _CR_QUANTITY.fullmatch(value):
        return value
    # Refused: say why as precisely as the general parser can (it is safe on any input).
    try:
        parsed = quantity_bytes(value)
    except ValueError as err:
        if "not a Kubernetes quantity" in str(err):
            raise
        parsed = None
    if parsed is not None and parsed <= 0:
        raise ValueError(f"{_shown(value)} must be positive; write e.g. 100Gi")
    raise ValueError(f"{_shown(value)} {CR_MESSAGE}")


def format_bytes(n: int) -> str:
    """Shortest exact binary-suffixed quantity for n bytes (Gi, Mi, Ki, or plain)."""
    for suffix, unit in (("Ti", 1024**4), ("Gi", GIB), ("Mi", MIB), ("Ki", 1024)):
        if n % unit == 0 and n >= unit:
            return f"{n // unit}{suffix}"
    return str(n)


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
