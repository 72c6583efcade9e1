"""Context-parallel decode on N GPUs: each rank holds a contiguous range of every request's KV.

Needs CUDA GPUs (one per rank), CuPy, and torch with NCCL (or CuPy's NCCL bindings for
``--group cupy``); splitkv/distributed/README.md says which. Start it with torchrun:

    PYTHONPATH=$PWD torchrun --nproc-per-node 2 examples/context_parallel.py

Every rank builds the same random batch (same seed), keeps only its shard of the pages, runs
``ContextParallelDecode`` and compares with one GPU attending over the whole KV (and with the
float64 reference). ``--check`` exits non-zero if the relative L2 error between the two GPU
results is 1e-2 or more (bfloat16 tolerance), or if a captured CUDA graph (``--graph``)
replays to a different result than the eager call.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

from splitkv.cli import args as A
from splitkv.runtime import gpu_available


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def init_group(kind: str, timeout_s: float):
    """This rank's GPU made current and the caller's group: torch's NCCL world group, or a
    cupyx.distributed communicator (its own store on MASTER_PORT + 1). Returns (group, close)."""
    import cupy

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cupy.cuda.Device(local_rank).use()
    if kind == "torch":
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


def capture_and_compare(cp, q, k, v, out, lse, stream) -> str:
    """Capture one whole call (local kernels, exchange, merge) in a CUDA graph, replay it and
    compare with the eager result. Returns what happened, in words."""
    import cupy

    out_g, lse_g = cupy.empty_like(out), cupy.empty_like(lse)
    cp.run(q, k, v, out=out_g, lse=lse_g, stream=stream)          # compiled, buffers made
    cp.group.wait(stream)
    graph, why = None, ""
    stream.begin_capture()
    try:
        cp.run(q, k, v, out=out_g, lse=lse_g, stream=stream)
    except Exception as exc:       # the group's call does not capture: say why, run eagerly
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
    try:
        captured = stream.end_capture()
        graph = None if why else captured
    except Exception as exc:
        why = why or f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not cp.group.agree(graph is not None, stream):
        return f"graph: capture failed ({why or 'on another rank'})"
    out_g.fill(0)
    lse_g.fill(0)
    graph.launch(stream)
    cp.group.wait(stream)
    same = bool((out_g == out).all()) and bool((lse_g == lse).all())
    return "graph: replay matches eager" if same else "graph: REPLAY DIFFERS from eager"


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[:2]))
    ap.add_argument("--lens", type=A.lengths, default="30000,4097,3,0,700",
                    help="tokens of each request, comma-separated (default %(default)s)")
    ap.add_argument("--heads", type=A.heads, default="32/8",
                    help="query heads / kv heads, as `splitkv plan` takes them (default "
                         "%(default)s)")
    ap.add_argument("--head-dim", type=A.head_dim, default=128)
    ap.add_argument("--page-size", type=A.int_range(1), default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--group", default="torch", choices=["torch", "cupy"],
                    help="torch.distributed's NCCL group, or a cupyx.distributed communicator")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="the group's timeout in seconds (default %(default)s)")
    ap.add_argument("--graph", action="store_true", help="also capture a call in a CUDA graph")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="exit 1 unless rel L2 vs one GPU < 1e-2")
    args = ap.parse_args()
    ok, why = gpu_available()
    if not ok:
        print(f"context_parallel.py needs a CUDA GPU for each rank: {why}", file=sys.stderr)
        return 2

    import cupy

    from splitkv import BatchDecodeWrapper, reference_decode
    from splitkv.core.reference import to_float64
    from splitkv.distributed import ContextParallelDecode, compact_page_table, shard_page_table
    from splitkv.measure.test_data import random_device_array, scattered_page_table

    group, close = init_group(args.group, args.timeout)
    lens, (hq, hk) = args.lens, args.heads
    d, page, dtype = args.head_dim, args.page_size, args.dtype

    stream = cupy.cuda.Stream(non_blocking=True)
    cp = ContextParallelDecode(group, hq, hk, d, page, dtype, timeout_s=args.timeout)
    rank = cp.rank

    # The same global batch on every rank (same seed); each rank then keeps only its pages.
    rng = np.random.default_rng(args.seed)
    table, num_pages = scattered_page_table(lens, page, rng)
    q = random_device_array((len(lens), hq, d), dtype, rng)
    k_all = random_device_array((num_pages, page, hk, d), dtype, rng)
    v_all = random_device_array((num_pages, page, hk, d), dtype, rng)

    shard = shard_page_table(table, cp.world_size)[rank]
    local_table, page_ids = compact_page_table(shard)
    ids = cupy.asarray(page_ids)
    k_local, v_local = k_all[ids], v_all[ids]

    plan = cp.plan(local_table, stream=stream)
    out, lse = cp.run(q, k_local, v_local, return_lse=True, stream=stream)
    cp.group.wait(stream)
    print(f"[rank {rank}] {cp.group!r}; local kv_lens {local_table.kv_lens.tolist()}: {plan}",
          flush=True)
    graph_ok = True
    if args.graph:
        said = capture_and_compare(cp, q, k_local, v_local, out, lse, stream)
        graph_ok = "DIFFERS" not in said
        print(f"[rank {rank}] {said}", flush=True)

    single = BatchDecodeWrapper(hq, hk, d, page, dtype)
    single.plan(table, stream=stream)
    out_1, lse_1 = single.run(q, k_all, v_all, return_lse=True, stream=stream)
    stream.synchronize()

    ref_out, ref_lse = reference_decode(q, k_all, v_all, table)
    got, one = to_float64(out), to_float64(out_1)
    err_single = rel_l2(got, one)
    err_ref = rel_l2(got, ref_out)
    finite = np.isfinite(ref_lse)
    lse_err = float(np.abs(lse.get()[finite] - ref_lse[finite]).max(initial=0.0))
    lse_inf_ok = bool(np.all(np.isneginf(lse.get()[~finite])))
    print(f"[rank {rank}] rel_l2 vs one GPU {err_single:.3e}, vs float64 reference {err_ref:.3e} "
          f"(one GPU vs reference {rel_l2(one, ref_out):.3e}); max |lse error| {lse_err:.2e}; "
          f"empty requests have lse -inf: {lse_inf_ok}", flush=True)
    ok = err_single < 1e-2 and err_ref < 1e-2 and lse_err < 1e-3 and lse_inf_ok and graph_ok
    all_ok = cp.group.agree(ok, stream)
    close()
    if args.check and not all_ok:
        print(f"[rank {rank}] CHECK FAILED (this rank ok: {ok})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
