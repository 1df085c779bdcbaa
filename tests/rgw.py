"""A throwaway S3 server: Ceph's RADOS Gateway over a one-node Ceph cluster (one monitor,
one OSD on memstore: objects in the OSD's memory), all of it our child processes, all
state under a base directory, listening on loopback only. A real S3 implementation
(SigV4, multipart, listing, errors as S3 says them), not an in-process mock, in the way
GlusterFS stands in for a network filesystem (tests/glusterfs.py).

    with rgw_server(Path("/tmp/x")) as s3:
        s3.client()                   # a boto3 client with the test user's keys
        s3.env()                      # AWS_* variables, as a Kubernetes Secret gives them

Start-up takes about 10-15 s on 2 cores (the suite starts one per session: tests/s3).
Where it cannot run (packages missing, a daemon failing) RGWUnavailable says why.

Packages: Debian's ceph-mon, ceph-osd and radosgw (16.2 on bookworm); `make test` installs
them where it runs as root with apt-get (the Makefile's ceph-packages target).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool",
            "ceph-authtool")
INSTALL_HINT = "install Debian's ceph-mon, ceph-osd and radosgw (make test does, as root)"
START_SECONDS = 120.0


class RGWUnavailable(RuntimeError):
    """An S3 server cannot be started here; the message says why."""


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    base: Path
    region: str = "us-east-1"
    start_seconds: float = 0.0
    processes: list[subprocess.Popen] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """The environment a pod gets from a Secret (and the endpoint's address)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": self.region}

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=self.region,
            config=Config(s3={"addressing_style": "path"},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required", **config))


def unavailable_reason() -> str | None:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not found: {INSTALL_HINT}"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (make test installs it: kvtier[s3])"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], timeout: float = 60) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise RGWUnavailable(f"{' '.join(cmd[:3])} timed out") from err
    if result.returncode != 0:
        raise RGWUnavailable(f"{' '.join(cmd[:3])} failed: "
                             f"{(result.stderr or result.stdout).strip()[-400:]}")
    return result.stdout


def _config(base: Path, fsid: str, mon_port: int, rgw_port: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
ms bind ipv6 = false
auth allow insecure global id reclaim = false
run dir = {base}/run
admin socket = {base}/run/$name.asok
log file = {base}/log/$name.log
pid file = {base}/run/$name.pid
keyring = {base}/keyring
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
mon data = {base}/mon/$cluster-$id
osd data = {base}/osd/$cluster-$id
osd objectstore = memstore
memstore device bytes = 1073741824
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {base}/rgw
"""


def _wait(what: str, check: Any, deadline: float, procs: list[subprocess.Popen]) -> None:
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RGWUnavailable(f"{p.args[0]} exited ({p.returncode}) while waiting "
                                     f"for {what}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.2)
    raise RGWUnavailable(f"timed out waiting for {what}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def rgw_server(base: Path) -> Iterator[S3Server]:
    """Start a monitor, an OSD and a RADOS Gateway under base with one S3 user; stop
    them and remove base on exit."""
    reason = unavailable_reason()
    if reason:
        raise RGWUnavailable(reason)
    began = time.monotonic()
    deadline = began + START_SECONDS
    for sub in ("run", "log", "mon", "osd/ceph-0", "rgw"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    conf = base / "ceph.conf"
    mon_port, rgw_port = _free_port(), _free_port()
    fsid = str(uuid.uuid4())
    conf.write_text(_config(base, fsid, mon_port, rgw_port))
    ceph = ["-c", str(conf)]
    procs: list[subprocess.Popen] = []
    try:
        keyring = str(base / "keyring")
        _run(["ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.",
              "--cap", "mon", "allow *"])
        for name in ("client.admin", "osd.0", "client.rgw"):
            _run(["ceph-authtool", keyring, "--gen-key", "-n", name, "--cap", "mon",
                  "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *"])
        _run(["monmaptool", "--create", "--fsid", fsid, "--addv", "a",
              f"[v2:127.0.0.1:{mon_port}]", str(base / "monmap")])
        _run(["ceph-mon", *ceph, "--mkfs", "-i", "a", "--monmap", str(base / "monmap"),
              "--keyring", keyring])
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        procs.append(subprocess.Popen(["ceph-mon", *ceph, "-f", "-i", "a"], **quiet))
        osd_uuid = str(uuid.uuid4())
        _run(["ceph", *ceph, "--connect-timeout", "30", "osd", "new", osd_uuid])
        _run(["ceph-osd", *ceph, "-i", "0", "--mkfs", "--osd-uuid", osd_uuid])
        procs.append(subprocess.Popen(["ceph-osd", *ceph, "-f", "-i", "0"], **quiet))
        _wait("the OSD", lambda: json.loads(_run(
            ["ceph", *ceph, "osd", "stat", "-f", "json"], timeout=15))["num_up_osds"] == 1,
            deadline, procs)
        procs.append(subprocess.Popen(["radosgw", *ceph, "-f", "-n", "client.rgw"], **quiet))
        access, secret = f"KVTIER{secrets.token_hex(7).upper()}", secrets.token_hex(20)
        _wait("the S3 user", lambda: bool(_run(
            ["radosgw-admin", *ceph, "user", "create", "--uid", "kvtier", "--display-name",
             "kvtier tests", "--access-key", access, "--secret", secret], timeout=30)),
            deadline, procs)
        endpoint = f"http://127.0.0.1:{rgw_port}"
        _wait("the gateway", lambda: urllib.request.urlopen(endpoint, timeout=2).status == 200,
              deadline, procs)
        yield S3Server(endpoint, access, secret, base,
                       start_seconds=time.monotonic() - began, processes=procs)
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(Exception):
                _stop(proc)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    """`python -m tests.rgw`: start a server, print its address and keys, wait for Enter."""
    import tempfile
    with rgw_server(Path(tempfile.mkdtemp(prefix="kvtier-rgw-"))) as s3:
        print(f"S3 at {s3.endpoint} (up in {s3.start_seconds:.1f}s); "
              f"AWS_ACCESS_KEY_ID={s3.access_key} AWS_SECRET_ACCESS_KEY={s3.secret_key}; "
              "Enter stops it")
        input()


if __name__ == "__main__":
    main()
