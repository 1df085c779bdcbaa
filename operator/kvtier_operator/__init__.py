"""kvtier operator: TieredPrefixCache API, pure renderers, kopf handlers, webhook, CLI."""

__version__ = "0.1.0"

GROUP = "kvtier.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TieredPrefixCache"
PLURAL = "tieredprefixcaches"
SINGULAR = "tieredprefixcache"
SHORT_NAMES = ("tpc",)
