"""Kubernetes resource quantities ("100Gi", "1.5T", 2048) as exact byte counts."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from kubernetes.utils.quantity import parse_quantity

GIB = 1024**3
MIB = 1024**2


def quantity_bytes(value: str | int) -> int:
    """Bytes in a quantity, rounded up; ValueError with the accepted forms on bad input."""
    try:
        parsed = parse_quantity(value)
    except (ValueError, InvalidOperation, TypeError) as err:
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity; write e.g. 100Gi, 512Mi or 2T"
        ) from err
    return int(parsed.to_integral_value(rounding="ROUND_CEILING"))


def normalize_quantity(value: object) -> str:
    """Validate a quantity and keep it in the user's own spelling (ints become strings)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Decimal)):
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write e.g. 100Gi or 512Mi")
    text = str(value).strip()
    if quantity_bytes(text) <= 0:
        raise ValueError(f"{text!r} must be positive; write e.g. 100Gi")
    return text


def format_bytes(n: int) -> str:
    """Shortest exact binary-suffixed quantity for n bytes (Gi, Mi, Ki, or plain)."""
    for suffix, unit in (("Ti", 1024**4), ("Gi", GIB), ("Mi", MIB), ("Ki", 1024)):
        if n % unit == 0 and n >= unit:
            return f"{n // unit}{suffix}"
    return str(n)


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
