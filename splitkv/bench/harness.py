"""The benchmark harness behind `splitkv bench`: time the standard cases, compare them with the
read floor and the peers, and assemble the results (a dict that is written as JSON, and its
markdown table) with the date, the GPU and the command."""

from __future__ import annotations

import datetime as _dt

import numpy as np

from .._log import logger
from ..measure.timing import median_host_us
from .bandwidth import PROBE_SHAPES
from .cases import FP8_BEST_PEER_US, LATENCY_TARGETS_US, ragged_b256_lengths


def _rel_err_subset(wrapper, page_table, data, max_requests: int = 4, kv_dtype=None) -> float:
    """Relative L2 error of the first few requests of layer 0 against the float64 reference."""
    from ..core.problem import PageTable
    from ..core.reference import reference_decode, to_float64
    from ..runtime.cupy_arrays import to_device

    out = wrapper.run(data.q, data.k_layers[0], data.v_layers[0])
    n = min(max_requests, page_table.batch_size)
    last_page = int(page_table.kv_indptr[n])
    pages = page_table.kv_indices[:last_page]
    sub = PageTable.from_flashinfer(page_table.kv_indptr[: n + 1], np.arange(last_page),
                                    page_table.kv_last_page_len[:n], page_table.page_size)
    idx = to_device(pages)
    ref, _ = reference_decode(data.q[:n].get(), data.k_layers[0][idx].get(),
                              data.v_layers[0][idx].get(), sub, kv_dtype=kv_dtype)
    got = to_float64(out[:n])
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    if not np.isfinite(err):           # say which side is not finite, and whether it repeats
        again = to_float64(wrapper.run(data.q, data.k_layers[0], data.v_layers[0])[:n])

        def rows(a):
            return np.flatnonzero(~np.isfinite(a).all(axis=(1, 2))).tolist()

        same = np.array_equal(got, again, equal_nan=True)
        logger.warning(f"rel err check: non-finite rows of the output {rows(got)}, of the "
                       f"reference {rows(ref)}; a second run's output rows {rows(again)}, "
                       f"{'the same' if same else 'different'} bits")
    return err


def _watch_data(data, kv_dtype, case_name: str, log, after: str = "") -> str | None:
    """The step after which the case's random (finite) q or K/V first held a non-finite value,
    logged with where; None while all is finite. ``after`` empty: the data as made."""
    found = data.non_finite(kv_dtype)
    if not found:
        return None
    step = after or "making the data"
    log(f"{case_name}: the data is not finite after {step}: {found} (array: count, first index)")
    return step


def _plan_cpu_us(problem, profile, repeats: int = 200) -> float:
    """Median host time of choosing a plan (``choose_plan``; ``plan()`` then builds the chunk
    records and uploads them)."""
    from ..planner import choose_plan

    return median_host_us(lambda: choose_plan(problem, profile), repeats)


def _wrapper_plan_cpu_us(wrapper, page_table, repeats: int = 200, **plan_args) -> float:
    """Median host time of the whole ``wrapper.plan(page_table)``: choosing, building the chunk
    records, copying them and the page table to the GPU. The device is idle before each call
    (untimed synchronize), as in a decode loop."""
    return median_host_us(lambda: wrapper.plan(page_table, **plan_args), repeats, warmup=20,
                          idle_device=True)


