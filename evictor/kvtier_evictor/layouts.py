"""The cache file layouts the evictor may touch. Anything else on the volume is never
touched: a file is a candidate only when every directory above it and its own name match
the layout in use.

Every pattern must match a whole name (`fullmatch`): with `re.match` and `$`, a name
ending in a newline ("<key>.kvb\n", "kvtier\n") would pass as the name without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    BLOCK = "block"
    TEMP = "temp"


@dataclass(frozen=True)
class Layout:
    name: str
    # One pattern per directory level below the volume root, outermost first.
    dir_levels: tuple[re.Pattern[str], ...]
    block_file: re.Pattern[str]
    temp_file: re.Pattern[str] | None
    # Directories at levels below this index may be removed when empty and old.
    first_removable_level: int
    # Units of parallel scanning: directories whose children match dir_levels[parallel_level].
    parallel_level: int

    def dir_matches(self, level: int, name: str) -> bool:
        """Whether a directory named `name` belongs at `level` below the volume root."""
        return self.dir_levels[level].fullmatch(name) is not None

    def classify(self, name: str) -> Kind | None:
        if self.block_file.fullmatch(name):
            return Kind.BLOCK
        if self.temp_file is not None and self.temp_file.fullmatch(name):
            return Kind.TEMP
        return None


def _p(pattern: str) -> re.Pattern[str]:
    """A pattern for whole names, ASCII classes only. Callers use fullmatch; the `\\Z`
    makes `match` whole-name too, so no caller can get it wrong."""
    return re.compile(rf"(?:{pattern})\Z", re.ASCII)


# kvtier backend: <root>/kvtier/v1/<fingerprint>/<k[0:2]>/<k[2:4]>/<key>.kvb, written via
# .<key>.kvb.<random>.tmp in the same directory (offload/kvtier_offload/layout.py).
KVTIER = Layout(
    name="kvtier",
    dir_levels=(_p(r"kvtier"), _p(r"v1"), _p(r"[0-9a-f]{16}"), _p(r"[0-9a-f]{2}"),
                _p(r"[0-9a-f]{2}")),
    block_file=_p(r"[0-9a-f]{8,}\.kvb"),
    temp_file=_p(r"\.[0-9a-f]{8,}\.kvb\.[0-9a-f]+\.tmp"),
    first_removable_level=3,
    parallel_level=4,  # one unit per <k[0:2]> directory: 256 per fingerprint
)

# vLLM's built-in fs tier (0.22+):
# <root>/<model>_<sha256[:12]>_r<rank>/<hex[0:3]>/<hex[3:5]>_g<group>/<hex>.bin,
# written via <hex>.bin_<random>.tmp.
VLLM_FS = Layout(
    name="vllm-fs",
    dir_levels=(_p(r".+_[0-9a-f]{12}_r\d+"), _p(r"[0-9a-f]{3}"), _p(r"[0-9a-f]{2}_g\d+")),
    block_file=_p(r"[0-9a-f]+\.bin"),
    temp_file=_p(r"[0-9a-f]+\.bin_\d+\.tmp"),
    first_removable_level=1,
    parallel_level=2,  # one unit per <hex[0:3]> directory
)

# LMCache's local disk backend under the directory kvtier points LMCACHE_LOCAL_DISK at.
LMCACHE = Layout(
    name="lmcache",
    dir_levels=(_p(r"lmcache"),),
    block_file=_p(r"[^.].*"),
    temp_file=None,
    first_removable_level=1,
    parallel_level=1,
)

# SGLang's HiCache file tier (sglang 0.5.23, mem_cache/hicache_storage.py HiCacheFile), flat
# in the directory kvtier points SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR at:
#   <root>/sglang/<sha256 hex>[.<pool>]_<model>[_<tp rank>_<tp size>][<shard suffixes>].bin
# <model> is the served model name with "/" turned into "-" (any other character kept),
# MLA models drop the TP part, PP/CP/DCP add theirs, and pool pages other than the KV
# pool (mamba, swa, ...) carry ".<pool>" after the hash. Writes go to .<uuid4 hex>.tmp in
# the same directory and are renamed into place.
SGLANG = Layout(
    name="sglang",
    dir_levels=(_p(r"sglang"),),
    block_file=_p(r"[0-9a-f]{64}(?:\.[a-z][a-z0-9_]*)?_[^\x00-\x1f\x7f]+\.bin"),
    temp_file=_p(r"\.[0-9a-f]{32}\.tmp"),
    first_removable_level=1,
    parallel_level=1,  # one flat directory: one unit
)

LAYOUTS = {layout.name: layout for layout in (KVTIER, VLLM_FS, LMCACHE, SGLANG)}
