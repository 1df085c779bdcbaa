"""The evictor's JSON summary: the schema the operator reads from the termination message.

This module is the one piece of kvtier_evictor the operator imports; keep it stdlib-only
and backwards compatible (add fields, never rename them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 1
# Kubernetes keeps at most 4096 bytes of a termination message.
TERMINATION_MESSAGE_LIMIT = 4096

NOTHING_TO_DO = "nothing-to-do"
FREED = "freed"
ABOVE_LOW_WATERMARK = "above-low-watermark"
ERROR = "error"
OUTCOMES = (NOTHING_TO_DO, FREED, ABOVE_LOW_WATERMARK, ERROR)

# Exit codes of `kvtier-evictor`, one per outcome.
EXIT_CODES = {NOTHING_TO_DO: 0, ERROR: 1, ABOVE_LOW_WATERMARK: 2, FREED: 3}


@dataclass
class Usage:
    used_bytes: int = 0
    capacity_bytes: int = 0
    used_inodes: int = 0
    capacity_inodes: int = 0

    @property
    def percent(self) -> float:
        return 100.0 * self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def inode_percent(self) -> float:
        return 100.0 * self.used_inodes / self.capacity_inodes if self.capacity_inodes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "percent": round(self.percent, 2),
                "inode_percent": round(self.inode_percent, 2)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Usage:
        names = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in data.items() if k in names})


@dataclass
class EvictionReport:
    outcome: str = NOTHING_TO_DO
    layout: str = ""
    dry_run: bool = False
    started_at: str = ""
    finished_at: str = ""
    duration_seconds: float = 0.0
    usage_source: str = "statvfs"  # or "budget" (usage against --capacity-bytes)
    usage_before: Usage = field(default_factory=Usage)
    usage_after: Usage = field(default_factory=Usage)
    files_scanned: int = 0
    files_deleted: int = 0
    # The fewest of the oldest files whose bytes, with the directories they leave empty,
    # reach the target (as the usage stood when deletion began): files_deleted exceeds
    # it only where files were kept (skipped_changed) or writers kept writing.
    files_minimum: int = 0
    bytes_freed: int = 0  # files, temp files and directories
    dir_bytes_freed: int = 0  # the share of bytes_freed that was emptied directories
    skipped_recent: int = 0
    skipped_changed: int = 0  # used again between selection and unlink
    temp_files_reaped: int = 0
    dirs_removed: int = 0
    threads: int = 0  # scanning and deleting threads (0: no scan)
    passes: int = 0  # scans that chose files: more than one where the candidate bound held
    scan_seconds: float = 0.0
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    # Where another run's lock stopped this one: seconds since that lock was refreshed
    # (the operator tells a lock held across runs from one run overlapping another).
    lock_held_seconds: float | None = None
    # BlockRemoved for the deleted block files (--events-endpoint): hashes handed to the
    # router's socket, dropped (no connection, a full queue, no pyzmq), names ignored
    # (outside the layout's hash mapping), and the first problem.
    events_published: int = 0
    events_dropped: int = 0
    events_ignored: int = 0
    events_problem: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["usage_before"] = self.usage_before.to_dict()
        data["usage_after"] = self.usage_after.to_dict()
        return data

    def to_json(self, limit: int | None = None) -> str:
        """Compact JSON; with a limit, error messages are dropped until it fits."""
        data = self.to_dict()
        text = json.dumps(data, separators=(",", ":"))
        while limit is not None and len(text.encode()) > limit and data["error_messages"]:
            data["error_messages"] = data["error_messages"][:-1]
            text = json.dumps(data, separators=(",", ":"))
        return text

    @classmethod
    def from_json(cls, text: str) -> EvictionReport:
        data = json.loads(text)
        if not isinstance(data, dict) or "outcome" not in data:
            raise ValueError("not an evictor report: no outcome")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for key in ("usage_before", "usage_after"):
            if isinstance(kwargs.get(key), dict):
                kwargs[key] = Usage.from_dict(kwargs[key])
        return cls(**kwargs)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]
