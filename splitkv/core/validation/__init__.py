"""Every check of user input lives here, so errors read the same everywhere.

Each check raises ``TypeError`` (wrong kind of thing, wrong dtype) or ``ValueError`` (right
kind, wrong value or shape) naming the argument, what was given and what was expected.
Nothing is broadcast, truncated or cast.
"""

from __future__ import annotations

import os

import numpy as np

from .dtypes import dtype_name

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
FP8_HEAD_DIMS = (64, 128, 256)    # fp8 rows: 16-byte chunks, 4 lanes a k-step group (decode.cu)
SUPPORTED_DTYPES = ("float16", "bfloat16")
STRATEGIES = ("single", "split_merge", "fused")

# ---- limits ------------------------------------------------------------------------------------
# What a plan's int32 arrays and the kernels' int sizes can hold (their offsets into K, V and the
# partials are 64-bit). Each is checked where the value enters, before an array is made from it.
# With these, every total (tokens, pages, chunks) is far from int64's range: a batch holds at
# most 2**24 x (2**31 - 1) < 2**55 tokens.
MAX_KV_LEN = 2**31 - 1          # tokens of one request: chunk_start/chunk_end are int32
MAX_PAGE_SIZE = MAX_KV_LEN      # tokens of one page: the kernel's page_size is an int (and
                                # PageTable.contiguous makes one page of a whole request)
MAX_HEADS = 2**16 - 1           # num_qo_heads, num_kv_heads: far above any model (and far
                                # inside the kernels' int head indices)
MAX_CHUNKS = 2**24              # chunks of one plan: building one that large takes ~320 MiB of
                                # host memory and 0.6 s, so a bigger split fails, before it
                                # allocates, instead of taking gigabytes (the planner's own
                                # candidates stay within a few thousand chunks)
MAX_BATCH_SIZE = MAX_CHUNKS     # requests of one batch: a plan has a chunk per request
MAX_TOTAL_PAGES = 2**31 - 1     # entries of kv_indices: the kernel's page-table offsets are int


