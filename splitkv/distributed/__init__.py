"""Decode attention across several GPUs: context parallelism over the caller's process group,
and head parallelism.

Context parallelism (long requests): each rank holds a contiguous, page-aligned token range of
every request (``shard_page_table``), runs splitkv on it with the LSE returned, and the ranks
all-gather their (output, LSE) states in one float32 buffer and merge them
(``ContextParallelDecode``). Head parallelism (tensor parallelism): each rank owns a block of
KV heads and the query heads that read them (``head_shard``) and needs no exchange at all.
See README.md in this folder for both, with examples.

splitkv starts no processes and makes no communicator: the job comes from ``torchrun`` (or an
engine's workers) and the group from the caller, a ``torch.distributed`` ProcessGroup or a
``cupyx.distributed`` communicator (``groups.py``). The sharding and the wire format of the
states are pure Python (+ NumPy); ``ContextParallelDecode`` imports torch or CuPy only for the
group it is given, when it is made.
"""

from .sharding import compact_page_table, head_shard, shard_page_table, shard_token_ranges

__all__ = ["ContextParallelDecode", "as_group", "compact_page_table", "head_shard",
           "shard_page_table", "shard_token_ranges"]


def __getattr__(name):
    if name == "ContextParallelDecode":
        from .context_parallel import ContextParallelDecode
        return ContextParallelDecode
    if name == "as_group":
        from .groups import as_group
        return as_group
    raise AttributeError(f"module 'splitkv.distributed' has no attribute {name!r}")
