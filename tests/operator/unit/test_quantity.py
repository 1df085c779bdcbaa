"""Quantities: exact bytes for every valid form, and a quick clean refusal of anything else.

A pod's memory values reach quantity_bytes from the pod webhook, and CR sizes reach it
from the validating webhook; neither may stall the event loop or crash on any string.
"""

from __future__ import annotations

import time

import pytest

from kvtier_operator.api.quantity import quantity_bytes

# Each of these took from 0.6 s to minutes of CPU, or raised OverflowError, before.
HOSTILE = ["1e1000000", "1e400000", "9" * 5000, ".inf", "inf", "Infinity", "-inf", "NaN",
           "nan", "1E+999999", "99999999999999999999Ei", "9" * 60 + "Ei",
           "1" + "0" * 63, "0." + "0" * 60 + "1Gi", "1e99999999999999999999999999999999",
           "8Ei", "1e19", " 1Gi", "1Gi ", "1 Gi", "1Gi\n", "0x10", "1_000", "\uff11Gi", "1GB",
           "", "+", "-", ".", "e5", "1e", "1.2.3"]
BOUND_S = 0.010  # generous: each takes some microseconds


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v)[:30])
def test_hostile_quantity_is_a_quick_value_error(value):
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        quantity_bytes(value)
    elapsed = time.perf_counter() - start
    assert elapsed < BOUND_S, f"{elapsed * 1000:.1f} ms"
    assert len(str(err.value)) < 200  # the message quotes a shortened value


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("100Gi", 100 * 1024**3), ("1.5Ti", 3 * 1024**4 // 2), ("512Mi", 512 * 1024**2),
        ("2T", 2 * 10**12), ("200G", 200 * 10**9), ("5e9", 5 * 10**9), ("5E+9", 5 * 10**9),
        ("1k", 1000), ("1Ki", 1024), ("+1Ki", 1024), (".5Ki", 512), ("1.", 1),
        ("100m", 1), ("1n", 1), ("1500m", 2), ("0", 0), ("0e999999999", 0), ("-1Gi", -(2**30)),
        ("-100m", 0), ("1e-1000000", 1), ("7Ei", 7 * 2**60), ("9223372036854775807", 2**63 - 1),
        (107374182400, 107374182400), ("0000000000000000000000000000000000000001Gi", 2**30),
    ],
)
def test_quantity_bytes_exact(value, expected):
    assert quantity_bytes(value) == expected


@pytest.mark.parametrize("value", [True, None, 1.5, 2**63, -(2**63), b"1Gi", ["1Gi"]])
def test_non_quantities_are_value_errors(value):
    with pytest.raises(ValueError):
        quantity_bytes(value)