def run_cases(cases, *, dtype: str = "bfloat16", min_total_mib: int = 1024,
              num_splits: int | None = None, strategy: str | None = None, peer: bool = True,
              seed: int = 0, command: str = "", log=None, graph_stable: bool = True,
              kv_dtype: str | None = None, flashinfer: bool = False) -> dict:
    """Time each of ``cases`` (``cases.Case``) on the current GPU, as the planner plans it (or
    with ``num_splits``/``strategy`` forced), over layers that together hold at least
    ``min_total_mib`` MiB of KV, with PyTorch SDPA on contiguous KV as a peer where ``peer`` and
    torch is installed. ``log(line)`` is called with a line of progress as each step ends.
    ``graph_stable``: also time each case through a graph-stable wrapper (``use_cuda_graph``,
    capacity: the case's batch and pages, the default max_chunks), the same way.
    ``kv_dtype`` (an fp8 format): fp8 K/V (random codes, scale 1), the floor on fp8 bytes, the
    recorded fp8 peers (``cases.FP8_BEST_PEER_US``) and no SDPA peer (it has no fp8 KV).
    ``flashinfer``: also time FlashInfer's paged paths (``flashinfer_peer``) on the same page
    table and K/V in the same run; the best of them is the case's live peer.

    Returns the results as written to JSON: the device, date, ``command``, the read floor
    (probed before and after the cases), first-call compile time, the planner's CPU time and a
    row per case (us, GB/s, fraction of the floor, error, plan, peers).
    """
    from ..core.problem import DecodeProblem
    from ..measure.timing import make_layers, time_wrapper_us
    from ..runtime import device_info
    from ..runtime.cupy_arrays import free_cached_blocks
    from ..runtime.modules import compile_seconds_so_far
    from ..runtime.wrapper import BatchDecodeWrapper
    from ..testing import scattered_page_table
    from .bandwidth import read_bandwidth_survey
    from .peers import sdpa_us, torch_available

    log = log or (lambda line: None)
    info = device_info()
    # The floor is probed before and after the cases (clocks and other tenants drift), and the
    # fastest read of either is the floor: a slower floor would flatter the cases.
    probe_start = read_bandwidth_survey()
    read_gbps = max(probe_start.values())
    log(f"device: {info['name']} ({info['num_sms']} SMs); streaming read {read_gbps:,.0f} GB/s "
        f"(best of {probe_start})")
    use_peer = peer and torch_available()
    if flashinfer:
        from .flashinfer_peer import flashinfer_available, flashinfer_us

        ok, version = flashinfer_available()
        if not ok:
            raise RuntimeError(f"flashinfer: {version}")
        log(f"live peer: FlashInfer {version}")
        flashinfer_version = version
    rows = []
    compile_s = None
    plan_us_ragged = wrapper_plan_us_ragged = None
    for case in cases:
        rng = np.random.default_rng(seed)
        pt, _ = scattered_page_table(case.kv_lens, case.page_size, rng, extra_pages=0)
        problem = DecodeProblem.from_page_table(pt, case.num_qo_heads, case.num_kv_heads,
                                                case.head_dim, dtype)
        w = BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim,
                               case.page_size, dtype, kv_dtype=kv_dtype)
        plan = w.plan(pt, num_splits=num_splits, strategy=strategy)
        if compile_s is None:
            compile_s = compile_seconds_so_far()
        if not case.equal_lengths:
            plan_us_ragged = _plan_cpu_us(problem, w.profile)
            wrapper_plan_us_ragged = _wrapper_plan_cpu_us(w, pt, num_splits=num_splits,
                                                          strategy=strategy)
        data = make_layers(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim, dtype,
                           min_total_bytes=min_total_mib << 20, seed=seed, kv_dtype=kv_dtype)
        corrupted = _watch_data(data, kv_dtype, case.name, log)
        us = time_wrapper_us(w, data)
        corrupted = corrupted or _watch_data(data, kv_dtype, case.name, log, "the timed runs")
        graph_us = graph_plan = None
        if graph_stable:
            stable = BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim,
                                        case.page_size, dtype, kv_dtype=kv_dtype,
                                        use_cuda_graph=True,
                                        max_batch_size=len(case.kv_lens),
                                        max_num_pages=pt.kv_indices.size)
            graph_plan = stable.plan(pt, num_splits=num_splits, strategy=strategy)
            graph_us = time_wrapper_us(stable, data)
            corrupted = corrupted or _watch_data(data, kv_dtype, case.name, log,
                                                 "the graph-stable timed runs")
        err = _rel_err_subset(w, pt, data, kv_dtype=kv_dtype)
        live = None
        if flashinfer:
            live = flashinfer_us(pt, data, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                                 dtype, kv_dtype, log=log)
            corrupted = corrupted or _watch_data(data, kv_dtype, case.name, log,
                                                 "the FlashInfer peer (after the error check)")
        kv_bytes = problem.kv_bytes // 2 if kv_dtype else problem.kv_bytes   # fp8: one byte
        gbps = kv_bytes / (us * 1e-6) / 1e9
        peer_us = None
        if use_peer and case.equal_lengths and not kv_dtype:
            peer_us = sdpa_us(len(case.kv_lens), case.kv_lens[0], case.num_qo_heads,
                              case.num_kv_heads, case.head_dim, min_total_bytes=min_total_mib << 20)
        row = {"case": case.name, "us": round(us, 2), "gbps": round(gbps, 1),
               "frac_read_bw": round(gbps / read_gbps, 4), "rel_err": float(f"{err:.3e}"),
               "strategy": plan.strategy, "num_splits": plan.num_splits,
               "work_items": plan.num_work_items, "layers": data.num_layers,
               "pdl": w.pdl_active, "cluster": w.cluster_size,
               "predicted_us": None if plan.predicted_us is None else round(plan.predicted_us, 2),
               "peer_us": None if peer_us is None else round(peer_us, 2),
               "best_paged_peer_us": (FP8_BEST_PEER_US.get(case.name) if kv_dtype
                                      else case.best_paged_peer_us),
               "kv_mib": kv_bytes / 2**20,
               "flashinfer_us": (None if live is None else
                                 {k: None if v is None else round(v, 2) for k, v in live.items()}),
               "graph_stable_us": None if graph_us is None else round(graph_us, 2),
               "graph_stable_plan": (None if graph_plan is None else
                                     f"{graph_plan.strategy}/{graph_plan.num_splits}"),
               "data_non_finite_after": corrupted}
        rows.append(row)
        # % of the floor probed before the cases; the table uses the final floor
        log(f"{case.name:>12}: {us:8.2f} us {gbps:7.0f} GB/s {100 * gbps / read_gbps:5.1f}% "
            f"{plan.strategy}/{plan.num_splits} err {err:.1e}"
            + (f" | sdpa {peer_us:.2f} us" if peer_us else "")
            + (" | flashinfer " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}"
                                            for k, v in live.items()) if live else "")
            + (f" | graph-stable {graph_us:.2f} us {graph_plan.strategy}/{graph_plan.num_splits}"
               if graph_us else ""))
        del data
        free_cached_blocks()

    probe_end = read_bandwidth_survey()
    if max(probe_end.values()) > read_gbps:
        read_gbps = max(probe_end.values())
        for row in rows:
            row["frac_read_bw"] = round(row["gbps"] / read_gbps, 4)
    log(f"streaming read after the cases: {max(probe_end.values()):,.0f} GB/s "
        f"(best of {probe_end}); floor {read_gbps:,.0f} GB/s")

    # the plan-cost batch: a ragged batch of 256 requests, planned with the profile used above
    plan_us_b256 = _plan_cpu_us(DecodeProblem(ragged_b256_lengths(), 32, 8, 128, 16, dtype),
                                w.profile) if cases else None
    # and the whole plan() of it, by an ordinary and a graph-stable wrapper (a decode loop's
    # host work per step)
    wrapper_plan_us_b256 = {}
    if cases:
        lens = ragged_b256_lengths()
        table, _ = scattered_page_table(lens, 16, np.random.default_rng(seed), extra_pages=0)
        for name, options in (("plain", {}), ("graph_stable", dict(
                use_cuda_graph=True, max_batch_size=lens.size,
                max_num_pages=table.kv_indices.size))):
            wrapper_plan_us_b256[name] = round(_wrapper_plan_cpu_us(
                BatchDecodeWrapper(32, 8, 128, 16, dtype, **options), table), 1)
    return {"device": info["name"], "date": _dt.date.today().isoformat(),
            "command": command,
            "flashinfer_version": flashinfer_version if flashinfer else None,
            "dtype": dtype, "kv_dtype": kv_dtype, "read_gbps": round(read_gbps, 1),
            "read_probe_gbps": {"before": probe_start, "after": probe_end},
            "first_call_compile_s": None if compile_s is None else round(compile_s, 3),
            "plan_cpu_us_ragged_b32": None if plan_us_ragged is None else round(plan_us_ragged, 1),
            "plan_cpu_us_ragged_b256": None if plan_us_b256 is None else round(plan_us_b256, 1),
            "wrapper_plan_cpu_us_ragged_b32": (None if wrapper_plan_us_ragged is None
                                               else round(wrapper_plan_us_ragged, 1)),
            "wrapper_plan_cpu_us_ragged_b256": wrapper_plan_us_b256,
            "cases": rows}


