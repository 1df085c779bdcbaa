"""Eviction for the object tier: hold a bucket prefix to a byte budget by deleting the
oldest block objects (S3's LastModified: when a block was stored), run as a short job
(`python -m kvtier_offload evict-objects`, a CronJob beside the evictor's), never inside
the model server.

Why here and not in the tier: every replica of a model server would list the same bucket
(one request per 1000 objects, and the listing held in vLLM's memory) and race the others'
deletes; one job per bucket lists it once. Why not kvtier_evictor: it is stdlib-only and
has no S3 client; a home-made SigV4 client is not an option, boto3 lives in the offload
image, which the operator already runs. Why not a bucket lifecycle rule alone: it expires
by age in whole days, whatever the bytes; a rule is a good complement (it also reaps
objects of retired fingerprints), not a budget.

Age is since the last store, not the last read: S3 has no access time, and touching an
object on every hit would cost a request per hit. A popular block evicted by age costs
one recompute, and the next store puts it back. Objects younger than min_age_seconds are
never deleted (a lookup may have just found them). Only names of the object layout under
the prefix are candidates (<prefix>/<16 hex>/<hex>.kvb): nothing else in the bucket is
touched, and it does not count against the budget.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import asdict, dataclass
from typing import Any

BLOCK_OBJECT = re.compile(r"[0-9a-f]{16}/[0-9a-f]{8,228}\.kvb")
DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys


@dataclass
class ObjectEviction:
    objects: int = 0  # block objects found
    bytes: int = 0  # their bytes
    deleted: int = 0
    deleted_bytes: int = 0
    failed: int = 0  # deletes the store refused
    over_budget: bool = False  # still over the budget (young objects, failures)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evict_to_budget(client: Any, bucket: str, prefix: str, budget_bytes: int,
                    min_age_seconds: float = 600.0, dry_run: bool = False,
                    now: datetime.datetime | None = None) -> ObjectEviction:
    """Delete the oldest block objects under prefix until the rest take at most
    budget_bytes. The listing is held in memory (about 150 bytes an object)."""
    prefix = prefix.strip("/") + "/"
    now = now or datetime.datetime.now(datetime.UTC)
    found: list[tuple[datetime.datetime, str, int]] = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        for item in page.get("Contents", ()):
            name = item["Key"]
            if BLOCK_OBJECT.fullmatch(name[len(prefix):]):
                found.append((item["LastModified"], name, int(item["Size"])))
    report = ObjectEviction(objects=len(found), bytes=sum(size for *_, size in found))
    excess = report.bytes - budget_bytes
    if excess <= 0:
        return report
    found.sort()
    chosen: list[tuple[str, int]] = []
    for modified, name, size in found:
        if excess <= 0:
            break
        if (now - modified).total_seconds() < min_age_seconds:
            break  # every later one is younger still
        chosen.append((name, size))
        excess -= size
    report.over_budget = excess > 0
    if dry_run:
        report.deleted, report.deleted_bytes = len(chosen), sum(s for _, s in chosen)
        return report
    sizes = dict(chosen)
    for start in range(0, len(chosen), DELETE_BATCH):
        batch = [{"Key": name} for name, _ in chosen[start:start + DELETE_BATCH]]
        answer = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        refused = {e["Key"] for e in answer.get("Errors", ())}
        for entry in batch:
            if entry["Key"] in refused:
                report.failed += 1
            else:
                report.deleted += 1
                report.deleted_bytes += sizes[entry["Key"]]
    report.over_budget = report.bytes - report.deleted_bytes > budget_bytes
    return report
