"""Feature variants of the cost model, computed from a built plan (nothing in splitkv changes).

  lib          the library's plan_features (14 columns).
  shared       change 1: the largest chunk shares its SM. crit = max(M, L + (1 - 1/k) M) for the
               critical path's tokens and tiles (crit_us, crit_tiles, crit_tile_rows), where
               M = sm_waves x mean item (the library's per-SM wave term), L the largest chunk,
               k = clip(items / num_sms, 1, slots an SM) the CTAs that share an SM on average.
               (Library: max(M, L), i.e. the largest chunk runs at a whole SM's rate.)
  sim          diagnostic: the critical path from s13_sim's processor-sharing simulation.
  mgrid        change 2: one more column for 'split_merge' plans that merge: the merge
               kernel's CTAs (batch x qo heads x head_dim / 4 threads, 128 a CTA) / num_sms,
               i.e. CTA waves of a kernel whose every row of every request is scheduled, split
               or not (the library counts only the second launch and the longest merge chain).
  sharedx      change 1, fitted: the library's critical path, plus one column: how much the
               shared-SM critical path exceeds it (tiles, crit_tiles' unit).
  tailx        the same excess (tokens at one SM's bandwidth) in place of tail_us (14 columns).
  smpart       one more column: partial_us again for 'split_merge' plans (their merge reads the
               partials after the partial kernel, not overlapped with streaming as 'fused's).
  soft         the per-SM mean term's last partial wave counted at mean / largest chunk
               (ceil for equal chunks; LPT deals a ragged grid's smallest chunks last).
  softw        the same for the slot waves (start-ups).
  ticket       one more column for 'fused' plans that merge with a ticket: their ticket CTAs
               (split requests' chunks x items a chunk) / slots.
  fluid        diagnostic: crit_us replaced by the makespan of a fluid model (s13_sim.fluid_us:
               every running CTA streams at min(lone rate, DRAM / running CTAs)).
  fluidx       the same as one more column.
  fluidc       crit_us replaced by a closed form of the fluid model:
               max(L / r1, W / BW + max(0, L - W / min(items, slots)) / r1) us.
  mgridu       as mgrid, counting only the rows of unsplit requests (CTAs that only return).
  mcold        one more column for 'split_merge' plans that merge: min(1, kv bytes / 50 MB of L2)
               (the partials were evicted by the K/V streamed after them); mcoldc: x max splits.
  mcold2       as mcold, counting only the K/V streamed by CTAs past the first wave of slots
               (kv bytes x max(0, 1 - slots / items)).
Combine with '+', e.g. 'shared+mgrid'.
"""
import numpy as np

from splitkv.core.geometry import TILE_TOKENS
from splitkv.planner.cost_model import FEATURE_NAMES, feature_constants
from s13_common import BW, NUM_SMS, lib_features

FLUID = {"r1": 70e3, "bw": 4460e3}   # bytes / us: a lone CTA's streaming rate (chosen on the sweep: s13_r1_scan.py), DRAM
I_CRIT_US, I_CRIT_TILES, I_TILE_ROWS = 3, 4, 5
I_LONE = FEATURE_NAMES.index("lone_cta_us")
I_TAIL = FEATURE_NAMES.index("tail_us")


def geometry(plan):
    p = plan.problem
    ipc, slots, units = feature_constants(p.num_qo_heads, p.num_kv_heads, p.head_dim, NUM_SMS,
                                          2, BW)
    tok = (plan.chunk_end - plan.chunk_start).astype(np.float64)
    tiles = np.ceil(tok / TILE_TOKENS)
    items = tok.size * ipc
    return dict(ipc=ipc, slots=slots, r=slots / NUM_SMS, items=items, tok=tok, tiles=tiles,
                sm_waves=np.ceil(items / NUM_SMS), mean_tok=tok.sum() / tok.size,
                mean_tiles=tiles.sum() / tiles.size)


def soft_waves(items, slots, ratio):
    """items / slots, with the last partial wave counted at ``ratio`` (mean / largest chunk:
    1 for equal chunks, i.e. ceil; LPT deals the smallest chunks last)."""
    w = items / slots
    return w + (np.ceil(w) - w) * ratio