def check_dtype(name: str, dtype) -> str:
    canon = dtype_name(dtype)
    if canon not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: {'dtype ' * (name != 'dtype')}{canon!r} is not supported; expected one of {SUPPORTED_DTYPES}")
    return canon


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None,
              why: str = "") -> int:
    """An integer (not a bool) in minimum..maximum; ``why`` says where the maximum comes from."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an integer <= {maximum}{f' ({why})' if why else ''}, "
                         f"got {value}")
    return value


def check_page_size(page_size) -> int:
    return check_int("page_size", page_size, 1, MAX_PAGE_SIZE, "MAX_PAGE_SIZE: the kernel's "
                     "page_size is an int")


def check_heads(num_qo_heads, num_kv_heads) -> tuple[int, int]:
    num_qo_heads = check_int("num_qo_heads", num_qo_heads, 1, MAX_HEADS, "MAX_HEADS")
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1, MAX_HEADS, "MAX_HEADS")
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


def check_head_dim_for_kv(head_dim: int, kv_dtype) -> None:
    """fp8 K/V only at the head dims whose fp8 builds exist (``head_dim`` already checked)."""
    if kv_dtype and head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"kv_dtype: fp8 K/V ({kv_dtype!r}) is not supported at head_dim "
                         f"{head_dim}; expected head_dim one of {FP8_HEAD_DIMS} with fp8 K/V, "
                         f"or K/V in the model's dtype")


def check_strategy(strategy) -> str:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    return strategy


def _holds_a_bool(items) -> bool:
    """Whether nested lists / tuples hold a bool (Python's or NumPy's) anywhere: the element
    types first (one pass in C), then only the nested sequences."""
    types = set(map(type, items))
    if bool in types or np.bool_ in types:
        return True
    if list in types or tuple in types:
        return any(_holds_a_bool(x) for x in items if type(x) in (list, tuple))
    return False


def host_int_array(name: str, value, ndim: int, as_int64: bool = True) -> np.ndarray:
    """A host integer array of the given rank, as int64 (exact for every int dtype given), or
    with ``as_int64`` False in its own dtype (a block table: only the entries read convert)."""
    if hasattr(value, "__cuda_array_interface__") or type(value).__module__.startswith("cupy"):
        raise TypeError(f"{name}: expected a host (NumPy) array; got a device array. "
                        "Plans are made on the host: pass a NumPy array (e.g. x.get()).")
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a {ndim}-d integer array, got {type(value).__name__}")
    if isinstance(value, (list, tuple)) and _holds_a_bool(value):
        # NumPy reads [0, True, 2] as integers: a bool among them is a mistake, not a 1
        raise TypeError(f"{name}: expected integers, got a bool among them")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:    # ragged nesting, unconvertible items
        raise TypeError(f"{name}: expected a {ndim}-d integer array, got {type(value).__name__} "
                        f"that NumPy cannot read as one ({e})") from None
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {arr.shape}")
    if arr.size and not issubclass(arr.dtype.type, np.integer):   # np.issubdtype's test
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    # compared as uint64: NumPy 1.x compares uint64 with an int through float64, which rounds
    if arr.size and arr.dtype == np.uint64 and arr.max() > np.uint64(np.iinfo(np.int64).max):
        raise ValueError(f"{name}: value {arr.max()} does not fit in int64")
    return arr.astype(np.int64, copy=False) if as_int64 else arr


def check_batch_size(name: str, batch_size: int) -> None:
    if batch_size > MAX_BATCH_SIZE:
        raise ValueError(f"{name}: {batch_size} requests; at most MAX_BATCH_SIZE={MAX_BATCH_SIZE} "
                         "are supported (a plan has a chunk per request)")


def check_kv_lens(name: str, lens: np.ndarray):
    """Request lengths (int64): 0..MAX_KV_LEN tokens each, at most MAX_BATCH_SIZE requests.
    Returns the longest (None for no requests), so a caller's bound needs no second max."""
    check_batch_size(name, lens.size)
    if not lens.size:
        return None
    if lens.min() < 0:
        raise ValueError(f"{name}: lengths must be >= 0, got {lens.min()}")
    longest = lens.max()
    if longest > MAX_KV_LEN:
        b = int(np.argmax(lens))
        raise ValueError(f"{name}: request {b} has {lens[b]} tokens; at most MAX_KV_LEN="
                         f"{MAX_KV_LEN} (2**31 - 1) per request are supported (plans hold token "
                         "offsets as int32)")
    return longest


