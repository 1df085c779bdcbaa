"""Which hot path this process runs: the C extension (`kvtier_offload._native`) or the
Python path, and why.

The extension is built on the stable ABI for Python 3.11+ on Linux (x86_64, aarch64).
It is used only where it imports and was built for exactly this file format and layout
(its constants are checked against fileformat.py and layout.py); otherwise, or where
KVTIER_OFFLOAD_NATIVE=0 is set, the backend runs its Python path and REASON says why.
"""

from __future__ import annotations

import os
from types import ModuleType

from kvtier_offload import fileformat, layout

ENV = "KVTIER_OFFLOAD_NATIVE"
BATCH_API = 2  # the extension's calling convention (2: paths beneath a directory fd)


def _load() -> tuple[ModuleType | None, str, str]:
    """(the extension or None, a short reason code for metrics, the reason in words)."""
    if os.environ.get(ENV, "1").strip().lower() in {"0", "off", "false", "no"}:
        return None, "turned-off", f"{ENV}={os.environ[ENV]}"
    try:
        from kvtier_offload import _native
    except ImportError as err:
        return None, "not-built", f"the C extension does not import ({err})"
    expected = {
        "FORMAT_VERSION": fileformat.VERSION, "HEADER_SIZE": fileformat.HEADER_SIZE,
        "LENGTH_OFFSET": fileformat.LENGTH_OFFSET, "DIGEST_OFFSET": fileformat.DIGEST_OFFSET,
        "KEY_LEN_OFFSET": fileformat.KEY_LEN_OFFSET, "KEY_OFFSET": fileformat.KEY_OFFSET,
        "MIN_KEY_BYTES": layout.MIN_KEY_BYTES, "MAX_KEY_BYTES": layout.MAX_KEY_BYTES,
        "SUFFIX": layout.SUFFIX, "TEMP_SUFFIX": layout.TEMP_SUFFIX,
        "BATCH_API": BATCH_API,
    }
    for name, value in expected.items():
        if getattr(_native, name, None) != value:
            return None, "wrong-build", (f"the C extension was built for another format ({name} "
                          f"{getattr(_native, name, None)!r}, expected {value!r}): rebuild it")
    return _native, "ok", ""


module, CODE, REASON = _load()
AVAILABLE = module is not None
