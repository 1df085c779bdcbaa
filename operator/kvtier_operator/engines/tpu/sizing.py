"""vLLM on TPU (tpu-inference) sizing; docs/sizing.md explains it."""

from __future__ import annotations

from kvtier_operator.api.v1alpha1 import TieredPrefixCacheSpec

# tpu-inference's TPUOffloadConnector: one CPU chunk is one vLLM block (page) of the TPU
# KV cache, all layers; the CPU tier holds TPU_OFFLOAD_NUM_CPU_CHUNKS of them in pinned
# host memory (each host of a multi-host replica its shard of every chunk); the staging
# buffer (TPU_OFFLOAD_NUM_STAGING_BLOCKS blocks) is carved out of HBM.
TPU_DEFAULT_STAGING_BLOCKS = 128  # tpu-inference's default


def tpu_chunk_bytes(spec: TieredPrefixCacheSpec) -> int:
    assert spec.tpu is not None
    return spec.tpu.page_size * spec.model.bytes_per_token


def tpu_cpu_chunks(spec: TieredPrefixCacheSpec) -> int:
    """TPU_OFFLOAD_NUM_CPU_CHUNKS: whole chunks that fit in cpu.size."""
    return spec.cpu_bytes // tpu_chunk_bytes(spec)


def tpu_staging_blocks(spec: TieredPrefixCacheSpec) -> int:
    """TPU_OFFLOAD_NUM_STAGING_BLOCKS: whole blocks in tpu.hbmStagingSize, else the default."""
    assert spec.tpu is not None
    if spec.tpu.staging_bytes is None:
        return TPU_DEFAULT_STAGING_BLOCKS
    return spec.tpu.staging_bytes // tpu_chunk_bytes(spec)


def tpu_host_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Pinned host memory of one TPU host (pod): its shard of every chunk."""
    assert spec.tpu is not None
    total = tpu_cpu_chunks(spec) * tpu_chunk_bytes(spec)
    return -(-total // spec.tpu.hosts)


def tpu_router_blocks(spec: TieredPrefixCacheSpec, router_block: int) -> int:
    """The CPU tier in the router's blocks: chunks x page tokens / router block tokens."""
    assert spec.tpu is not None
    return tpu_cpu_chunks(spec) * spec.tpu.page_size // router_block
