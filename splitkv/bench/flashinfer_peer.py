"""Optional live peer: FlashInfer's paged decode paths, timed in the same run as splitkv on the
same page table and the same K/V bytes (the bench's layers, shared zero-copy through DLPack).
FlashInfer and PyTorch are imported only here, and only when asked for; a GPU machine without
network needs FlashInfer (0.7.2 or later) installed beforehand.

Paths (FlashInfer's names, as its README and sources document them):
  xqa          ``flashinfer.decode.trtllm_batch_decode_with_kv_cache(backend="xqa")``:
               TensorRT-LLM's decode kernel; on SM90 with fp8 K/V a dedicated TMA/GMMA
               kernel. Page sizes 16, 32, 64, 128.
  tensor_core  ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` (its prefill
               kernel): any group size.
  cuda_core    ``BatchDecodeWithPagedKVCacheWrapper()``: groups of 1, 2, 3, 4, 6, 8 or 16.
Each is timed as the bench times splitkv: one CUDA graph of one call per layer, replayed,
the median of the trials (``peers.torch_graph_us``). The wrappers are planned for the exact
shape (not FlashInfer's graph mode), so they compare with splitkv's per-shape time; FlashInfer
launches with PDL on SM90 by default, as splitkv does.
"""

from __future__ import annotations

import numpy as np

from ..measure.timing import MIN_TRIAL_MS, TRIALS
from .peers import torch_graph_us

PATHS = ("xqa", "tensor_core", "cuda_core")
XQA_PAGE_SIZES = (16, 32, 64, 128)
CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8, 16)
WORKSPACE_BYTES = 256 << 20


def flashinfer_available() -> tuple[bool, str]:
    """(True, its version) if FlashInfer and a CUDA PyTorch import, else (False, why)."""
    try:
        import torch
    except ImportError as exc:
        return False, f"PyTorch is not installed ({exc})"
    if not torch.cuda.is_available():
        return False, "PyTorch sees no CUDA device"
    try:
        import flashinfer
    except Exception as exc:        # a broken install raises more than ImportError
        return False, f"flashinfer does not import ({type(exc).__name__}: {exc})"
    return True, getattr(flashinfer, "__version__", "unknown version")


def supported_paths(num_qo_heads: int, num_kv_heads: int, page_size: int,
                    kv_dtype: str | None = None) -> list[str]:
    """The paths FlashInfer offers for this shape (the rest it refuses or does not build).
    XQA's build knows e4m3 among the fp8 formats only: given e5m2 it would compile a 16-bit
    cache kernel and read the codes as bf16 (its jit/xqa.py), so e5m2 gets no XQA."""
    paths = []
    if page_size in XQA_PAGE_SIZES and kv_dtype in (None, "float8_e4m3fn"):
        paths.append("xqa")
    paths.append("tensor_core")
    if num_qo_heads // num_kv_heads in CUDA_CORE_GROUPS:
        paths.append("cuda_core")
    return paths


def block_tables(page_table) -> tuple[np.ndarray, np.ndarray]:
    """XQA's int32 [batch, max pages] block table (rows padded with page 0, never read past a
    request's length) and int32 sequence lengths, from a ``PageTable``."""
    indptr = page_table.kv_indptr
    counts = np.diff(indptr)
    table = np.zeros((page_table.batch_size, max(int(counts.max(initial=0)), 1)), np.int32)
    for b in range(page_table.batch_size):
        table[b, :counts[b]] = page_table.kv_indices[indptr[b]:indptr[b + 1]]
    return table, page_table.kv_lens.astype(np.int32)


def flashinfer_us(page_table, data, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: str = "bfloat16", kv_dtype: str | None = None, paths=None, *,
                  trials: int = TRIALS, min_trial_ms: float = MIN_TRIAL_MS,
                  log=print) -> dict[str, float | None]:
    """Median us per call of each FlashInfer path over the layers of ``data`` (a
    ``measure.timing.LayeredKV``: q in ``dtype``, K/V in it or as fp8 codes of ``kv_dtype``);
    None for a path that this shape does not support or that failed (``log`` says why)."""
    import torch

    q_torch = torch.bfloat16 if dtype == "bfloat16" else torch.float16

    page = page_table.page_size
    wanted = list(PATHS if paths is None else paths)
    offered = supported_paths(num_qo_heads, num_kv_heads, page, kv_dtype)
    kv_torch = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
                None: q_torch}[kv_dtype]
    q = torch.from_dlpack(data.q).view(q_torch)
    ks = [torch.from_dlpack(k).view(kv_torch) for k in data.k_layers]
    vs = [torch.from_dlpack(v).view(kv_torch) for v in data.v_layers]
    out = torch.empty_like(q)
    results: dict[str, float | None] = {}
    for path in wanted:
        if path not in offered:
            results[path] = None
            continue
        try:
            step = _step(path, page_table, q, ks, vs, out, num_qo_heads, num_kv_heads,
                         head_dim, kv_torch)
            results[path] = torch_graph_us(step, len(ks), trials, min_trial_ms)
        except Exception as exc:     # a peer's failure is reported, not the bench's end
            log(f"flashinfer {path}: {type(exc).__name__}: {str(exc)[:300]}")
            results[path] = None
        torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return results


def _step(path, page_table, q, ks, vs, out, num_qo_heads, num_kv_heads, head_dim, kv_torch):
    """A function that runs one call per layer (planned already: only launches remain)."""
    import flashinfer
    import torch

    dev = q.device
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    if path == "xqa":
        table, lens = block_tables(page_table)
        table_d = torch.from_numpy(table).to(dev)
        lens_d = torch.from_numpy(lens).to(dev)
        max_len = int(lens.max(initial=1))
        scale = head_dim ** -0.5

        def step():
            for k, v in zip(ks, vs):
                flashinfer.decode.trtllm_batch_decode_with_kv_cache(
                    query=q, kv_cache=(k, v), workspace_buffer=workspace,
                    block_tables=table_d, seq_lens=lens_d, max_seq_len=max_len,
                    bmm1_scale=scale, bmm2_scale=1.0, out=out, kv_layout="NHD", backend="xqa")
        return step

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=path == "tensor_core")
    as_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int32)).to(dev)  # noqa: E731
    wrapper.plan(as_dev(page_table.kv_indptr), as_dev(page_table.kv_indices),
                 as_dev(page_table.kv_last_page_len), num_qo_heads, num_kv_heads, head_dim,
                 page_table.page_size, q_data_type=q.dtype, kv_data_type=kv_torch)

    def step():
        for k, v in zip(ks, vs):
            wrapper.run(q, (k, v), out=out)
    return step
