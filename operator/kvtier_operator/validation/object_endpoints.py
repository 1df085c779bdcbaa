"""Which S3 endpoints a cache's object store may name: exactly one the kvtier admin allows
(Helm value objectStore.allowedEndpoints, the operator's env
KVTIER_ALLOWED_OBJECT_ENDPOINTS), or none at all (the AWS endpoint of its region).

The endpoint receives what boto3 sends with every request: the access key id and any
session token, taken from the Secret keys the cache names (the secret key itself only
signs). The operator's object-evictor CronJob and the injected pods run with those, so
without this list whoever may create a TieredPrefixCache could send two values of any
Secret in the namespace to a server of their own. The admin lists the object stores
that exist; the cache picks one.

Refused where the allowed list is known: the validating webhook, `kvtier render
--allow-object-endpoint`, and the operator (no pod injected, no CronJob rendered)."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier_operator.api import rules
from kvtier_operator.api.v1alpha1 import TieredPrefixCacheSpec


def parse_allowed_endpoints(text: str | None) -> tuple[str, ...]:
    """KVTIER_ALLOWED_OBJECT_ENDPOINTS: comma-separated endpoint URLs; ValueError naming
    one that is not (the operator refuses to start rather than guess)."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if item:
            try:
                rules.ENDPOINT_URL.check(item)
            except ValueError as err:
                raise ValueError(f"KVTIER_ALLOWED_OBJECT_ENDPOINTS (Helm value "
                                 f"objectStore.allowedEndpoints): {err}") from None
            out.append(item)
    return tuple(out)


def object_endpoint_refusal(spec: TieredPrefixCacheSpec, allowed: Iterable[str]) -> str | None:
    store = spec.object_store
    if store is None or store.endpoint is None:
        return None
    allowed = tuple(allowed)
    if store.endpoint in allowed:
        return None
    shown = ", ".join(allowed) if allowed else "none"
    return (f"spec.objectStore.endpoint {store.endpoint} is not an endpoint the kvtier admin "
            f"allows (Helm value objectStore.allowedEndpoints: {shown}); it would receive "
            "the access key id and session token from spec.objectStore.credentialsSecret. "
            "Name an allowed endpoint, leave it out for AWS, or ask the admin to allow it")
