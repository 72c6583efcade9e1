"""A discrete-event model of how the partial kernel's grid runs (diagnostic, not for the
planner's hot path): CTAs in grid order (the plan's launch order; each chunk's kv-head items
consecutive), P SMs of r slots; the first P*r CTAs are dealt 'breadth' (CTA i -> SM i mod P)
or 'depth' (CTA i -> SM i // r); after that each freed slot takes the next CTA. An SM shares
its throughput equally among its resident CTAs (processor sharing). Work of a CTA = its
64-token tiles (or tokens). Returns the makespan in SM-work units (one SM alone = 1/unit)."""
import heapq

import numpy as np

from splitkv.core.execution import grid_order
from splitkv.core.geometry import ctas_per_kv_head, TILE_TOKENS
from splitkv.planner.cost_model import resident_ctas


def cta_work(plan, unit="tiles"):
    p = plan.problem
    order = grid_order(plan)
    tok = (plan.chunk_end - plan.chunk_start)[order].astype(np.float64)
    w = np.ceil(tok / TILE_TOKENS) if unit == "tiles" else tok
    group = p.num_qo_heads // p.num_kv_heads
    per = p.num_kv_heads * ctas_per_kv_head(group)
    return np.repeat(w, per)


def slots_per_sm(plan, ctas_per_sm=2):
    p = plan.problem
    group = p.num_qo_heads // p.num_kv_heads
    ctas = ctas_per_kv_head(group)
    rows = -(-group // ctas)
    return resident_ctas(p.head_dim, ctas_per_sm, rows)


def simulate(work, P=132, r=2, deal="breadth", lone_slowdown=0.0):
    """Makespan of processor-sharing SMs. lone_slowdown: an SM with one CTA runs it at
    1/(1+s) of the SM rate (else rate 1/j each for j CTAs)."""
    n = len(work)
    if n == 0:
        return 0.0
    # per SM: virtual progress V (per-CTA work done at the shared rate), active finish list
    V = np.zeros(P)
    tlast = np.zeros(P)
    active = [[] for _ in range(P)]   # heaps of finish virtual times
    ver = np.zeros(P, dtype=np.int64)
    events = []
    nxt = 0
    first = min(n, P * r)

    def rate(j):
        return (1.0 / (1.0 + lone_slowdown)) if j == 1 else 1.0 / j

    def push(s, t):
        if active[s]:
            j = len(active[s])
            dt = (active[s][0] - V[s]) / rate(j)
            ver[s] += 1
            heapq.heappush(events, (t + dt, s, ver[s]))

    for i in range(first):
        s = i % P if deal == "breadth" else i // r
        heapq.heappush(active[s], work[i])
    nxt = first
    for s in range(P):
        push(s, 0.0)
    t = 0.0
    while events:
        t, s, v = heapq.heappop(events)
        if v != ver[s]:
            continue
        j = len(active[s])
        V[s] += (t - tlast[s]) * rate(j)
        tlast[s] = t
        # complete all CTAs that finish now
        while active[s] and active[s][0] <= V[s] + 1e-9:
            heapq.heappop(active[s])
            if nxt < n:
                heapq.heappush(active[s], V[s] + work[nxt])
                nxt += 1
        push(s, t)
    return t


def sim_crit(plan, deal="breadth", unit="tiles", lone_slowdown=0.0, ctas_per_sm=2):
    return simulate(cta_work(plan, unit), 132, slots_per_sm(plan, ctas_per_sm), deal,
                    lone_slowdown)


def simulate_fluid(work_bytes, slots, bw, r1):
    """Fluid model: the first ``slots`` CTAs start at once, each freed slot takes the next CTA
    in grid order; every running CTA streams at min(r1, bw / running) bytes/us (a lone CTA's
    rate, or its share of DRAM). Returns the makespan in us."""
    n = len(work_bytes)
    if n == 0:
        return 0.0
    heap = []
    V = 0.0          # bytes each running CTA has streamed since t = 0 (the same for all)
    t = 0.0
    nxt = min(n, slots)
    for i in range(nxt):
        heapq.heappush(heap, work_bytes[i])
    while heap:
        a = len(heap)
        rate = min(r1, bw / a)
        f = heap[0]
        t += (f - V) / rate
        V = f
        while heap and heap[0] <= V + 1e-9:
            heapq.heappop(heap)
            if nxt < n:
                heapq.heappush(heap, V + work_bytes[nxt])
                nxt += 1
    return t


def fluid_us(plan, bw=4460e3, r1=51e3, ctas_per_sm=2):
    """bytes/us: bw 4.46 TB/s, r1 51 GB/s (a lone CTA at 16-bit head_dim 128, from
    r2_n12414's lone grids: 0.64 us a 64-token tile)."""
    p = plan.problem
    tok = cta_work(plan, "tokens")
    return simulate_fluid(tok * p.head_dim * 4, 132 * slots_per_sm(plan, ctas_per_sm), bw, r1)