def markdown_table(result: dict) -> str:
    """``run_cases``' result as a markdown table, a row per case with its verdicts against the
    peers and the latency targets, under a line on the read floor and the planner's CPU time."""
    kv = result.get("kv_dtype")
    lines = [(f"K/V: {kv} (GB/s and % of the floor count its one-byte codes; peers: FlashInfer "
              f"0.7.2's fp8 paths as measured on the H200, cases.FP8_BEST_PEER_US). " if kv else "")
             + f"read floor: {result['read_gbps']:,.0f} GB/s (the fastest streaming read of "
             f"{len(PROBE_SHAPES)} launch shapes, probed before and after the cases); first-call compile "
             f"{result['first_call_compile_s']} s; planner (choose_plan) CPU time: ragged_b32 "
             f"{result['plan_cpu_us_ragged_b32']} us, 256 ragged requests "
             f"{result.get('plan_cpu_us_ragged_b256')} us; the whole wrapper.plan() for ragged_b32 "
             f"{result.get('wrapper_plan_cpu_us_ragged_b32')} us, for 256 ragged requests "
             f"{result.get('wrapper_plan_cpu_us_ragged_b256')} us", "",
             "| case | us | GB/s | % read bw | rel err | plan | best paged peer us | FlashInfer us, "
             "this run (xqa / tensor core / CUDA core) | SDPA (contig.) us "
             "| graph-stable us (plan, x) | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        target = LATENCY_TARGETS_US.get(r["case"])
        verdict = []
        if r["best_paged_peer_us"] is not None:
            verdict.append("<=peer" if r["us"] <= r["best_paged_peer_us"] else ">peer")
        live = {k: v for k, v in (r.get("flashinfer_us") or {}).items() if v is not None}
        if live:
            verdict.append("<=live peer" if r["us"] <= min(live.values()) else ">live peer")
        fi = r.get("flashinfer_us")
        fi = " / ".join("n/a" if fi.get(k) is None else f"{fi[k]:.2f}"
                        for k in ("xqa", "tensor_core", "cuda_core")) if fi else "not run"
        if target is not None:
            verdict.append(f"{'ok' if r['us'] <= target else 'miss'} {target}us")
        if r["peer_us"] is not None:
            verdict.append("<=1.05 sdpa" if r["us"] <= 1.05 * r["peer_us"] else ">1.05 sdpa")
        graph = r.get("graph_stable_us")
        graph = (f"{graph:.2f} ({r['graph_stable_plan']}, {graph / r['us']:.3f})"
                 if graph is not None else "n/a")
        err = f"{r['rel_err']:.1e}"
        if r.get("data_non_finite_after"):
            err += f" (data not finite after {r['data_non_finite_after']})"
        lines.append(f"| {r['case']} | {r['us']:.2f} | {r['gbps']:.0f} | {100 * r['frac_read_bw']:.1f} | "
                     f"{err} | {r['strategy']}/{r['num_splits']} | "
                     f"{r['best_paged_peer_us']} | {fi} | {r['peer_us']} | {graph} | "
                     f"{', '.join(verdict)} |")
    return "\n".join(lines)
