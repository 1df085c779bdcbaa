"""kvtier operator: TieredPrefixCache API, pure renderers, kopf handlers, webhook, CLI."""

# The one place the version is written: pyproject reads it, the image tags follow it, and
# tests/unit/test_version.py checks the copies that cannot read it (the chart, the evictor
# and offload packages, which ship without this one).
from typing import Final

__version__ = "0.1.0"

GROUP: Final = "kvtier.dev"
VERSION: Final = "v1alpha1"
# Spelled out, not f"{GROUP}/{VERSION}": Final literals let type checkers match them to the
# Literal types of TieredPrefixCache's apiVersion and kind.
API_VERSION: Final = "kvtier.dev/v1alpha1"
KIND: Final = "TieredPrefixCache"
PLURAL = "tieredprefixcaches"
SINGULAR = "tieredprefixcache"
SHORT_NAMES = ("tpc",)
