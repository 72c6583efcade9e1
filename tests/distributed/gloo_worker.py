"""One rank of the gloo tests (test_distributed_gloo.py starts it under torchrun).

    torchrun --nproc-per-node N gloo_worker.py DATA.npz OUT_DIR MODE

Every rank loads the same batch (float64, bfloat16 bits and float16 copies of q, K, V and the
page table), keeps its shard, runs ContextParallelDecode's CPU path through a gloo group and
writes its outputs to OUT_DIR/rank{R}.npz for the test to compare with one process. MODE:

  merge   every dtype over the whole world; with 4 ranks also over two sub-groups of 2 (an
          engine's context-parallel groups inside its world); and a plan() whose batch sizes
          differ between ranks, which must raise on every rank
  raise   rank 1 raises after plan(); the others go on into the all-gather
  stall   rank 1 sleeps after plan(); the others wait in the all-gather until the timeout
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import numpy as np
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from splitkv import PageTable
from splitkv.distributed import ContextParallelDecode, compact_page_table, shard_page_table

DTYPES = ("float64", "bfloat16", "float16")


def load(path):
    d = np.load(path)
    table = PageTable(d["kv_indptr"], d["kv_indices"], d["kv_last_page_len"], int(d["page_size"]))
    return d, table


def run_cp(group, d, table, dtype, **plan_kwargs):
    """This rank's (out, lse) of the whole batch through ``group``."""
    rank, size = group.rank(), group.size()
    local, page_ids = compact_page_table(shard_page_table(table, size)[rank])
    q, k, v = (d[f"{name}_{dtype}"] for name in ("q", "k", "v"))
    hq, d_head, hk = q.shape[1], q.shape[2], k.shape[2]
    cp = ContextParallelDecode(group, hq, hk, d_head, table.page_size, dtype)
    assert cp.device == "cpu" and (cp.rank, cp.world_size) == (rank, size)
    cp.plan(local, **plan_kwargs)
    return cp.run(q, k[page_ids], v[page_ids], return_lse=True)


@record
def main() -> int:
    data_path, out_dir, mode = sys.argv[1:4]
    timeout = datetime.timedelta(seconds=float(os.environ.get("CP_TEST_TIMEOUT", "30")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    d, table = load(data_path)
    results = {}
    if mode == "merge":
        for dtype in DTYPES:
            results[f"out_{dtype}"], results[f"lse_{dtype}"] = run_cp(dist.group.WORLD, d, table,
                                                                      dtype)
        results["out_split3"], results["lse_split3"] = run_cp(dist.group.WORLD, d, table,
                                                              "float64", num_splits=3)
        if world == 4:               # every rank makes both sub-groups, then uses its own
            subs = [dist.new_group(ranks, timeout=timeout) for ranks in ([0, 1], [2, 3])]
            results["out_sub"], results["lse_sub"] = run_cp(subs[rank // 2], d, table, "float64")
        try:                         # a gloo group cannot carry the GPU path
            ContextParallelDecode(dist.group.WORLD, 4, 2, 64, table.page_size, device="cuda")
            results["cuda_on_gloo"] = np.array("no error")
        except ValueError as exc:
            results["cuda_on_gloo"] = np.array(str(exc))
        # a rank whose table has one request fewer: plan() refuses on every rank
        short = PageTable.from_block_table(np.zeros((1 if rank == world - 1 else 2, 1), np.int64),
                                           [5] * (1 if rank == world - 1 else 2), table.page_size)
        cp = ContextParallelDecode(dist.group.WORLD, 4, 2, 64, table.page_size, "float64")
        try:
            cp.plan(short)
            results["mismatch"] = np.array("no error")
        except ValueError as exc:
            results["mismatch"] = np.array(str(exc))
    elif mode in ("raise", "stall"):
        group = dist.group.WORLD
        local, page_ids = compact_page_table(shard_page_table(table, world)[rank])
        q, k, v = d["q_float64"], d["k_float64"], d["v_float64"]
        cp = ContextParallelDecode(group, q.shape[1], k.shape[2], q.shape[2], table.page_size,
                                   "float64")
        cp.plan(local)
        if rank == 1 and mode == "raise":
            raise RuntimeError("boom on rank 1")
        if rank == 1:
            time.sleep(600)
        cp.run(q, k[page_ids], v[page_ids])      # its peer never joins the all-gather
    else:
        raise ValueError(f"MODE: expected merge, raise or stall, got {mode!r}")
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
