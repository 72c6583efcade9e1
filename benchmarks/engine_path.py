"""The path engines take against splitkv's best, side by side on the standard cases.

Each case is timed as the bench times it (one CUDA graph over L layers of distinct K/V, >= 1 GiB
or 64 layers, the median of 7 trials), on one page table and one set of layers, five ways:

- ``per_shape``: ``BatchDecodeWrapper`` planned on the host for this batch (splitkv's best);
- ``host_cap``: graph-stable, capacity = the batch, ``plan()`` on the host;
- ``host_256``: graph-stable, capacity 256 requests, ``plan()`` on the host;
- ``dev_cap``: graph-stable, capacity = the batch, ``plan_on_device()`` inside the graph;
- ``dev_256``: graph-stable, capacity 256, ``plan_on_device()`` inside the graph (what the
  torch op and the engine integrations run);
- ``op_256`` (with torch): ``torch.ops.splitkv.paged_decode`` of a ``DecodeSession`` of
  capacity 256 in a torch CUDA graph, ``plan=True`` on the first layer: the engines' call.

A device-planned graph holds one planning kernel and the L layers (a step), so the planning
kernel's time is shared by the L layers. L is what holds 1 GiB (2 layers for the largest
cases), fewer layers than a model has. ``--model-layers N`` makes every column's step N layer
calls instead, layer i reading K/V layer i mod L (so the reads still come from memory, not
L2): the planning kernel then shares a step with N layers, as in an N-layer model. Prints a
table of microseconds per layer and each column's ratio to ``per_shape``; ``--json`` writes the
rows with the device, date and command.

    PYTHONPATH=$PWD python3 benchmarks/engine_path.py [--cases b1_n1k,...] \\
        [--kv-dtype fp8_e4m3] [--json out.json] [--capacity 256] [--model-layers 32]
"""

import argparse
import datetime
import json
import sys

import cupy
import numpy as np

from splitkv.bench.cases import select
from splitkv.measure.timing import make_layers, time_graph_us
from splitkv.runtime.wrapper import BatchDecodeWrapper
from splitkv.testing import block_table_of, scattered_page_table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default=None, help="case names or groups (default: standard)")
parser.add_argument("--kv-dtype", default=None, help="fp8_e4m3 for fp8 K/V")
parser.add_argument("--capacity", type=int, default=256)
parser.add_argument("--no-op", action="store_true", help="skip the torch op's column")
def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


parser.add_argument("--model-layers", type=positive, default=None,
                    help="layer calls a step (a model's depth, like 32), cycling over the "
                         "case's K/V layers; default: the case's layers, one each")
parser.add_argument("--json", default=None)
args = parser.parse_args()
KV = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(args.kv_dtype, args.kv_dtype)
try:
    import torch
    have_torch = not args.no_op and torch.cuda.is_available()
except ImportError:
    have_torch = False


def time_op_us(case, pt, data, table, capacity: int) -> float:
    """The torch op, planned on the first layer, over the same layers, in a torch CUDA graph."""
    from splitkv.integrations import torch_ops
    from splitkv.measure.timing import median_us_per_call

    handle = torch_ops.new_session(
        num_qo_heads=case.num_qo_heads, num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim, page_size=case.page_size, dtype=torch.bfloat16,
        layout="block_table", capacity=capacity, width=table.shape[1],
        sm_scale=case.head_dim ** -0.5, kv_dtype=KV)
    as_t = torch.utils.dlpack.from_dlpack
    q = as_t(data.q).view(torch.bfloat16) if data.q.dtype == np.uint16 else as_t(data.q)
    ks = [as_t(k) for k in data.k_layers]
    vs = [as_t(v) for v in data.v_layers]
    if KV:
        fp8 = getattr(torch, KV)
        ks, vs = [k.view(fp8) for k in ks], [v.view(fp8) for v in vs]
    elif data.q.dtype == np.uint16:
        ks, vs = [k.view(torch.bfloat16) for k in ks], [v.view(torch.bfloat16) for v in vs]
    seq_lens = torch.tensor(case.kv_lens, dtype=torch.int32, device="cuda")
    block_table = torch.from_numpy(table).cuda()
    op = torch.ops.splitkv.paged_decode

    calls = args.model_layers or len(ks)

    def step():
        for i in range(calls):
            op(q, ks[i % len(ks)], vs[i % len(vs)], [seq_lens, block_table], None, handle, i == 0)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
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

    run_timed(20)
    us = median_us_per_call(run_timed, calls)
    torch_ops.close_session(handle)
    return us


rows = []
cols = ["per_shape", "host_cap", f"host_{args.capacity}", "dev_cap", f"dev_{args.capacity}"]
if have_torch:
    cols.append(f"op_{args.capacity}")
print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; kv "
      f"{args.kv_dtype or 'bfloat16'}; us per layer (ratio to per_shape)", flush=True)
print(f"{'case':>12} " + " ".join(f"{c:>15}" for c in cols), flush=True)
def time_case(case) -> dict:
    """The case's row: microseconds per layer of each column, and their ratios."""
    rng = np.random.default_rng(0)
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, rng, extra_pages=0)
    batch = len(case.kv_lens)
    width = int(np.diff(pt.kv_indptr).max())
    shape = (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, "bfloat16")
    data = make_layers(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim, "bfloat16",
                       min_total_bytes=1 << 30, seed=0, kv_dtype=KV)
    table = block_table_of(pt, width, pad=0)
    seq_lens, block_table = cupy.asarray(np.asarray(case.kv_lens, np.int32)), cupy.asarray(table)
    stream = cupy.cuda.Stream(non_blocking=True)
    us = {}
    calls = args.model_layers or data.num_layers

    def timed(w, device_planned: bool) -> float:
        def layer(i, s):
            if i == 0 and device_planned:
                w.plan_on_device(seq_lens=seq_lens, block_table=block_table, stream=s)
            j = i % data.num_layers
            w.run(data.q, data.k_layers[j], data.v_layers[j], out=data.out, stream=s)
        return time_graph_us(layer, calls, stream=stream)

    per_shape = BatchDecodeWrapper(*shape, kv_dtype=KV)
    plan = per_shape.plan(pt, stream=stream)
    us["per_shape"] = timed(per_shape, False)
    columns = [("host_cap", batch, False), (f"host_{args.capacity}", args.capacity, False),
               ("dev_cap", batch, True), (f"dev_{args.capacity}", args.capacity, True)]
    for name, cap, device_planned in columns:
        w = BatchDecodeWrapper(*shape, kv_dtype=KV, use_cuda_graph=True, max_batch_size=cap,
                               max_num_pages=max(pt.kv_indices.size, cap * width))
        if not device_planned:
            w.plan(pt, stream=stream)
        us[name] = timed(w, device_planned)
    if have_torch:
        us[f"op_{args.capacity}"] = time_op_us(case, pt, data, table, args.capacity)
    return {"case": case.name, "layers": data.num_layers, "layer_calls": calls,
            "per_shape_plan": f"{plan.strategy}/{plan.num_splits}",
            **{k: round(v, 2) for k, v in us.items()},
            **{f"{k}_ratio": round(v / us["per_shape"], 3) for k, v in us.items()}}


for case in select(args.cases):
    row = time_case(case)
    rows.append(row)
    print(f"{case.name:>12} " + " ".join(
        f"{row[c]:8.2f} ({row[c + '_ratio']:.2f})" for c in cols), flush=True)
    cupy.get_default_memory_pool().free_all_blocks()

if args.json:
    with open(args.json, "w") as f:
        json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                   "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                   "kv_dtype": args.kv_dtype, "rows": rows}, f, indent=1)
