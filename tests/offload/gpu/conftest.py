"""The GPU tests run with torch alone: where vLLM does not import (the GPU machines this
project borrows), the worker's few vLLM 0.32 types come from tests/offload/vllm032.py."""

from tests.offload import vllm032

vllm032.install()
