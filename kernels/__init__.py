"""chatserve_kernels — paged-attention kernels (Triton on CUDA) and their plain-torch twins.

Imported as `chatserve_kernels` (this folder is mapped to that name in pyproject.toml) so nothing
mistakes it for PyPI's `kernels` package. Each public function picks Triton on CUDA tensors and the
torch twin elsewhere; the twins are the CPU path and the test oracle. See docs/kernels.md.
"""
from chatserve_kernels.attention import paged_attention
from chatserve_kernels.block_copy import copy_blocks
from chatserve_kernels.dispatch import HAS_TRITON
from chatserve_kernels.kv_store import store_kv
from chatserve_kernels.metadata import AttentionMetadata
from chatserve_kernels.quant import KV_CACHE_DTYPES, allocate_kv_cache, kv_bytes_per_token

# No name exported here is also a submodule's name, so `chatserve_kernels.X` means one thing.
__all__ = ["AttentionMetadata", "store_kv", "copy_blocks", "paged_attention", "allocate_kv_cache",
           "kv_bytes_per_token", "KV_CACHE_DTYPES", "HAS_TRITON"]
