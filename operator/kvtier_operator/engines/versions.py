"""Engine versions as an input: a version, a feature with the first version that has it,
and an engine's table of them (engines/<engine>/versions.py holds the knowledge).

The version of a cache is spec.engineVersion where given; a pod's is its image's release
tag where the adapter's table can read one. Unknown means the table's oldest supported
version. A feature a spec asks for that its version lacks is refused (validation, the
CRD's CEL rule, `kvtier render`); a pod whose image says such a version is a conflict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = re.compile(r"v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(?:\.(0|[1-9][0-9]*))?")
# spec.engineVersion: major.minor or major.minor.patch, no leading zeros (the CRD pattern).
SPEC_PATTERN = r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))?$"


@dataclass(frozen=True, order=True)
class Version:
    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> Version | None:
        """'0.33', '0.33.1', 'v0.33.0' -> Version; anything else None."""
        m = _VERSION.fullmatch(text.strip())
        if m is None:
            return None
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}" + (f".{self.patch}" if self.patch else "")


@dataclass(frozen=True)
class Feature:
    """Something kvtier renders that an engine has only from `minimum` on."""

    key: str  # stable id (docs, tests)
    title: str  # what it is, for messages: "vLLM's sync_load_budget_bytes"
    minimum: Version
    source: str  # why this minimum: the upstream change or where it was checked
    # CEL on spec: whether the spec asks for it (None: no spec field asks for it alone).
    cel_asked: str | None = None


@dataclass(frozen=True)
class Asked:
    """A feature a spec asks for, and the field (or setting) that asks."""

    feature: Feature
    by: str  # "spec.syncLoadBudget", "spec.storage.backend vllm-fs"


def _at_least(n: int) -> str:
    """A regex for a decimal integer (no leading zeros) >= n."""
    s = str(n)
    alts = [s[:i] + f"[{int(d) + 1}-9]" + "[0-9]" * (len(s) - i - 1)
            for i, d in enumerate(s) if d != "9"]
    alts += [s, f"[1-9][0-9]{{{len(s)},}}"]
    return "(" + "|".join(alts) + ")"


def cel_at_least(field: str, minimum: Version) -> str:
    """CEL: the version string in `field` (SPEC_PATTERN) is >= minimum's major.minor."""
    higher = _at_least(minimum.major + 1)
    regex = f"^({higher}\\\\.[0-9]+|{minimum.major}\\\\.{_at_least(minimum.minor)})(\\\\.[0-9]+)?$"
    return f"{field}.matches('{regex}')"


@dataclass(frozen=True)
class VersionTable:
    """One engine's versions: the oldest kvtier supports (what an unknown version is
    treated as), the newest it was tested with, its features, and how its images say
    their version."""

    engine: str  # "vLLM"
    oldest: Version
    newest_tested: Version
    features: tuple[Feature, ...]
    # Image repositories (without registry host) whose tags are the engine's releases.
    release_repositories: frozenset[str]

    def image_version(self, image: str | None) -> Version | None:
        """The version an image's tag says, where the image is one of the engine's
        release repositories and the tag a release (v0.33.0, 0.33.0); else None."""
        if not image or "@" in image:
            return None
        name, _, tag = image.rpartition(":")
        if not name or "/" in tag:
            return None
        parts = name.split("/")
        if len(parts) > 2 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
            parts = parts[1:]  # a registry host
        elif len(parts) == 3 and parts[0] == "docker.io":
            parts = parts[1:]
        if "/".join(parts) not in self.release_repositories:
            return None
        if re.fullmatch(r"v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)", tag) is None:
            return None
        return Version.parse(tag)

    def missing(self, version: Version, asked: list[Asked]) -> list[Asked]:
        return [a for a in asked if (version.major, version.minor) <
                (a.feature.minimum.major, a.feature.minimum.minor)]
