"""KV blocks as objects in an S3 bucket (issue #38): for clusters with an object store
and no ReadWriteMany filesystem.

Each block is one object, `<prefix>/<fingerprint>/<key hex>.kvb`, holding exactly what a
block file holds (fileformat: the 4 KiB header, then the payload), so a load trusts
nothing it has not checked: length, magic, version, fingerprint, key, header checksum
and payload digest. A missing object is a miss; a damaged or foreign one is a miss too
(counted, logged once, deleted where the credentials allow: PUT is atomic in S3, so a
bad object is bad for every reader); any error fails the block, and vLLM recomputes.

The S3 API is spoken by boto3 (botocore's SigV4 signing, retries, connection pool), never
by a client of our own. It is imported only here, when an object tier is configured, so
the backend imports without it; where it is missing the tier fails to start naming the
package. Every request has a connect and a read timeout and at most max_attempts tries;
at most max_concurrency requests run at once (the I/O threads, one connection each:
reads ahead of writes); stores wait at most write_queue_seconds for a thread, then are
dropped (never reported stored). Lookups never wait on the network: HEAD requests run
on threads of their own and vLLM is told "ask again" until the answer is in (for at most
lookup_pending_seconds, then a miss), as for block files (lookup.py).

Credentials come from boto3's usual chain, never from the tier's settings: the
environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, which a
Kubernetes Secret provides), a credentials file (AWS_SHARED_CREDENTIALS_FILE, a mounted
Secret), or a web identity token (IRSA, AWS_WEB_IDENTITY_TOKEN_FILE). A setting that looks
like a credential is refused by name, its value never printed; nothing here logs a
request's headers.

Eviction is not the tier's: see object_evict.py.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier_offload.buffers import BlockBuffers, BufferList, RowArray
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, BadBlock, decode_header, encode_header
from kvtier_offload.iopool import IOPool
from kvtier_offload.jobs import Job, JobOutcome, JobTable, time_left
from kvtier_offload.layout import FORMAT_DIR, SUFFIX, key_fits
from kvtier_offload.lookup import BackgroundLookup, LookupCache
from kvtier_offload.metrics import Metrics
from kvtier_offload.removals import Removals
from kvtier_offload.write_admission import WriteAdmission

log = logging.getLogger("kvtier_offload")

WAIT_SECONDS = 120.0
# Settings that would put a secret into the kv-transfer-config (vLLM's command line).
CREDENTIAL_SETTINGS = frozenset({
    "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "access_key",
    "secret_key", "access_key_id", "secret_access_key", "session_token", "credentials",
    "password", "token"})
ADDRESSING_STYLES = ("auto", "path", "virtual")


class MissingPackage(ImportError):
    """boto3 is not installed where an object tier is configured."""


def refuse_credentials(settings: Mapping[str, Any]) -> None:
    """ValueError where a setting names a credential (the value is never shown)."""
    found = sorted(k for k in settings if k.lower() in CREDENTIAL_SETTINGS)
    if found:
        raise ValueError(
            f"the object tier takes no credentials in its settings ({', '.join(found)}): "
            "they would be on vLLM's command line. Give them from a Secret as the "
            "environment variables AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a "
            "credentials file (AWS_SHARED_CREDENTIALS_FILE)")


@dataclass
class ObjectStoreConfig:
    bucket: str
    fingerprint: str
    prefix: str = FORMAT_DIR  # objects go under <prefix>/<fingerprint>/
    endpoint_url: str | None = None  # None: AWS (or AWS_ENDPOINT_URL)
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION
    addressing_style: str = "auto"  # path for most non-AWS stores (Ceph RGW, MinIO)
    ca_bundle: str | None = None  # a CA file for a private endpoint (or AWS_CA_BUNDLE)
    max_concurrency: int = 16  # requests in flight at most (threads, connections)
    connect_timeout: float = 2.0  # seconds, every request
    read_timeout: float = 10.0  # seconds without a byte, every request
    max_attempts: int = 2  # tries per request (botocore's standard retry mode)
    write_queue_seconds: float = 10.0
    lookup_hit_ttl: float = 10.0
    lookup_miss_ttl: float = 1.0
    lookup_pending_seconds: float = 1.0
    lookup_threads: int = 4
    lookup_queue_limit: int = 65_536
    lookup_cache_entries: int = 500_000

    def check(self) -> None:
        """ValueError naming the setting that cannot work."""
        if not isinstance(self.bucket, str) or not self.bucket:
            raise ValueError("the object tier needs bucket: the S3 bucket's name")
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ValueError(f"addressing_style must be one of {', '.join(ADDRESSING_STYLES)}"
                             f", not {self.addressing_style!r}")
        for name in ("max_concurrency", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of 1 or more, not {value!r}")
        for name in ("connect_timeout", "read_timeout", "write_queue_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds above 0, not {value!r}")


def make_client(cfg: ObjectStoreConfig) -> Any:
    """A boto3 S3 client for cfg: bounded pool, timeouts and retries on every request."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as err:
        raise MissingPackage(
            "kvtier's object tier needs boto3, which is not installed in this Python "
            f"({err}); install it into the model server's image (pip install boto3, or "
            "kvtier[s3])") from err
    config = Config(
        connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout,
        retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
        max_pool_connections=cfg.max_concurrency + cfg.lookup_threads,
        s3={"addressing_style": cfg.addressing_style},
        # Our own digest verifies every block; the newer default checksums (trailers in
        # aws-chunked bodies) are refused by many S3-compatible servers.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="kvtier-offload")
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region,
                          verify=cfg.ca_bundle if cfg.ca_bundle else None, config=config)


