"""`kvtier-evictor`: one run over the shared KV volume, then a JSON summary.

The summary goes to stdout and to the termination-message file, where the operator
reads it; the exit code names the outcome.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvtier_evictor.evict import Config, Run
from kvtier_evictor.layouts import LAYOUTS
from kvtier_evictor.report import (
    ERROR,
    EXIT_CODES,
    FREED,
    NOTHING_TO_DO,
    TERMINATION_MESSAGE_LIMIT,
    EvictionReport,
)


def _percent(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text} is not a percentage (0-100)")
    return value


def build_parser() -> argparse.ArgumentParser:
    codes = ", ".join(f"{code} {outcome}" for outcome, code in EXIT_CODES.items())
    p = argparse.ArgumentParser(
        prog="kvtier-evictor", description=__doc__,
        epilog=f"exit codes: {codes}. With --ok-exit-zero, {FREED} exits 0 too (a CronJob "
        "then marks only real problems as failed Jobs).",
    )
    p.add_argument("--root", required=True, help="the mounted cache volume")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="kvtier",
                   help="which cache files may be deleted; nothing else is touched")
    p.add_argument("--high-watermark", type=_percent, default=85.0)
    p.add_argument("--low-watermark", type=_percent, default=70.0)
    p.add_argument("--inode-high-watermark", type=_percent, default=90.0)
    p.add_argument("--inode-low-watermark", type=_percent, default=80.0)
    p.add_argument("--min-idle-seconds", type=float, default=600.0,
                   help="never delete a file used more recently than this")
    p.add_argument("--temp-guard-seconds", type=float, default=3600.0,
                   help="reap temp files older than this (a writer died mid-write)")
    p.add_argument("--dir-guard-seconds", type=float, default=600.0,
                   help="remove empty cache directories older than this")
    p.add_argument("--capacity-bytes", type=int, default=None,
                   help="budget mode: usage is the cache's own bytes against this many "
                   "(for NFS/EFS/Lustre exports whose statvfs shows the whole export)")
    p.add_argument("--threads", type=int, default=0,
                   help="parallel scanners and deleters; 0 (default) measures how long "
                   "the first directories' calls wait on the filesystem (not on a busy "
                   "CPU) and uses 16 on a slow (network) filesystem, else 1")
    p.add_argument("--lock-stale-seconds", type=float, default=3600.0)
    p.add_argument("--max-candidates", type=int, default=500_000,
                   help="LRU candidates held at once (about 350 bytes each); a run that "
                   "must free more frees in passes, scanning again for each")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted")
    p.add_argument("--termination-log", default=None,
                   help="also write the JSON summary here (Kubernetes: /dev/termination-log)")
    p.add_argument("--ok-exit-zero", action="store_true",
                   help=f"exit 0 for {FREED} as well as {NOTHING_TO_DO}")
    p.add_argument("--events-endpoint", default=None,
                   help="publish BlockRemoved (vLLM's KV-events wire format) for every "
                   "block file deleted to this ZMQ endpoint, e.g. tcp://epp:5558, once a "
                   "subscriber there subscribed (needs kvtier[events]); failures are "
                   "counted in the report, never fail the run")
    p.add_argument("--events-topic", default="kv@kvtier@model",
                   help="the events' ZMQ topic, kv@<identity>@<model>; with "
                   "--events-pods-file only its model segment is used")
    p.add_argument("--events-pods-file", default=None,
                   help="publish each removal once per engine pod listed here (one "
                   "<ip>:<port> router identity a line, read at start, at most "
                   "64 KiB and 256 pods), under kv@<pod>@<model>; a missing or empty "
                   "file publishes nothing (counted as dropped, with why)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def write_termination_log(path: str, report: EvictionReport) -> None:
    try:
        with open(path, "w") as f:
            f.write(report.to_json(limit=TERMINATION_MESSAGE_LIMIT))
    except OSError as err:
        logging.getLogger("kvtier_evictor").warning("cannot write %s: %s", path, err)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.low_watermark >= args.high_watermark:
        print("kvtier-evictor: --low-watermark must be below --high-watermark", file=sys.stderr)
        return EXIT_CODES[ERROR]
    if args.inode_low_watermark >= args.inode_high_watermark:
        print("kvtier-evictor: --inode-low-watermark must be below --inode-high-watermark",
              file=sys.stderr)
        return EXIT_CODES[ERROR]
    publisher = None
    if args.events_endpoint and not args.dry_run:
        from kvtier_evictor.events import Publisher, pod_topics, read_event_pods

        topics, problem = [args.events_topic], ""
        if args.events_pods_file:
            pods, problem = read_event_pods(args.events_pods_file)
            topics = pod_topics(args.events_topic, pods)
        publisher = Publisher(args.events_endpoint, topics, args.layout, problem=problem)
    config = Config(
        root=args.root, layout=LAYOUTS[args.layout],
        high_watermark=args.high_watermark, low_watermark=args.low_watermark,
        inode_high_watermark=args.inode_high_watermark,
        inode_low_watermark=args.inode_low_watermark,
        min_idle_seconds=args.min_idle_seconds, temp_guard_seconds=args.temp_guard_seconds,
        dir_guard_seconds=args.dir_guard_seconds, capacity_bytes=args.capacity_bytes,
        threads=args.threads, dry_run=args.dry_run, lock_stale_seconds=args.lock_stale_seconds,
        max_candidates=max(args.max_candidates, 1),
        on_removed=publisher.removed if publisher is not None else None,
    )

    if not os.path.isdir(args.root):
        report = EvictionReport(outcome=ERROR, layout=args.layout, errors=1,
                                error_messages=[f"{args.root} is not a directory"])
    else:
        report = Run(config).execute()
    if publisher is not None:
        publisher.close()
        report.events_published = publisher.published
        report.events_dropped = publisher.dropped
        report.events_ignored = publisher.ignored
        report.events_problem = publisher.problem
    print(report.to_json())
    if args.termination_log:
        write_termination_log(args.termination_log, report)
    if args.ok_exit_zero and report.outcome == FREED:
        return 0
    return report.exit_code