def check_page_table(kv_indptr: np.ndarray, kv_indices: np.ndarray, kv_last_page_len: np.ndarray,
                     page_size: int) -> np.ndarray:
    """FlashInfer-style page table: request b owns kv_indices[kv_indptr[b]:kv_indptr[b+1]].
    Returns the request lengths (int64), each within MAX_KV_LEN. (The pool bound is
    ``check_page_indices``', where the pool size is known.) ``kv_indices`` None: the ids stay
    on the device, unread; the rest is checked the same."""
    if kv_indptr.size < 1:
        raise ValueError("kv_indptr: expected at least one element (batch_size + 1), got an empty array")
    batch = kv_indptr.size - 1
    check_batch_size("kv_indptr", batch)
    if kv_indptr[0] != 0:
        raise ValueError(f"kv_indptr: expected kv_indptr[0] == 0, got {kv_indptr[0]}")
    pages = np.diff(kv_indptr)
    if batch and pages.min() < 0:
        raise ValueError("kv_indptr: expected a non-decreasing array")
    if kv_indices is not None and kv_indptr[-1] != kv_indices.size:
        raise ValueError(f"kv_indices: kv_indptr[-1]={kv_indptr[-1]} pages are referenced "
                         f"but kv_indices has {kv_indices.size}")
    entries = int(kv_indptr[-1])
    if kv_last_page_len.size != batch:
        raise ValueError(f"kv_last_page_len: expected {batch} elements (one per request), "
                         f"got {kv_last_page_len.size}")
    if entries > MAX_TOTAL_PAGES:
        raise ValueError(f"kv_indices: {entries} pages; at most MAX_TOTAL_PAGES="
                         f"{MAX_TOTAL_PAGES} are supported (the kernel's page-table offsets are int)")
    if kv_indices is not None:
        check_page_indices(kv_indices)
    # Every plan() checks its table: whether all is well first, in a few whole-array calls (h = 1
    # for a request with pages, else 0: h <= last <= h x page_size), which request is wrong only
    # when something is
    has_pages = np.minimum(pages, 1)
    if batch and ((kv_last_page_len - has_pages).min() < 0
                  or (has_pages * page_size - kv_last_page_len).min() < 0):
        _raise_bad_last_page(pages > 0, kv_last_page_len, page_size)
    # the full pages' tokens and the last page's (0 for no pages): pages < 2**31 (the total's
    # limit) and page_size < 2**31, so the product cannot wrap
    lens = np.subtract(pages, has_pages, dtype=np.int64)
    lens *= page_size
    lens += kv_last_page_len
    if batch and lens.max() > MAX_KV_LEN:
        b = int(np.argmax(lens))
        raise ValueError(f"kv_indptr: request {b} holds {lens[b]} tokens ({pages[b]} pages of "
                         f"{page_size}); at most MAX_KV_LEN={MAX_KV_LEN} (2**31 - 1) per request "
                         "are supported (plans hold token offsets as int32)")
    return lens


def _raise_bad_last_page(has_pages: np.ndarray, kv_last_page_len: np.ndarray, page_size: int):
    """``check_page_table``'s error for the first request whose last page length is wrong."""
    bad_last = has_pages & ((kv_last_page_len < 1) | (kv_last_page_len > page_size))
    if np.any(bad_last):
        b = int(np.flatnonzero(bad_last)[0])
        raise ValueError(f"kv_last_page_len: request {b} has {kv_last_page_len[b]}; expected a value "
                         f"in 1..page_size={page_size}")
    b = int(np.flatnonzero(~has_pages & (kv_last_page_len != 0))[0])
    raise ValueError(f"kv_last_page_len: request {b} has no pages, so its last page length "
                     f"must be 0, got {kv_last_page_len[b]}")


def check_page_indices(kv_indices: np.ndarray, num_pages=None, name: str = "kv_indices",
                       position=None) -> None:
    """Page indices are >= 0 and, where the pool size is known, address a page of a pool (KV
    cache) of ``num_pages`` pages. The first bad entry is named as the caller wrote it:
    ``name`` is the argument it came from (``block_table`` for vLLM's layout) and
    ``position(i)`` says where entry i of ``kv_indices`` sits there (default ``[i]``)."""
    if num_pages is not None:    # a pool of no pages suits only a table that addresses none
        num_pages = check_int("num_pages", num_pages, 1 if kv_indices.size else 0)
    if not kv_indices.size:
        return
    # two reductions over a plan's many entries; the mask only to find the first bad one
    if kv_indices.min() >= 0 and (num_pages is None or kv_indices.max() < num_pages):
        return
    bad = kv_indices < 0
    if num_pages is not None:
        bad |= kv_indices >= num_pages
    i = int(np.argmax(bad))
    where = position(i) if position is not None else f"[{i}]"
    expected = ("a page index >= 0" if num_pages is None
                else f"a page index in 0..{num_pages - 1} (num_pages={num_pages})")
    raise ValueError(f"{name}{where}: expected {expected}, got {kv_indices[i]}")


def check_seq_lens(seq_lens: np.ndarray, capacity: int, page_size: int) -> None:
    longest = check_kv_lens("seq_lens", seq_lens)
    if longest is not None and longest > capacity:
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


