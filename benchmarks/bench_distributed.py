"""Batch-1 decode latency with context parallelism over WORLD_SIZE GPUs, run under torchrun:

    PYTHONPATH=$PWD torchrun --nproc-per-node 2 benchmarks/bench_distributed.py \\
        --json out/bench_distributed.json

One request of T tokens (default 128k and 1M), 32 query / 8 KV heads, head_dim 128, bfloat16,
page size 16. The KV is sharded by ``shard_page_table``: each rank holds only its pages. The
group is torch.distributed's NCCL world group (``--group torch``, the default) or a
cupyx.distributed communicator (``--group cupy``). Per case and rank, three timings in
microseconds per decode call (one layer):

  local          the splitkv kernels on this rank's shard (``time_graph_us``: CUDA graph over
                 L layers of distinct KV, at least 1 GiB in all, median of 7 trials)
  exchange+merge the pack kernel, the group's all-gather, the fused merge-and-cast kernel
  step           both, per layer, as one decode step would run them

and, for comparison, ``1 GPU``: one GPU attending over the whole request. The collective timings
replay a CUDA graph when the group's NCCL call captures, else run eagerly, which the output
says; each is the median over ``--iters`` iterations timed with CUDA events, every rank running
the same number of iterations. The table shows the slowest rank (a step is as slow as its
slowest rank); the JSON has every rank. splitkv/distributed/README.md has the paper figures
these are to be set against.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import numpy as np

from splitkv.cli import args as A

STEP_KEYS = ("local_us", "exchange_merge_us", "step_us", "single_gpu_us")


def init_group(kind: str, timeout_s: float):
    """This rank's GPU made current and the group: torch's NCCL world group, or a
    cupyx.distributed communicator (its own store on MASTER_PORT + 1). Returns (group, close)."""
    import os

    import cupy

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cupy.cuda.Device(local_rank).use()
    if kind == "torch":
        import datetime

        import torch
        import torch.distributed as dist

        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                                timeout=datetime.timedelta(seconds=timeout_s))
        return dist.group.WORLD, dist.destroy_process_group
    from cupyx.distributed import init_process_group

    port = int(os.environ.get("MASTER_PORT", 29500)) + 1
    comm = init_process_group(world, rank, host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              port=port)

    def close():
        comm.barrier()                     # every rank is done with rank 0's store
        store = getattr(comm, "_store", None)
        if store is not None:              # its server process would keep the exit waiting
            store.stop()

    return comm, close


def nccl_versions() -> dict:
    """NCCL as CuPy and torch (where imported) load it."""
    import sys

    from cupy.cuda import nccl

    versions = {"nccl_cupy": nccl.get_version() if nccl.available else None}
    if "torch" in sys.modules:
        import torch

        versions["torch"] = torch.__version__
        versions["nccl_torch"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions


def time_collective_us(group, launch, calls_per_launch: int, stream, *, iters: int, warmup: int,
                       use_graph: bool) -> tuple[float, str, str]:
    """Median microseconds per call of ``launch(stream)`` (which makes ``calls_per_launch`` calls
    and contains collectives). Every rank must call this with the same arguments. Returns
    (median, "graph" or "eager", why eager)."""
    import cupy

    with stream:
        for _ in range(warmup):                  # compiles, fills the merge's private pool
            launch(stream)
        group.wait(stream)
        graph, why = None, ""
        if use_graph:
            try:
                stream.begin_capture()
                try:
                    launch(stream)
                except Exception:
                    with contextlib.suppress(Exception):
                        stream.end_capture()
                    raise
                graph = stream.end_capture()
            except Exception as exc:             # capture unsupported: fall back to eager
                why = f"capture failed on rank {group.rank}: {type(exc).__name__}: {exc}"
        if not group.agree(graph is not None, stream):   # every rank uses the same mode
            graph = None
            why = why or "capture failed on another rank"
        run = (lambda: graph.launch(stream)) if graph is not None else (lambda: launch(stream))
        run()
        group.wait(stream)
        group.agree(True, stream)                # start the timed iterations together
        starts = [cupy.cuda.Event() for _ in range(iters)]
        ends = [cupy.cuda.Event() for _ in range(iters)]
        for a, b in zip(starts, ends):
            a.record(stream)
            run()
            b.record(stream)
        group.wait(stream)
    samples = [cupy.cuda.get_elapsed_time(a, b) * 1e3 / calls_per_launch for a, b in zip(starts, ends)]
    return float(np.median(samples)), ("graph" if graph is not None else "eager"), why


def bench_case(group, tokens: int, args) -> dict:
    import cupy

    from splitkv.distributed import ContextParallelDecode, compact_page_table, shard_page_table
    from splitkv.measure.timing import make_layers, time_graph_us, time_wrapper_us
    from splitkv.runtime.wrapper import BatchDecodeWrapper
    from splitkv.testing import scattered_page_table

    hq, hk = args.heads
    d, page, dtype = args.head_dim, args.page_size, args.dtype
    rng = np.random.default_rng(args.seed)               # same table on every rank
    table, _ = scattered_page_table([tokens], page, rng)
    result = {"tokens": tokens, "world_size": group.world_size}

    if not args.skip_single:                             # every rank at once, on its own GPU
        data = make_layers(table, hq, hk, d, dtype, seed=args.seed)
        single = BatchDecodeWrapper(hq, hk, d, page, dtype)
        result["single_gpu_plan"] = repr(single.plan(table))
        result["single_gpu_us"] = time_wrapper_us(single, data)
        del data
        cupy.get_default_memory_pool().free_all_blocks()

    local_table, _ = compact_page_table(shard_page_table(table, group.world_size)[group.rank])
    data = make_layers(local_table, hq, hk, d, dtype, seed=args.seed)   # same q on every rank
    stream = cupy.cuda.Stream(non_blocking=True)
    cp = ContextParallelDecode(group, hq, hk, d, page, dtype)
    result["local_tokens"] = int(local_table.kv_lens.sum())
    result["local_plan"] = repr(cp.plan(local_table, stream=stream))
    result["num_layers"] = data.num_layers
    result["local_us"] = time_graph_us(
        lambda layer, s: cp.run_local(data.q, data.k_layers[layer], data.v_layers[layer], stream=s),
        data.num_layers)

    out = data.out
    repeat = 8

    def exchange(s):
        for _ in range(repeat):
            cp.exchange_merge(out=out, stream=s)

    def step(s):
        for layer in range(data.num_layers):
            cp.run_local(data.q, data.k_layers[layer], data.v_layers[layer], stream=s)
            cp.exchange_merge(out=out, stream=s)

    kw = dict(iters=args.iters, warmup=args.warmup, use_graph=not args.eager)
    cp.run_local(data.q, data.k_layers[0], data.v_layers[0], stream=stream)
    result["exchange_merge_us"], mode_x, why_x = time_collective_us(group, exchange, repeat, stream, **kw)
    result["step_us"], mode_s, why_s = time_collective_us(group, step, data.num_layers, stream, **kw)
    result["mode"] = mode_x if mode_x == mode_s else f"{mode_x}/{mode_s}"
    result["eager_reason"] = why_x or why_s
    return result


def gather_results(group, result: dict) -> list[dict]:
    """Every rank's timings, on every rank."""
    values = [result.get(k, np.nan) for k in STEP_KEYS + ("local_tokens",)]
    table = group.gather_host(values)
    per_rank = []
    for r in range(group.world_size):
        row = dict(zip(STEP_KEYS + ("local_tokens",), (float(x) for x in table[r])))
        row["local_tokens"] = int(row["local_tokens"])
        per_rank.append(row)
    return per_rank


