"""kvtier operator: TieredPrefixCache API, pure renderers, kopf handlers, webhook, CLI."""

# The one place the version is written: pyproject reads it, the image tags follow it, and
# tests/unit/test_version.py checks the copies that cannot read it (the chart, the evictor
# and offload packages, which ship without this one).
__version__ = "0.1.0"

GROUP = "kvtier.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TieredPrefixCache"
PLURAL = "tieredprefixcaches"
SINGULAR = "tieredprefixcache"
SHORT_NAMES = ("tpc",)