def check_query_row_count(name: str, shape: tuple[int, ...], fewest: int, most: int) -> int:
    """Rows of run()'s q (its first axis): exactly ``fewest`` when ``most`` equals it (a plan's
    own rows), else from ``fewest`` (the plan's) to ``most`` (a graph-stable capacity)."""
    rows = shape[0] if len(shape) == 3 else None
    if rows is not None and fewest <= rows <= most:
        return rows
    want = str(fewest) if fewest == most else f"{fewest} to {most}"
    raise ValueError(f"{name}: expected shape [rows, num_qo_heads, head_dim] with {want} rows "
                     f"(the plan's; a graph-stable wrapper takes up to its capacity), got "
                     f"{list(shape)}")


def check_storage_dtype(name: str, dtype: str, expected: str) -> None:
    """q/k/v/out hold ``expected`` (float16 or bfloat16); uint16 is accepted as its raw 16-bit
    patterns (the way to pass bfloat16 from a CuPy build without a bfloat16 dtype)."""
    if dtype != expected and dtype != "uint16":
        raise TypeError(f"{name}: expected dtype {expected} (or uint16 holding its bits), got {dtype}")


def check_query_strides(q, num_qo_heads: int, head_dim: int) -> int:
    """q [rows, num_qo_heads, head_dim] read in place: contiguous, or any view whose heads are
    head_dim apart with unit stride in head_dim (a slice of a fused QKV projection), rows
    forward and 4-byte aligned (the kernels load q two elements at a time). Returns its row
    stride in elements. An empty q (no rows; NumPy and CuPy may give it zero strides) is taken
    as contiguous: nothing is read from it."""
    rows = q.shape[0]
    if rows == 0:
        return num_qo_heads * head_dim
    row_stride = q.strides[0] if rows > 1 else num_qo_heads * head_dim
    heads_ok = q.strides[1] == head_dim or num_qo_heads == 1
    if q.strides[2] != 1 or not heads_ok or row_stride < num_qo_heads * head_dim:
        raise ValueError(f"q: expected [rows, num_qo_heads, head_dim] with strides [>= "
                         f"{num_qo_heads * head_dim}, {head_dim}, 1] in elements (contiguous, "
                         f"or a slice of a fused QKV projection), got {list(q.strides)}")
    if q.ptr % 4 or row_stride % 2:
        raise ValueError(f"q: expected a 4-byte aligned start and an even row stride (the "
                         f"kernels load two elements at a time), got strides {list(q.strides)}")
    return row_stride


def check_device_decode_arrays(q, k_cache, v_cache, *, batch_size: int, num_qo_heads: int,
                               num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                               max_page: int, device: int | None,
                               kv_dtype: str | None = None) -> int:
    """Inputs of a GPU decode call, given as descriptors with .shape, .strides (elements),
    .dtype, .ptr and .device. K and V are NHD views with any page, token and head strides (an
    HND cache is such a view: ``core.layouts``), as long as each head's row of head_dim values
    is contiguous, every row starts on a 16-byte boundary and a page spans under 2 GiB (the
    kernels address within a page in 32 bits). With ``kv_dtype`` (an fp8 format) K and V are
    uint8 codes or that dtype (torch's float8). Returns q's row stride (``check_query_strides``)."""
    check_shape("q", q.shape, (batch_size, num_qo_heads, head_dim))
    check_storage_dtype("q", q.dtype, dtype)
    q_stride = check_query_strides(q, num_qo_heads, head_dim)
    item = 1 if kv_dtype else 2
    for name, arr in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_shape(name, arr.shape, (None, page_size, num_kv_heads, head_dim))
        if kv_dtype:
            if arr.dtype not in ("uint8", kv_dtype):
                raise TypeError(f"{name}: the wrapper's kv_dtype is {kv_dtype}: expected uint8 "
                                f"codes or {kv_dtype}, got {arr.dtype}")
        else:
            check_storage_dtype(name, arr.dtype, dtype)
        if arr.strides[3] != 1 and head_dim > 1:
            raise ValueError(f"{name}: expected each head's {head_dim} values to be contiguous "
                             f"(strides [*, *, *, 1] in elements), got {list(arr.strides)}")
        if arr.ptr % 16 or any((st * item) % 16 for st in arr.strides[:3]):
            raise ValueError(f"{name}: expected 16-byte aligned pages, tokens and heads, got "
                             f"strides {list(arr.strides)} (elements of {item} bytes)")
        in_page = (abs(arr.strides[1]) * (page_size - 1) + abs(arr.strides[2]) * (num_kv_heads - 1)
                   + head_dim) * item
        if abs(arr.strides[0] * item) >= 2**31 or in_page >= 2**31:
            raise ValueError(f"{name}: expected a page to span under 2 GiB (the kernels address "
                             f"within a page in 32 bits), got strides {list(arr.strides)} "
                             f"(elements of {item} bytes)")
        if arr.shape[0] <= max_page:
            raise ValueError(f"{name}: the plan's page table references page {max_page} "
                             f"but the cache has {arr.shape[0]} pages")
    if v_cache.strides[:3] != k_cache.strides[:3]:
        raise ValueError(f"v_cache: expected the same strides as k_cache "
                         f"({list(k_cache.strides)}), got {list(v_cache.strides)}")
    for name, arr in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if arr.device is not None and device is not None and arr.device != device:
            raise ValueError(f"{name}: is on device {arr.device}, the plan on device {device}")
    return q_stride