def mean_term(g, which, soft=False):
    if not soft:
        return g["sm_waves"] * g["mean_" + which]
    ratio = g["mean_tok"] / max(g["tok"].max(), 1.0)
    return soft_waves(g["items"], NUM_SMS, ratio) * g["mean_" + which]


def shared_crit(g, which, soft=False):
    L = g[which].max()
    M = mean_term(g, which, soft)
    k = min(max(g["items"] / NUM_SMS, 1.0), g["r"])
    return max(M, L + (1.0 - 1.0 / k) * M)


_SIM = {}


def sim_crit_cached(plan):
    from s13_sim import sim_crit
    key = id(plan)
    if key not in _SIM:
        _SIM[key] = (plan, sim_crit(plan, "breadth", "tiles"), sim_crit(plan, "breadth", "tokens"))
    return _SIM[key][1], _SIM[key][2]


def features(plan, variant="lib"):
    parts = variant.split("+")
    x = lib_features(plan).copy()
    g = None
    soft = "soft" in parts
    if soft and not ("shared" in parts or "sim" in parts):
        g = geometry(plan)
        old_tok = max(g["tok"].max(), g["sm_waves"] * g["mean_tok"])
        old_tiles = max(g["tiles"].max(), g["sm_waves"] * g["mean_tiles"])
        new_tok = max(g["tok"].max(), mean_term(g, "tok", True))
        new_tiles = max(g["tiles"].max(), mean_term(g, "tiles", True))
        if old_tok > 0:
            x[I_CRIT_US] *= new_tok / old_tok
            x[I_LONE] *= new_tok / old_tok
        if old_tiles > 0:
            x[I_CRIT_TILES] *= new_tiles / old_tiles
            x[I_TILE_ROWS] *= new_tiles / old_tiles
    if "softw" in parts:
        g = geometry(plan)
        ratio = g["mean_tok"] / max(g["tok"].max(), 1.0)
        x[FEATURE_NAMES.index("waves")] = soft_waves(g["items"], g["slots"], ratio)
    if "shared" in parts or "sim" in parts:
        g = geometry(plan)
        old_tok = max(g["tok"].max(), g["sm_waves"] * g["mean_tok"])
        old_tiles = max(g["tiles"].max(), g["sm_waves"] * g["mean_tiles"])
        if "shared" in parts:
            new_tok, new_tiles = shared_crit(g, "tok"), shared_crit(g, "tiles")
        else:
            new_tiles, new_tok = sim_crit_cached(plan)
        if old_tok > 0:
            x[I_CRIT_US] *= new_tok / old_tok
        if old_tiles > 0:
            x[I_CRIT_TILES] *= new_tiles / old_tiles
            x[I_TILE_ROWS] *= new_tiles / old_tiles
    if "tailx" in parts or "sharedx" in parts:
        # the excess of the shared-SM critical path over the library's, as its own column
        # ('sharedx', in crit_tiles' unit) or in place of tail_us ('tailx', tokens at one SM's
        # bandwidth: crit_us' unit)
        g = geometry(plan)
        p = plan.problem
        ex_tiles = shared_crit(g, "tiles", soft) - max(g["tiles"].max(), mean_term(g, "tiles", soft))
        ex_tok = shared_crit(g, "tok", soft) - max(g["tok"].max(), mean_term(g, "tok", soft))
        _, _, units = feature_constants(p.num_qo_heads, p.num_kv_heads, p.head_dim, NUM_SMS, 2, BW)
        if "tailx" in parts:
            x[I_TAIL] = ex_tok * units[I_CRIT_US, 0]
        else:
            x = np.append(x, ex_tiles * units[I_CRIT_TILES, 0])
    if "tail2" in parts or "tail2sm" in parts or "tail2x" in parts:
        # tail_us redefined: the largest chunk's tokens beyond what one concurrently running CTA
        # streams while the grid is full (total tokens x items per chunk / CTAs running at once,
        # min(items, slots)); the library's mean item equals it only for grids of one wave
        g = geometry(plan)
        p = plan.problem
        _, _, units = feature_constants(p.num_qo_heads, p.num_kv_heads, p.head_dim, NUM_SMS, 2, BW)
        conc = min(g["items"], g["slots"] if "tail2sm" not in parts else NUM_SMS)
        share = g["tok"].sum() * g["ipc"] / conc
        val = max(0.0, g["tok"].max() - share) * units[I_TAIL, 0]
        if "tail2x" in parts:
            x = np.append(x, val)
        else:
            x[I_TAIL] = val
    if "mgrid" in parts and "mgridu" not in parts:
        p = plan.problem
        merges = plan.strategy == "split_merge" and plan.num_chunks > p.batch_size
        ctas = -(-(p.batch_size * p.num_qo_heads * (p.head_dim // 4)) // 128)
        x = np.append(x, ctas / NUM_SMS if merges else 0.0)
    if "mgridu" in parts:
        # the merge kernel's CTAs that only return: rows of requests in one chunk
        p = plan.problem
        merges = plan.strategy == "split_merge" and plan.num_chunks > p.batch_size
        unsplit = int((plan.chunks_per_request == 1).sum())
        ctas = -(-(unsplit * p.num_qo_heads * (p.head_dim // 4)) // 128)
        x = np.append(x, ctas / NUM_SMS if merges else 0.0)
    if ("mcold" in parts or "mcoldc" in parts) and "mcold2" not in parts:
        # 'split_merge' reads the partials after the whole grid streamed its K and V: past the
        # L2 (50 MB on the H200) they were evicted, and the merge's dependent chain of reads
        # goes to DRAM. Column: min(1, kv bytes / L2) (x merge_chain for 'mcoldc')
        p = plan.problem
        merges = plan.strategy == "split_merge" and plan.num_chunks > p.batch_size
        cold = min(1.0, p.kv_bytes / 50e6)
        x = np.append(x, (cold * (plan.num_splits if "mcoldc" in parts else 1.0)) if merges else 0.0)
    if "mcold2" in parts:
        # as mcold, counting only the K/V that CTAs after the first wave of slots stream (a grid
        # of one wave writes its partials last: they are still in L2 when the merge reads them)
        p = plan.problem
        g = geometry(plan)
        merges = plan.strategy == "split_merge" and plan.num_chunks > p.batch_size
        late = max(0.0, 1.0 - g["slots"] / g["items"])
        x = np.append(x, min(1.0, p.kv_bytes * late / 50e6) if merges else 0.0)
    if "ticket" in parts:
        # the CTAs that take a ticket (every CTA of a split request in a 'ticket' fused plan:
        # a fence, an atomic, and for the last one the merge), per slot: each adds its latency
        # to the wave it runs in
        g = geometry(plan)
        cpr = plan.chunks_per_request
        n_ticket = float(cpr[cpr > 1].sum()) * g["ipc"]
        x = np.append(x, n_ticket / g["slots"] if plan.merge == "ticket" else 0.0)
    if "fluid" in parts or "fluidx" in parts:
        from s13_sim import fluid_us
        key = ("fluid", id(plan))
        if key not in _SIM:
            _SIM[key] = (plan, fluid_us(plan))
        v = _SIM[key][1]
        if "fluid" in parts:
            x[I_CRIT_US] = v          # the critical path as the fluid model's makespan (us)
        else:
            x = np.append(x, v)
    if "fluidc" in parts or "fluidcx" in parts:
        # closed form of the fluid model: while the grid is full, DRAM-bound (W / BW), the
        # largest CTA streaming its share W / min(items, slots); then the rest of it alone at
        # a lone CTA's rate; at least the largest CTA alone
        g = geometry(plan)
        p = plan.problem
        tb = p.head_dim * 4.0
        W = g["tok"].sum() * g["ipc"] * tb
        L = g["tok"].max() * tb
        conc = min(g["items"], g["slots"])
        r1, bw = FLUID["r1"], FLUID["bw"]
        v = max(L / r1, W / bw + max(0.0, L - W / conc) / r1)
        if "fluidc" in parts:
            x[I_CRIT_US] = v
        else:
            x = np.append(x, v)
    if "smpart" in parts:
        x = np.append(x, x[FEATURE_NAMES.index("partial_us")] if plan.strategy == "split_merge" else 0.0)
    return x
