"""What planning costs per decode step, on the host and on the device.

For each case: the host ``plan()`` of a graph-stable wrapper (median wall time, the GPU idle);
the planning kernel alone (a graph of 20 ``plan_on_device()`` launches, GPU time per launch);
and one decode step as an engine runs it, a graph of L layers (>= 1 GiB of KV, as the bench):
host-planned (``plan()`` before the replay, the graph holds the L runs) against device-planned
(the graph holds ``plan_on_device()`` and the L runs): the difference is what the planning
kernel adds to a step's GPU time. Both graphs run the same plan (the test suite checks it).
The design and the numbers of record: docs/design/graph-stable.md.

    PYTHONPATH=$PWD python3 benchmarks/device_plan_cost.py [--cases b1_n8k,...] [--json out.json]
        [--phases] [--scratch global]

--cases takes what ``ab.py --cases`` takes (standard names, ragged_b256, or generic ones such as
b16_n8k), so ``--phases --cases b1_n8k,b2_n8k,b8_n8k,b16_n8k,b32_n8k`` sweeps the batch size;
--scratch global keeps the planning kernel's scratch in global memory where it would fit in
shared memory (what each step costs from where its per-request arrays live).
"""

import argparse
import json
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from ab import select_cases  # noqa: E402

from splitkv.bench.cases import STANDARD_CASES, Case, ragged_b256_lengths  # noqa: E402
from splitkv.measure.timing import (WARMUP_MS, make_layers, median_host_us,  # noqa: E402
                                     median_us_per_call)
from splitkv.runtime.cupy_timers import cupy_timer  # noqa: E402
from splitkv.runtime.wrapper import BatchDecodeWrapper  # noqa: E402
from splitkv.testing import block_table_of, scattered_page_table  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default=None,
                    help="cases as ab.py --cases takes them (default: the standard ones + r256)")
parser.add_argument("--json", default=None)
parser.add_argument("--phases", action="store_true",
                    help="also split the planning kernel's time by its steps (capacity = the "
                         "batch and 256), from the build that stamps the SM clock")
parser.add_argument("--scratch", choices=("auto", "global"), default="auto",
                    help="where the planning kernel keeps its scratch: in shared memory where "
                         "it fits (auto), or always in global memory")
args = parser.parse_args()
if args.scratch == "global":
    from splitkv.runtime import device_planner

    device_planner.MAX_SHARED_SCRATCH_BYTES = 0

cases = select_cases(args.cases) if args.cases else list(STANDARD_CASES)
if not args.cases:
    cases.append(Case("ragged_b256", tuple(int(n) for n in ragged_b256_lengths())))


def graph_us(capture, stream, calls: int) -> float:
    """Median us per call of a graph whose capture is ``capture(stream)`` (``calls`` calls)."""
    capture(stream)                      # eager once: compiles, faults pages in
    stream.begin_capture()
    capture(stream)
    graph = stream.end_capture()
    run_timed = cupy_timer(lambda: graph.launch(stream), stream)
    one_ms = max(run_timed(1), 1e-3)
    run_timed(int(np.ceil(WARMUP_MS / one_ms)))
    return median_us_per_call(run_timed, calls)


rows = []
print(f"{'case':>12} {'host plan()':>12} {'plan kernel':>12} {'eager call':>11} "
      f"{'step host-planned':>18} {'step device-planned':>20} {'added/step':>11}  plan")