def check_device_output(name: str, arr, shape: tuple[int, ...], dtype: str) -> None:
    """``out`` (storage dtype) or ``lse`` (float32): the exact shape, contiguous."""
    check_shape(name, arr.shape, shape)
    if dtype == "float32":
        if arr.dtype != "float32":
            raise TypeError(f"{name}: expected dtype float32, got {arr.dtype}")
    else:
        check_storage_dtype(name, arr.dtype, dtype)
    if not arr.is_contiguous:
        raise ValueError(f"{name}: expected a contiguous array")


def check_float32_vector(name: str, arr, sizes, expected: str, device: int | None) -> None:
    """A device array view (.dtype, .shape, .is_contiguous, .device): contiguous 1-d float32 of
    one of ``sizes`` values, on ``device``; else a ValueError saying ``expected``."""
    if arr.dtype != "float32" or len(arr.shape) != 1 or arr.shape[0] not in sizes \
            or not arr.is_contiguous:
        raise ValueError(f"{name}: expected {expected}, got {arr.dtype} of shape "
                         f"{list(arr.shape)}")
    if arr.device is not None and device is not None and arr.device != device:
        raise ValueError(f"{name}: is on device {arr.device}, the plan on {device}")


def check_fp8_scale(name: str, scale, kv_dtype) -> float | None:
    """A run's fp8 scale (not None): as a float32 when a number, None when an array."""
    if kv_dtype is None:
        raise ValueError(f"{name}: scales are for fp8 caches; this wrapper's kv_dtype is None")
    if isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, bool):
        with np.errstate(over="ignore"):
            value = float(np.float32(scale))      # as the kernel holds it
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a finite value > 0 (as a float32), got {scale!r}")
        return value
    return None


