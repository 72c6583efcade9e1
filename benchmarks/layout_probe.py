import numpy as np
from splitkv.core.problem import DecodeProblem
from splitkv.core.plan import plan_fixed_splits
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_plan_us
from splitkv.bench.bandwidth import read_bandwidth_gbps
bw = read_bandwidth_gbps()
print("read", round(bw))
for name, b, n, hq, hk, ps in [("b32_n8k_hk8", 32, 8192, 32, 8, 16), ("b256_n8k_hk1", 256, 8192, 4, 1, 16),
                               ("b32_n8k_hk8_p256", 32, 8192, 32, 8, 256), ("b64_n8k_hk4", 64, 8192, 16, 4, 16),
                               ("b128_n8k_hk2", 128, 8192, 8, 2, 16)]:
    pt, _ = scattered_page_table([n] * b, ps, np.random.default_rng(0), 0)
    prob = DecodeProblem.from_page_table(pt, hq, hk, 128)
    data = make_layers(pt, hq, hk, 128, "bfloat16")
    for s in (1, 2):
        us = time_plan_us(plan_fixed_splits(prob, s, None, align=64), pt, data=data, trials=3, min_trial_ms=10)
        print(name, "splits", s, round(us, 1), "us", round(prob.kv_bytes / us / 1e3 / bw * 100, 1), "%")