def error_code(err: BaseException) -> str:
    """A short label for a failed request: the S3 error code, or the exception's type."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
    return type(err).__name__


def _missing(err: BaseException) -> bool:
    return error_code(err) in ("NoSuchKey", "404", "NotFound")


@dataclass(frozen=True)
class ObjectLayout:
    """Where a configuration's blocks live in the bucket (duck-types layout.Layout's
    root and fingerprint for the tier's log line and config info)."""
    bucket: str
    prefix: str
    fingerprint: str

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def base(self) -> str:
        return f"{self.prefix}/{self.fingerprint}"

    def name(self, key: bytes) -> str:
        return f"{self.base}/{key.hex()}{SUFFIX}"


class ObjectStore:
    """Loads and stores of whole jobs of blocks as objects, and lookups from a cache:
    the block store's interface (store.BlockStore), so the vLLM tier drives either."""

    def __init__(self, config: ObjectStoreConfig, metrics: Metrics | None = None,
                 client: Any = None) -> None:
        config.check()
        self.cfg = config
        self.layout = ObjectLayout(config.bucket, config.prefix.strip("/"), config.fingerprint)
        self.metrics = metrics or Metrics()
        self.removals: Removals | None = None  # the objects removed, for KV events
        self.client = client if client is not None else make_client(config)
        self._logged: set[str] = set()
        self._jobs = JobTable(self.metrics.in_queue)
        self._lookups = LookupCache(config.lookup_hit_ttl, config.lookup_miss_ttl,
                                    config.lookup_cache_entries)
        self._admission = WriteAdmission("", config.write_queue_seconds, 0.0)
        reads = max(1, config.max_concurrency * 3 // 4)
        self._pool = IOPool(reads, config.max_concurrency - reads, name="kvtier-s3")
        self._admission.writers = self._pool.write_threads or self._pool.threads
        self._background = BackgroundLookup(self._head, config.lookup_threads,
                                            config.lookup_queue_limit,
                                            min(config.lookup_pending_seconds,
                                                config.lookup_hit_ttl / 2),
                                            name="kvtier-s3-lookup")
        self._closed = False

    def _log_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(message + " (logged once; see kvtier_offload_* metrics)", *args)

    # ----------------------------------------------------------------- lookup

    def _head(self, key: bytes) -> None:
        try:
            answer = self.client.head_object(Bucket=self.cfg.bucket, Key=self.layout.name(key))
            present = int(answer.get("ContentLength", 0)) > HEADER_SIZE
        except Exception as err:
            present = False
            if not _missing(err):
                self.metrics.lookups.labels("error").inc()
                self._log_once(f"head-{error_code(err)}", "kvtier object lookups fail "
                               "(%s); answering miss", error_code(err))
        self._lookups.remember((key,), present)
        self.metrics.lookups.labels("hit" if present else "miss").inc()

    def lookup(self, key: bytes, patient: bool = False) -> bool | None:
        """True/False from the cache, or None while a HEAD request runs. patient: the
        caller bounds the wait itself (recompute_bound.py), as with the block store."""
        if not key_fits(key):
            return False
        cached = self._lookups.get(key)
        if cached is not None:
            return cached
        if self._background.ask(key, patient):
            return None
        self.metrics.lookups.labels("overdue").inc()
        return False

    def stat_seconds(self) -> float | None:
        """The store's measured round trip for one HEAD (lookup.BackgroundLookup)."""
        return self._background.stat_seconds()

    def expected_lookup_wait(self) -> float | None:
        """How long the HEADs waiting now will take, at the measured round trip."""
        return self._background.expected_wait()

    def forget(self, key: bytes) -> None:
        self._lookups.forget(key)

    # ------------------------------------------------------------------- jobs

    def finished(self) -> list[JobOutcome]:
        return self._jobs.finished()

    def pending_jobs(self) -> int:
        return self._jobs.pending()

    def drain(self, timeout: float | None = WAIT_SECONDS) -> bool:
        return self._jobs.wait(timeout)

    # ------------------------------------------------------------------ store

    def store(self, job_id: int, items: Sequence[tuple[bytes, memoryview]]) -> None:
        self._store(job_id, [k for k, _ in items], BufferList([d for _, d in items]))

    def store_rows(self, job_id: int, keys: Sequence[bytes], rows: np.ndarray,
                   row_ids: Sequence[int] | np.ndarray) -> None:
        self._store(job_id, list(keys), RowArray(rows, np.asarray(row_ids, dtype=np.int64)))

    def _store(self, job_id: int, keys: list[bytes], sources: BlockBuffers) -> None:
        job = self._jobs.start(job_id, "store", keys)
        if not self._admission.admit(sources.total()):
            self.metrics.dropped.labels("queue-full").inc(len(keys))
            self._log_once("queue-full", "kvtier object store's write queue is over its "
                           "%.1fs budget; dropping stores", self.cfg.write_queue_seconds)
            self._jobs.report(job, [(i, False, 0) for i in range(len(keys))])
            return
        enqueued = time.monotonic()
        for index in range(len(keys)):
            self._pool.submit_write(functools.partial(self._put, job, keys, sources, index,
                                                      enqueued))

    def _put(self, job: Job, keys: list[bytes], sources: BlockBuffers, index: int,
             enqueued: float) -> None:
        key, data = keys[index], sources.view(index)
        ok = False
        try:
            start = time.monotonic()
            late = self._admission.late(enqueued, start)
            if late is not None:
                self.metrics.dropped.labels(late).inc()
            elif not key_fits(key):
                self.metrics.operations.labels("store", "bad-key").inc()
            elif self._lookups.get(key):
                self.metrics.operations.labels("store", "exists").inc()
                ok = True  # another replica stored it: the same bytes
            else:
                body = encode_header(self.layout.fingerprint, key, len(data), digest(data))
                self.client.put_object(Bucket=self.cfg.bucket, Key=self.layout.name(key),
                                       Body=b"".join((body, data)))
                took = time.monotonic() - start
                self._admission.written(len(data), took, 1)
                self._lookups.remember((key,), True)
                self.metrics.store_ok.inc()
                self.metrics.store_bytes.inc(len(data))
                self.metrics.store_latency.observe(took)
                ok = True
        except Exception as err:
            code = error_code(err)
            self.metrics.failed.labels(code).inc()
            self._log_once(f"put-{code}", "kvtier cannot store objects in %s: %s",
                           self.layout.root, code)
        finally:
            self._admission.settle(len(data), 0)
            self._jobs.report(job, [(index, ok, len(data) if ok else 0)])

    # ------------------------------------------------------------------- load

    def load(self, job_id: int, items: Sequence[tuple[bytes, memoryview]]) -> None:
        self._load(job_id, [k for k, _ in items], BufferList([d for _, d in items]))

    def load_rows(self, job_id: int, keys: Sequence[bytes], rows: np.ndarray,
                  row_ids: Sequence[int] | np.ndarray, urgent: bool = False) -> None:
        self._load(job_id, list(keys), RowArray(rows, np.asarray(row_ids, dtype=np.int64)))

    def _load(self, job_id: int, keys: list[bytes], dests: BlockBuffers) -> None:
        job = self._jobs.start(job_id, "load", keys)
        for index in range(len(keys)):
            self._pool.submit_read(functools.partial(self._get, job, keys, dests, index))

    def _get(self, job: Job, keys: list[bytes], dests: BlockBuffers, index: int) -> None:
        key, dest = keys[index], dests.view(index)
        ok = False
        try:
            ok = self._get_verified(key, dest)
        finally:
            self._jobs.report(job, [(index, ok, len(dest) if ok else 0)])

    def _get_verified(self, key: bytes, dest: memoryview) -> bool:
        if not key_fits(key):
            self.metrics.operations.labels("load", "bad-key").inc()
            return False
        name = self.layout.name(key)
        start = time.monotonic()
        try:
            answer = self.client.get_object(Bucket=self.cfg.bucket, Key=name)
            body = answer["Body"]
            try:
                length = int(answer.get("ContentLength", -1))
                if length != HEADER_SIZE + len(dest):
                    raise BadBlock("bad-length", f"{length} bytes, expected "
                                   f"{HEADER_SIZE + len(dest)}")
                header = bytearray(HEADER_SIZE)
                if _read_into(body, memoryview(header)) != HEADER_SIZE:
                    raise BadBlock("truncated", "short header")
                expected = decode_header(memoryview(header), self.layout.fingerprint, key,
                                         len(dest))
                if _read_into(body, dest) != len(dest):
                    raise BadBlock("truncated", "short payload")
            finally:
                body.close()
            if digest(dest) != expected:
                raise BadBlock("bad-checksum", "payload checksum mismatch")
        except BadBlock as bad:
            self.metrics.corrupt.labels(bad.reason).inc()
            self._lookups.remember((key,), False)
            removed = self._delete(name)
            if removed and self.removals is not None:
                self.removals.add([key])  # BlockRemoved, where the tier has KV events
            self._log_once(f"bad-{bad.reason}", "kvtier refused object %s (%s); %s, vLLM "
                           "recomputes", name, bad,
                           "deleted it" if removed else "could not delete it")
            return False
        except Exception as err:
            code = error_code(err)
            if _missing(err):
                self._lookups.remember((key,), False)
                self.metrics.operations.labels("load", "missing").inc()
            else:
                self.metrics.operations.labels("load", code).inc()
                self._log_once(f"get-{code}", "kvtier cannot read objects from %s: %s",
                               self.layout.root, code)
            return False
        self._lookups.remember((key,), True)
        self.metrics.load_ok.inc()
        self.metrics.load_bytes.inc(len(dest))
        self.metrics.load_latency.observe(time.monotonic() - start)
        return True

    def _delete(self, name: str) -> bool:
        try:
            self.client.delete_object(Bucket=self.cfg.bucket, Key=name)
        except Exception:
            return False
        return True

    # --------------------------------------------------------------- lifetime

    def close(self, timeout: float | None = WAIT_SECONDS) -> bool:
        """Finish queued work and stop the threads within timeout seconds (see
        BlockStore.close); the client's connections are closed last."""
        if self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self.drain(timeout)
        self._closed = True
        self._background.stop()
        stopped = self._pool.close(time_left(deadline))
        joined = self._background.join(deadline)
        if drained and stopped and joined:
            close = getattr(self.client, "close", None)
            if close is not None:
                close()
            return True
        log.warning("kvtier object store: closed with requests still in flight after "
                    "%.1fs; left them behind", timeout)
        return False


def _read_into(body: Any, dest: memoryview) -> int:
    """Fill dest from a response body; the bytes read (fewer where the body ended)."""
    view = dest.cast("B")
    got = 0
    while got < len(view):
        n = body.readinto(view[got:])
        if not n:
            break
        got += n
    return got


__all__ = ["CREDENTIAL_SETTINGS", "MissingPackage", "ObjectLayout", "ObjectStore",
           "ObjectStoreConfig", "error_code", "make_client", "refuse_credentials"]
