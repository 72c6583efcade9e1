"""The wire format of a rank's attention state and the merge of the gathered states.

One rank's state for a batch is its output ``o`` [batch, num_qo_heads, head_dim] and its LSE
[batch, num_qo_heads] (natural log), packed into ONE float32 buffer [batch, num_qo_heads,
head_dim + 1] (the LSE is the last column), so the exchange is a single all-gather. The
gathered buffer [num_ranks, batch, num_qo_heads, head_dim + 1] is unpacked as views and merged
with ``splitkv.merge_states_n``. A rank that holds none of a request's tokens sends zeros and
LSE -inf, which the merge ignores.

Every function takes NumPy or CuPy arrays (``xp`` is the array's module). The CPU path runs
them; the GPU runs their fused twins (``exchange_kernels.py``: one kernel packs, one merges and
casts), which the GPU tests compare with them. bfloat16 is handled as raw uint16 bits.
"""

from __future__ import annotations

from ..core.bfloat16 import bits_to_float32, float32_to_bits
from ..core.merge import merge_states_n
from ..core.bfloat16 import array_namespace


def storage_bits(arr):
    """A 16-bit array seen as uint16 (bfloat16 given as ml_dtypes or as uint16 bits)."""
    xp = array_namespace(arr)
    return arr if arr.dtype == xp.uint16 else arr.view(xp.uint16)


def pack_state(o, lse, send, dtype: str) -> None:
    """Write one rank's state into ``send`` [batch, num_qo_heads, head_dim + 1] (float32, or
    float64 in tests). ``o`` holds ``dtype``: "bfloat16" or "float16" (either may be given as
    uint16 bits), or "float" for an array that already holds floats."""
    head_dim = send.shape[-1] - 1
    xp = array_namespace(o)
    if dtype == "bfloat16":
        send[..., :head_dim] = bits_to_float32(storage_bits(o), xp)
    elif dtype == "float16":
        send[..., :head_dim] = storage_bits(o).view(xp.float16)
    else:
        send[..., :head_dim] = o
    send[..., head_dim] = lse


def merge_gathered(gathered):
    """Merge the states of all ranks. gathered: [num_ranks, batch, num_qo_heads, head_dim + 1].
    Returns (o [batch, num_qo_heads, head_dim], lse [batch, num_qo_heads]) in its dtype."""
    head_dim = gathered.shape[-1] - 1
    return merge_states_n(gathered[..., :head_dim], gathered[..., head_dim])


def store_output(o, out, dtype: str) -> None:
    """Write a merged float output into ``out``, which holds ``dtype`` ("bfloat16" or "float16",
    either as its own dtype or as uint16 bits)."""
    xp = array_namespace(o)
    if dtype == "bfloat16":
        storage_bits(out)[...] = float32_to_bits(o.astype(xp.float32, copy=False), xp)
    else:
        storage_bits(out)[...] = o.astype(xp.float16).view(xp.uint16)
