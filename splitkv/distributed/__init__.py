"""Decode attention across several GPUs: context parallelism over NCCL, and head parallelism.

Context parallelism (long requests): each rank holds a contiguous, page-aligned token range of
every request (``shard_page_table``), runs splitkv on it with the LSE returned, and the ranks
all-gather their (output, LSE) states in one float32 buffer and merge them
(``ContextParallelDecode``). Head parallelism (tensor parallelism): each rank owns a block of
KV heads and the query heads that read them (``head_shard``) and needs no exchange at all.
See README.md in this folder for both, with examples, and ``launch`` for starting the ranks.

The sharding, the wire format of the states, the rendezvous and the launcher are pure Python
(+ NumPy) and import without CuPy; ``NcclGroup``, ``init_process_group`` and
``ContextParallelDecode`` use CuPy (through ``splitkv.runtime``) when first used.
"""

from .sharding import compact_page_table, head_shard, shard_page_table, shard_token_ranges

__all__ = ["ContextParallelDecode", "NcclGroup", "compact_page_table", "head_shard",
           "init_process_group", "shard_page_table", "shard_token_ranges"]


def __getattr__(name):
    if name == "ContextParallelDecode":
        from .context_parallel import ContextParallelDecode
        return ContextParallelDecode
    if name in ("NcclGroup", "init_process_group"):
        from . import nccl
        return getattr(nccl, name)
    raise AttributeError(f"module 'splitkv.distributed' has no attribute {name!r}")