def check_plan_for_table(plan, page_table, *, num_qo_heads: int | None = None,
                         num_kv_heads: int | None = None, head_dim: int | None = None,
                         dtype=None, window_left=None, attention_chunk_size=None) -> None:
    """A plan is only valid for the lengths (and, where given, the shapes) it was made for."""
    p = plan.problem
    if p.page_size != page_table.page_size:
        raise ValueError(f"page_table: page_size {page_table.page_size} differs from the plan's "
                         f"{p.page_size}")
    if not np.array_equal(p.kv_lens, page_table.kv_lens):
        if p.batch_size != page_table.batch_size:
            raise ValueError(f"page_table: a batch of {page_table.batch_size}, the plan was "
                             f"made for a batch of {p.batch_size}")
        first = int(np.flatnonzero(p.kv_lens != page_table.kv_lens)[0])
        raise ValueError(f"page_table: its request lengths differ from the ones the plan was "
                         f"made for (request {first}: {int(page_table.kv_lens[first])} tokens, "
                         f"the plan's {int(p.kv_lens[first])})")
    for name, given, made in (("window_left", window_left, p.window_left),
                              ("attention_chunk_size", attention_chunk_size,
                               p.attention_chunk_size)):
        if given is not None and given != made:
            raise ValueError(f"{name}: the plan was made for {name}={made}, this call has {given}")
    for name, want, have in (("num_qo_heads", num_qo_heads, p.num_qo_heads),
                             ("num_kv_heads", num_kv_heads, p.num_kv_heads),
                             ("head_dim", head_dim, p.head_dim), ("dtype", dtype, p.dtype)):
        if want is not None and want != have:
            raise ValueError(f"plan: made for {name}={have}, this call has {want}")


def check_sm_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"sm_scale: expected a float, got {type(sm_scale).__name__}")
    sm_scale = float(sm_scale)
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected a finite positive float, got {sm_scale}")
    return sm_scale


def check_instance(name: str, value, cls, expected: str | None = None) -> None:
    """``cls``: a class or a tuple of them; ``expected`` says what they are, for the error."""
    if not isinstance(value, cls):
        expected = expected or f"a {cls.__name__}"
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}")


def check_path_or(name: str, value, cls, expected: str) -> bool:
    """True when ``value`` is a path (a non-empty str or an ``os.PathLike``), False when it is an
    instance of ``cls``; a TypeError naming ``expected`` otherwise."""
    if isinstance(value, (str, os.PathLike)):
        if not os.fspath(value):
            raise ValueError(f"{name}: expected {expected}, got an empty path")
        return True
    check_instance(name, value, cls, expected)
    return False


def check_chunk_counts(counts, batch_size: int) -> np.ndarray:
    """At least one chunk per request: a request of no tokens has one empty chunk."""
    counts = host_int_array("chunks_per_request", counts, 1)
    if counts.size != batch_size:
        raise ValueError(f"chunks_per_request: expected {batch_size} entries (one per request), "
                         f"got {counts.size}")
    if counts.size and counts.min() < 1:
        b = int(np.argmin(counts))
        raise ValueError(f"chunks_per_request: request {b} has {counts[b]}; expected at least 1 "
                         "chunk per request (a request of no tokens has one empty chunk)")
    return counts


MAX_GRID_CTAS = 2**31 - 1       # CUDA's limit on a 1-D grid's blocks


def check_grid_ctas(name: str, ctas: int, what: str) -> None:
    """A launch's CTAs (``what`` says how they were counted), checked before any upload."""
    if ctas > MAX_GRID_CTAS:
        raise ValueError(f"{name}: the launch would have {ctas} CTAs ({what}); CUDA launches at "
                         f"most 2**31 - 1 (use fewer splits, larger chunks or a smaller batch)")


def check_num_chunks(name: str, num_chunks: int) -> None:
    """A plan's chunk count, checked before its arrays are made."""
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"{name}: the plan would have {num_chunks} chunks; at most MAX_CHUNKS="
                         f"{MAX_CHUNKS} are supported (use fewer splits or larger chunks)")


