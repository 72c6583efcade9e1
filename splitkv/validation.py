"""Every check of user input lives here, so errors read the same everywhere.

Each check raises ``TypeError`` (wrong kind of thing, wrong dtype) or ``ValueError`` (right
kind, wrong value or shape) naming the argument, what was given and what was expected.
Nothing is broadcast, truncated or cast.
"""

from __future__ import annotations

import numpy as np

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = ("float16", "bfloat16")
STRATEGIES = ("single", "split_merge", "fused")


def dtype_name(dtype) -> str:
    """Canonical name of a dtype given as a string, NumPy dtype, or framework dtype."""
    name = getattr(dtype, "name", None) or str(dtype)
    name = name.replace("torch.", "").replace("jax.numpy.", "")
    aliases = {"half": "float16", "bf16": "bfloat16", "fp16": "float16", "<V2": "bfloat16"}
    return aliases.get(name, name)


def check_dtype(name: str, dtype) -> str:
    canon = dtype_name(dtype)
    if canon not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: dtype {canon!r} is not supported; expected one of {SUPPORTED_DTYPES}")
    return canon


def check_int(name: str, value, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return value


def check_heads(num_qo_heads, num_kv_heads) -> tuple[int, int]:
    num_qo_heads = check_int("num_qo_heads", num_qo_heads, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs num_qo_heads % num_kv_heads == 0")
    return num_qo_heads, num_kv_heads


def check_head_dim(head_dim) -> int:
    head_dim = check_int("head_dim", head_dim)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: {head_dim} is not supported; expected one of {SUPPORTED_HEAD_DIMS}")
    return head_dim


def check_strategy(strategy) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    return strategy


def host_int_array(name: str, value, ndim: int) -> np.ndarray:
    """A host integer array of the given rank, as int64 (exact for every int dtype given)."""
    if hasattr(value, "__cuda_array_interface__") or type(value).__module__.startswith("cupy"):
        raise TypeError(f"{name}: expected a host (NumPy) array; got a device array. "
                        "Plans are made on the host: pass a NumPy array (e.g. x.get()).")
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_page_table(kv_indptr: np.ndarray, kv_indices: np.ndarray, kv_last_page_len: np.ndarray,
                     page_size: int, num_pages: int | None = None) -> None:
    """FlashInfer-style page table: request b owns kv_indices[kv_indptr[b]:kv_indptr[b+1]]."""
    if kv_indptr.size < 1:
        raise ValueError("kv_indptr: expected at least one element (batch_size + 1), got an empty array")
    batch = kv_indptr.size - 1
    if kv_indptr[0] != 0:
        raise ValueError(f"kv_indptr: expected kv_indptr[0] == 0, got {kv_indptr[0]}")
    if np.any(np.diff(kv_indptr) < 0):
        raise ValueError("kv_indptr: expected a non-decreasing array")
    if kv_indptr[-1] != kv_indices.size:
        raise ValueError(f"kv_indices: kv_indptr[-1]={kv_indptr[-1]} pages are referenced "
                         f"but kv_indices has {kv_indices.size}")
    if kv_last_page_len.size != batch:
        raise ValueError(f"kv_last_page_len: expected {batch} elements (one per request), "
                         f"got {kv_last_page_len.size}")
    if kv_indices.size and kv_indices.min() < 0:
        raise ValueError(f"kv_indices: page indices must be >= 0, got {kv_indices.min()}")
    if num_pages is not None and kv_indices.size and kv_indices.max() >= num_pages:
        raise ValueError(f"kv_indices: page index {kv_indices.max()} is out of range for a pool "
                         f"of {num_pages} pages")
    pages = np.diff(kv_indptr)
    has_pages = pages > 0
    bad_last = has_pages & ((kv_last_page_len < 1) | (kv_last_page_len > page_size))
    if np.any(bad_last):
        b = int(np.flatnonzero(bad_last)[0])
        raise ValueError(f"kv_last_page_len: request {b} has {kv_last_page_len[b]}; expected a value "
                         f"in 1..page_size={page_size}")
    empty_bad = ~has_pages & (kv_last_page_len != 0)
    if np.any(empty_bad):
        b = int(np.flatnonzero(empty_bad)[0])
        raise ValueError(f"kv_last_page_len: request {b} has no pages, so its last page length "
                         f"must be 0, got {kv_last_page_len[b]}")


def check_seq_lens(seq_lens: np.ndarray, capacity: int, page_size: int) -> None:
    if seq_lens.size and seq_lens.min() < 0:
        raise ValueError(f"seq_lens: lengths must be >= 0, got {seq_lens.min()}")
    if seq_lens.size and seq_lens.max() > capacity:
        b = int(np.argmax(seq_lens))
        raise ValueError(f"seq_lens: request {b} has {seq_lens[b]} tokens, more than its "
                         f"{capacity // page_size} pages x page_size {page_size} = {capacity} hold")


def device_array_shape_dtype(name: str, arr) -> tuple[tuple[int, ...], str]:
    """Shape and canonical dtype of an array-like without touching its data."""
    shape = getattr(arr, "shape", None)
    dtype = getattr(arr, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name}: expected an array with .shape and .dtype, got {type(arr).__name__}")
    return tuple(int(s) for s in shape), dtype_name(dtype)


def check_shape(name: str, shape: tuple[int, ...], expected: tuple) -> None:
    """``expected`` entries may be None for 'any size' on that axis."""
    ok = len(shape) == len(expected) and all(e is None or s == e for s, e in zip(shape, expected))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(shape)}")


def check_kv_cache(name: str, shape, dtype: str, page_size: int, num_kv_heads: int, head_dim: int,
                   expected_dtype: str) -> int:
    """KV cache in NHD layout ``[num_pages, page_size, num_kv_heads, head_dim]``; returns num_pages."""
    check_shape(name, shape, (None, page_size, num_kv_heads, head_dim))
    if dtype != expected_dtype:
        raise TypeError(f"{name}: expected dtype {expected_dtype}, got {dtype}")
    return shape[0]


def check_query(shape, dtype: str, batch_size: int, num_qo_heads: int, head_dim: int,
                expected_dtype: str) -> None:
    check_shape("q", shape, (batch_size, num_qo_heads, head_dim))
    if dtype != expected_dtype:
        raise TypeError(f"q: expected dtype {expected_dtype}, got {dtype}")


def check_sm_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"sm_scale: expected a float, got {type(sm_scale).__name__}")
    sm_scale = float(sm_scale)
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected a finite positive float, got {sm_scale}")
    return sm_scale
