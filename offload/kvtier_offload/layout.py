"""Where block files live on the shared volume.

    <root>/kvtier/v1/<fingerprint>/config.json
    <root>/kvtier/v1/<fingerprint>/<key[0:2]>/<key[2:4]>/<key>.kvb
    <root>/kvtier/v1/<fingerprint>/<key[0:2]>/<key[2:4]>/.<key>.kvb.<random>.tmp

The fingerprint isolates incompatible configurations; the two-level fan-out bounds any
directory to 256 entries of the next level. The evictor (evictor/kvtier_evictor/
layouts.py) matches exactly these names and nothing else: a key must be at least
MIN_KEY_BYTES long (the evictor wants 8 hex digits; a shorter key would also be shorter
than the fan-out it is filed under) and at most MAX_KEY_BYTES (its temp name must fit in
a file name). Other keys are refused, never filed somewhere the evictor does not look.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

from kvtier_offload.fileformat import VERSION

FORMAT_DIR = os.path.join("kvtier", "v1")
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
TOKEN_HEX_DIGITS = 16  # a temp name's random token: secrets.token_hex(8)
NAME_MAX = 255  # bytes in one file name (Linux filesystems, NFS, Lustre)
MIN_KEY_BYTES = 4  # 8 hex digits: the evictor's `[0-9a-f]{8,}\.kvb`
# .<hex key>.kvb.<token>.tmp must fit NAME_MAX: 114 bytes
MAX_KEY_BYTES = (NAME_MAX - len(f"..{SUFFIX}{TEMP_SUFFIX}") - TOKEN_HEX_DIGITS) // 2
DIR_MODE = 0o2775  # group-writable + setgid: an evictor with the pods' fsGroup may delete


def key_fits(key: object) -> bool:
    """Whether key can name a block file inside the layout (bytes of MIN_KEY_BYTES to
    MAX_KEY_BYTES); the store refuses any other key as a miss or a failed block."""
    return isinstance(key, bytes) and MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES


def fingerprint(config: dict[str, Any]) -> str:
    """16 hex digits identifying everything that makes two caches incompatible, the
    block file format included (a new format starts a new directory; the evictor ages
    the old one out)."""
    canonical = json.dumps({**config, "file_format": VERSION}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def vllm_fields(config: Any) -> dict[str, Any]:
    """The fields of vLLM's OffloadingConfig (0.26+) that decide whether two engines'
    KV bytes are interchangeable: model, dtype, block geometry, parallel and KV layout,
    and the vLLM version family (its on-disk conventions change between releases)."""
    import vllm  # only ever called inside vLLM

    parallel = config.parallel
    layout = getattr(config, "kv_cache_layout", None)
    return {
        "engine": "vllm",
        "vllm": ".".join(vllm.__version__.split(".")[:2]),
        "model": config.model.name,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [{"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
                   for g in config.groups],
        "tp": parallel.tp_size, "pp": parallel.pp_size,
        "pcp": parallel.pcp_size, "dcp": parallel.dcp_size,
        "replicated_layout": bool(getattr(config, "replicated_layout", False)),
        "canonical_layout": bool(getattr(config, "canonical_layout", False)),
        "kv_cache_layout": str(layout) if layout is not None else None,
    }


class Layout:
    def __init__(self, root: str, fp: str) -> None:
        self.root = root
        self.fingerprint = fp
        self.base = os.path.join(root, FORMAT_DIR, fp)

    def path(self, key: bytes) -> str:
        if not key_fits(key):
            raise ValueError(f"a block key must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, "
                             f"not {len(key) if isinstance(key, bytes) else type(key).__name__}")
        h = key.hex()
        # os.path.join is slower; the C extension builds the same names
        return f"{self.base}/{h[:2]}/{h[2:4]}/{h}{SUFFIX}"

    def temp_path(self, key: bytes, token: str = "") -> str:
        """Where a block is written before its atomic rename: a name the evictor knows,
        unique per writer by its random token (one per batch will do: a batch that
        meets its own temp file fails that block, and the retry draws another)."""
        directory, name = self.path(key).rsplit("/", 1)
        token = token or secrets.token_hex(TOKEN_HEX_DIGITS // 2)
        return f"{directory}/.{name}.{token}{TEMP_SUFFIX}"

    def ensure_dir(self, directory: str) -> None:
        """makedirs with group-writable directories whatever the umask: one mkdir where
        the directory is there already, mkdir and chmod where the parent is."""
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            return
        except FileNotFoundError:
            parent = os.path.dirname(directory)
            if not parent or parent == directory:
                raise
            self.ensure_dir(parent)
            try:
                os.mkdir(directory, DIR_MODE)
            except FileExistsError:
                return
        except OSError:
            if os.path.isdir(directory):
                return  # a read-only or foreign mount may say EROFS/EACCES for one that is
            raise
        try:
            os.chmod(directory, DIR_MODE)
        except OSError:
            pass  # some filesystems ignore modes; nothing depends on it locally

    def write_config(self, config: dict[str, Any]) -> None:
        """config.json beside the blocks, for people: written once, atomically; a volume
        that cannot take it (read-only, full) is no reason to fail."""
        try:
            self._write_config(config)
        except OSError:
            pass

    def _write_config(self, config: dict[str, Any]) -> None:
        self.ensure_dir(self.base)
        target = os.path.join(self.base, "config.json")
        if os.path.exists(target):
            return
        tmp = f"{target}.{secrets.token_hex(8)}.tmp"
        with open(tmp, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass
        except OSError:
            os.replace(tmp, target)
            return
        os.unlink(tmp)