def check_plan_chunks(chunk_request, chunk_start, chunk_end, merge_indptr,
                      kv_lens: np.ndarray, kv_begin: np.ndarray | None = None
                      ) -> tuple[np.ndarray, ...]:
    """The chunks of a plan must tile every request's tokens exactly, in order.

    Request b owns chunks ``merge_indptr[b]:merge_indptr[b+1]`` (at least one); they are
    contiguous token ranges ``[chunk_start, chunk_end)`` that start at ``kv_begin[b]`` (0, or
    a sliding window's first token), end at ``kv_lens[b]`` and follow each other without gap
    or overlap. Returns the four arrays as int64.
    """
    req = host_int_array("chunk_request", chunk_request, 1)
    start = host_int_array("chunk_start", chunk_start, 1)
    end = host_int_array("chunk_end", chunk_end, 1)
    indptr = host_int_array("merge_indptr", merge_indptr, 1)
    n, batch = req.size, kv_lens.size
    for name, arr in (("chunk_start", start), ("chunk_end", end)):
        if arr.size != n:
            raise ValueError(f"{name}: expected {n} elements (one per chunk, like chunk_request), "
                             f"got {arr.size}")
    if indptr.size != batch + 1:
        raise ValueError(f"merge_indptr: expected {batch + 1} elements (batch_size + 1), got {indptr.size}")
    if indptr[0] != 0 or indptr[-1] != n:
        raise ValueError(f"merge_indptr: expected to run from 0 to num_chunks={n}, "
                         f"got {indptr[0]}..{indptr[-1]}")
    counts = np.diff(indptr)
    if np.any(counts < 1):
        b = int(np.flatnonzero(counts < 1)[0])
        raise ValueError(f"merge_indptr: request {b} has {counts[b]} chunks; every request needs "
                         "at least one (an empty one if the request has no tokens)")
    if not np.array_equal(req, np.repeat(np.arange(batch), counts)):
        raise ValueError("chunk_request: chunks must be sorted by request and agree with merge_indptr")
    if np.any(start > end):
        c = int(np.flatnonzero(start > end)[0])
        raise ValueError(f"chunk_end: chunk {c} ends at {end[c]}, before its start {start[c]}")
    first = 0 if kv_begin is None else kv_begin
    if np.any(start[indptr[:-1]] != first):
        b = int(np.flatnonzero(start[indptr[:-1]] != first)[0])
        want = 0 if kv_begin is None else int(kv_begin[b])
        raise ValueError(f"chunk_start: the first chunk of request {b} must start at token "
                         f"{want}{'' if kv_begin is None else ' (its window)'}, got "
                         f"{start[indptr[b]]}")
    if np.any(end[indptr[1:] - 1] != kv_lens):
        b = int(np.flatnonzero(end[indptr[1:] - 1] != kv_lens)[0])
        raise ValueError(f"chunk_end: the last chunk of request {b} must end at its length "
                         f"{kv_lens[b]}, got {end[indptr[b + 1] - 1]}")
    same = req[1:] == req[:-1]
    gap = same & (start[1:] != end[:-1])
    if np.any(gap):
        c = int(np.flatnonzero(gap)[0]) + 1
        raise ValueError(f"chunk_start: chunk {c} starts at {start[c]} but the chunk before it in "
                         f"request {req[c]} ends at {end[c - 1]}; chunks must not overlap or leave gaps")
    return req, start, end, indptr


HOST_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64", "uint16")


