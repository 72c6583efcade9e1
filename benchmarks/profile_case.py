"""Run one standard case's decode a few times eagerly, for Nsight Compute to profile:

    ncu --clock-control none --kernel-name decode_partial --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats python3 benchmarks/profile_case.py b32_n8k [num_splits] [kv_dtype]
"""

import sys

import cupy
import numpy as np

from splitkv.bench.cases import select
from splitkv.measure.timing import make_layers
from splitkv.runtime.wrapper import BatchDecodeWrapper
from splitkv.testing import scattered_page_table

case = select(sys.argv[1])[0]
num_splits = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "0" else None
kv_dtype = sys.argv[3] if len(sys.argv) > 3 else None
pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0), 0)
data = make_layers(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim, "bfloat16",
                   min_total_bytes=1 << 30, kv_dtype=kv_dtype)
w = BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size,
                       kv_dtype=kv_dtype)
print(w.plan(pt, num_splits=num_splits))
for i in range(6):
    w.run(data.q, data.k_layers[i % data.num_layers], data.v_layers[i % data.num_layers], out=data.out)
cupy.cuda.runtime.deviceSynchronize()