for case in cases:
    rng = np.random.default_rng(0)
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, rng, extra_pages=0)
    batch = len(case.kv_lens)
    shape = (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, "bfloat16")
    width = int(np.diff(pt.kv_indptr).max())
    capacity = dict(use_cuda_graph=True, max_batch_size=batch,
                    max_num_pages=max(pt.kv_indices.size, batch * width))
    host = BatchDecodeWrapper(*shape, **capacity)
    device = BatchDecodeWrapper(*shape, **capacity)
    stream = cupy.cuda.Stream(non_blocking=True)
    plan = host.plan(pt, stream=stream)
    host_us = median_host_us(lambda: host.plan(pt, stream=stream), 200, warmup=20,
                             idle_device=True)
    table = block_table_of(pt, width, pad=0)
    seq_lens, block_table = cupy.asarray(np.asarray(case.kv_lens, np.int32)), cupy.asarray(table)

    def plan_on_device(s):
        device.plan_on_device(seq_lens=seq_lens, block_table=block_table, stream=s)

    with stream:
        plan_on_device(stream)
        kernel_us = graph_us(lambda s: [plan_on_device(s) for _ in range(20)], stream, 20)
        eager_us = median_host_us(lambda: plan_on_device(stream), 200, warmup=20,
                                  idle_device=True)
        state = device.device_plan_state()
        same = (state["strategy"], state["num_chunks"]) == (plan.strategy, plan.num_chunks)
        data = make_layers(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim, "bfloat16",
                           min_total_bytes=1 << 30, seed=0)
        layers = data.num_layers

        def runs(w, s):
            for k, v in zip(data.k_layers, data.v_layers):
                w.run(data.q, k, v, out=data.out, stream=s)

        host_step = graph_us(lambda s: runs(host, s), stream, 1)
        device_step = graph_us(lambda s: (plan_on_device(s), runs(device, s)), stream, 1)
    row = {"case": case.name, "host_plan_us": round(host_us, 1),
           "plan_kernel_us": round(kernel_us, 2), "plan_on_device_host_us": round(eager_us, 1),
           "layers": layers, "step_host_planned_us": round(host_step, 1),
           "step_device_planned_us": round(device_step, 1),
           "added_per_step_us": round(device_step - host_step, 2),
           "plan": f"{plan.strategy}/{plan.num_splits}", "same_plan": same}
    rows.append(row)
    print(f"{case.name:>12} {host_us:10.1f}us {kernel_us:10.2f}us {eager_us:9.1f}us "
          f"{host_step:13.1f}us/{layers:<3d} {device_step:15.1f}us/{layers:<3d} "
          f"{device_step - host_step:9.2f}us  {row['plan']}{'' if same else ' DIFFERENT PLAN'}",
          flush=True)
    data = None                 # this case's layers freed before the next case's
    cupy.get_default_memory_pool().free_all_blocks()

# the stamps' intervals: from the start to the first barrier, thread 0 reading its request, the
# rest of the requests' step (the other reads, the sums), then the later steps
STEPS = ("start", "request read", "request sums", "candidates", "row sums", "cheapest", "chunks",
         "grid order", "records")


def phase_us(case, capacity: int, repeats: int = 30) -> list[float]:
    """Median microseconds of each planning step (``STEPS``), eager launches of the stamping
    build of the planning kernel, for a graph-stable wrapper of ``capacity``."""
    from splitkv.runtime.device_planner import phase_clocks

    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0), 0)
    width = int(np.diff(pt.kv_indptr).max())
    table = block_table_of(pt, width, pad=0)
    w = BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size,
                           "bfloat16", use_cuda_graph=True, max_batch_size=capacity,
                           max_num_pages=capacity * width)
    lens, table = cupy.asarray(np.asarray(case.kv_lens, np.int32)), cupy.asarray(table)
    w.plan_on_device(seq_lens=lens, block_table=table)
    planner = w._device_planner
    planner.phases = True
    planner.bind(planner.batch, planner.arrays)
    mhz = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0) / 1e3
    clocks = []
    for _ in range(repeats):
        w.plan_on_device(seq_lens=lens, block_table=table)
        clocks.append(np.diff(phase_clocks()))
    return [float(c) / mhz for c in np.median(np.array(clocks), axis=0)]


if args.phases:
    print(f"planning kernel steps, us at the SM clock (eager launches): {', '.join(STEPS)}")
    for case in cases:
        for capacity in sorted({len(case.kv_lens), 256}):
            us = phase_us(case, capacity)
            row = next(r for r in rows if r["case"] == case.name)
            row[f"steps_us_capacity_{capacity}"] = {k: round(v, 2) for k, v in zip(STEPS, us)}
            print(f"{case.name:>12} capacity {capacity:3d}: total {sum(us):6.2f} us | "
                  + " ".join(f"{v:5.2f}" for v in us), flush=True)

if args.json:
    with open(args.json, "w") as f:
        json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                   "rows": rows}, f, indent=1)