def check_attention_arrays(q, k_cache, v_cache, batch_size: int, page_size: int,
                           kv_indices: np.ndarray, num_qo_heads: int | None = None,
                           num_kv_heads: int | None = None,
                           head_dim: int | None = None,
                           kv_dtype: str | None = None) -> tuple[int, int, int]:
    """Inputs of the host paths (reference, CPU executor), NumPy or CuPy.

    q: [batch_size, num_qo_heads, head_dim]; k_cache, v_cache: [num_pages, page_size,
    num_kv_heads, head_dim] (NHD), one dtype, each with every page of the table (their
    num_pages may differ). Any float dtype; uint16 holds raw bfloat16 bits; with ``kv_dtype``
    (an fp8 format, ``fp8.FP8_FORMATS``) K and V are uint8 codes or that format's dtype. Sizes
    given as None are taken from the arrays. Returns (num_qo_heads, num_kv_heads, head_dim).
    """
    shapes = {}
    for name, arr in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        shape, dtype = device_array_shape_dtype(name, arr)
        if kv_dtype is not None and name != "q":
            if dtype not in ("uint8", kv_dtype):
                raise TypeError(f"{name}: a {kv_dtype} cache (kv_dtype) is uint8 codes or "
                                f"{kv_dtype} values; got dtype {dtype!r}")
        elif dtype not in HOST_FLOAT_DTYPES:
            hint = ("; an fp8 cache needs kv_dtype (e.g. kv_dtype='float8_e4m3fn')"
                    if dtype == "uint8" else "")
            raise TypeError(f"{name}: dtype {dtype!r} is not supported; expected one of "
                            f"{HOST_FLOAT_DTYPES} (uint16 = raw bfloat16 bits){hint}")
        shapes[name] = (shape, dtype)
    q_shape, k_shape, v_shape = (shapes[n][0] for n in ("q", "k_cache", "v_cache"))
    for name, shape, rank in (("q", q_shape, 3), ("k_cache", k_shape, 4), ("v_cache", v_shape, 4)):
        if len(shape) != rank:
            expected = ((batch_size, num_qo_heads, head_dim) if rank == 3
                        else (None, page_size, num_kv_heads, head_dim))
            check_shape(name, shape, expected)
    # Sizes not given are read where two arrays agree, so the odd one out is the one blamed:
    # head_dim from K and V when they agree (else from q), num_kv_heads from K.
    if head_dim is None:
        head_dim = k_shape[3] if k_shape[3] == v_shape[3] else q_shape[2]
    check_shape("q", q_shape, (batch_size, num_qo_heads, head_dim))
    num_qo_heads = q_shape[1]
    if num_kv_heads is None:
        num_kv_heads = k_shape[2]
    for name, shape in (("k_cache", k_shape), ("v_cache", v_shape)):
        check_shape(name, shape, (None, page_size, num_kv_heads, head_dim))
    if shapes["v_cache"][1] != shapes["k_cache"][1] and kv_dtype is None:
        raise TypeError(f"v_cache: expected dtype {shapes['k_cache'][1]} (the dtype of k_cache), "
                        f"got {shapes['v_cache'][1]}")
    for name, shape, axis, heads in (("q", q_shape, 1, num_qo_heads), ("k_cache", k_shape, 2,
                                                                     num_kv_heads)):
        if heads == 0:    # read from the array: name the array, not a size the caller never gave
            raise ValueError(f"{name}: expected at least one head (axis {axis}), got shape "
                             f"{tuple(shape)}")
    if num_qo_heads >= 1 and num_kv_heads >= 1 and num_qo_heads % num_kv_heads:
        # the counts came from the arrays: name them
        raise ValueError(f"q: its {num_qo_heads} query heads (axis 1) are not a multiple of the "
                         f"{num_kv_heads} kv heads of k_cache (axis 2); grouped-query attention "
                         "needs each kv head to serve the same number of query heads")
    check_heads(num_qo_heads, num_kv_heads)
    # Each cache must hold every page of the table (as on the GPU, their page counts may
    # differ); one that falls short is named, both short by as much: the table is.
    k_pages, v_pages = k_shape[0], v_shape[0]
    if k_pages != v_pages and kv_indices.size and kv_indices.max() >= min(k_pages, v_pages):
        short, pages = ("k_cache", k_pages) if k_pages < v_pages else ("v_cache", v_pages)
        raise ValueError(f"{short}: the page table references page {kv_indices.max()} but "
                         f"{short} has {pages} pages (the other cache {max(k_pages, v_pages)})")
    if kv_indices.size and kv_indices.max() >= k_pages:    # both caches short (equal counts)
        raise ValueError(f"k_cache, v_cache: the page table references page {kv_indices.max()} "
                         f"but the caches have {k_pages} pages (axis 0)")
    return num_qo_heads, num_kv_heads, head_dim


# merge_states' checks, in a module of their own
from .merge import (MERGE_LSE_DTYPES, MERGE_O_DTYPES, check_merge_array,  # noqa: E402,F401
                    check_merge_pair, check_merge_states, check_merge_states_n, check_same_kind)
