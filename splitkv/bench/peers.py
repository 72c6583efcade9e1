"""Optional live peer: PyTorch's scaled_dot_product_attention (cuDNN by default on Hopper) on
contiguous copies of the same KV. PyTorch is imported only here, and only if installed."""

from __future__ import annotations

from ..measure.timing import MIN_TRIAL_MS, TRIALS, layers_for, median_us_per_call


def torch_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def sdpa_us(batch: int, kv_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
            *, min_total_bytes: int = 1 << 30, trials: int = TRIALS,
            min_trial_ms: float = MIN_TRIAL_MS) -> float:
    """Median us per call of SDPA decode over L layers of contiguous bf16 KV, in a CUDA graph."""
    import torch

    us = _sdpa_graph_us(batch, kv_len, num_qo_heads, num_kv_heads, head_dim, min_total_bytes,
                        trials, min_trial_ms)
    torch.cuda.empty_cache()        # give the peer's ~1 GiB back before splitkv runs again
    return us


def _sdpa_graph_us(batch, kv_len, num_qo_heads, num_kv_heads, head_dim, min_total_bytes,
                   trials, min_trial_ms) -> float:
    import torch
    import torch.nn.functional as F

    layers = layers_for(batch * kv_len * num_kv_heads * head_dim * 2 * 2, min_total_bytes)
    dev = torch.device("cuda")
    q = torch.randn(batch, num_qo_heads, 1, head_dim, device=dev, dtype=torch.bfloat16)
    ks = [torch.randn(batch, num_kv_heads, kv_len, head_dim, device=dev, dtype=torch.bfloat16)
          for _ in range(layers)]
    vs = [torch.randn_like(k) for k in ks]
    gqa = num_qo_heads != num_kv_heads

    def step():
        for k, v in zip(ks, vs):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    return torch_graph_us(step, layers, trials, min_trial_ms)


def torch_graph_us(step, layers: int, trials: int = TRIALS,
                   min_trial_ms: float = MIN_TRIAL_MS) -> float:
    """Median us per call of ``step`` (one PyTorch call per layer, ``layers`` of them): two
    warm-up runs on a side stream (a first call may compile), then one CUDA graph of it,
    replayed and timed with CUDA events, as splitkv's own timing does."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run_timed(n: int) -> float:
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    graph.replay()
    return median_us_per_call(run_timed, layers, trials=trials, min_trial_ms=min_trial_ms)
