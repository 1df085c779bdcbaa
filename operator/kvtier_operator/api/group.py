"""The API group, version and names of the TieredPrefixCache resource."""

from typing import Final

GROUP: Final = "kvtier.dev"
VERSION: Final = "v1alpha1"
# Spelled out, not f"{GROUP}/{VERSION}": Final literals let type checkers match them to the
# Literal types of TieredPrefixCache's apiVersion and kind.
API_VERSION: Final = "kvtier.dev/v1alpha1"
KIND: Final = "TieredPrefixCache"
PLURAL = "tieredprefixcaches"
SINGULAR = "tieredprefixcache"
SHORT_NAMES = ("tpc",)