def summarize(result: dict, per_rank: list[dict]) -> dict:
    summary = {k: v for k, v in result.items() if k not in STEP_KEYS and k != "local_tokens"}
    for k in STEP_KEYS:
        vals = [row[k] for row in per_rank]
        summary[k] = float(np.max(vals)) if not np.isnan(vals).all() else None
    summary["per_rank"] = per_rank
    if summary.get("single_gpu_us") and summary["step_us"]:
        summary["speedup"] = summary["single_gpu_us"] / summary["step_us"]
    return summary


def _cell(x, width: int, digits: int = 1) -> str:
    return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"


def print_table(cases: list[dict]) -> None:
    head = (f"{'tokens':>9} {'ranks':>5} {'local us':>9} {'exch+merge us':>13} {'step us':>8} "
            f"{'1 GPU us':>9} {'speedup':>7}  mode")
    print(head)
    print("-" * len(head))
    for c in cases:
        print(f"{c['tokens']:>9} {c['world_size']:>5} {_cell(c['local_us'], 9)} "
              f"{_cell(c['exchange_merge_us'], 13)} {_cell(c['step_us'], 8)} "
              f"{_cell(c.get('single_gpu_us'), 9)} {_cell(c.get('speedup'), 7, 2)}  {c['mode']}")
    reasons = {c["eager_reason"] for c in cases if c.get("eager_reason")}
    for r in sorted(reasons):
        print(f"note: eager, not a CUDA graph ({r}); eager times include the host launch gaps of the "
              "merge's small kernels")


def main() -> int:
    ap = argparse.ArgumentParser(description="context-parallel decode latency (run under torchrun)")
    ap.add_argument("--tokens", default="131072,1048576", help="request lengths (default %(default)s)")
    ap.add_argument("--heads", type=A.heads, default="32/8",
                    help="query heads / kv heads, as `splitkv plan` takes them (default "
                         "%(default)s)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=200, help="timed iterations per collective timing")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="do not try CUDA graphs for the collectives")
    ap.add_argument("--skip-single", action="store_true", help="skip the one-GPU baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group", default="torch", choices=["torch", "cupy"],
                    help="torch.distributed's NCCL group, or a cupyx.distributed communicator")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="the group's timeout in seconds (default %(default)s)")
    ap.add_argument("--json", help="rank 0 writes the results here")
    args = ap.parse_args()

    import cupy

    from splitkv.distributed import as_group
    from splitkv.runtime import device_info

    raw, close = init_group(args.group, args.timeout)
    group = as_group(raw, timeout_s=args.timeout)
    cases = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        result = bench_case(group, tokens, args)
        gc.collect()                                     # this case's KV layers, graphs, pools
        cupy.get_default_memory_pool().free_all_blocks()
        cases.append(summarize(result, gather_results(group, result)))
        if group.rank == 0:
            print(f"done: {tokens} tokens", file=sys.stderr, flush=True)
    if group.rank == 0:
        print_table(cases)
        if args.json:
            meta = {"device": device_info()["name"], "world_size": group.world_size,
                    "group": args.group, "cupy": cupy.__version__, **nccl_versions(),
                    "num_qo_heads": args.heads[0], "num_kv_heads": args.heads[1],
                    "head_dim": args.head_dim, "page_size": args.page_size, "dtype": args.dtype,
                    "batch_size": 1, "iters": args.iters, "command": " ".join(sys.argv)}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"meta": meta, "cases": cases}, indent=2) + "\n")
            print(f"wrote {args.json}")
    close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
