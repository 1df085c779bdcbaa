"""kvtier operator: TieredPrefixCache API, pure renderers, kopf handlers, webhook, CLI."""

# The one place the version is written: pyproject reads it, the image tags follow it, and
# tests/operator/unit/test_version.py checks the copies that cannot read it (the chart, the evictor
# and offload packages, which ship without this one).
__version__ = "0.1.0"

# The resource's names live with the API (api/group.py); re-exported here for callers.
from kvtier_operator.api.group import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "SHORT_NAMES", "SINGULAR", "VERSION",
           "__version__"]
