"""``splitkv calibrate --plot``: predicted vs measured, and the plans the fitted model picks
across batch sizes and lengths. Needs matplotlib; says so when it is missing."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MAP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAP_LENGTHS = (64, 256, 1024, 4096, 16384, 32768, 131072)


def write_plots(folder, stem: str, measurements, profile, report) -> list[str]:
    """Write ``<stem>-predicted-vs-measured.png`` and ``<stem>-decisions.png`` into
    ``folder``; return one line per file written (or why none was)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["--plot: matplotlib is not installed, so no plots were written "
                "(pip install matplotlib, then run again)"]
    folder = Path(folder)
    model = profile.cost_model()
    lines = []

    fig, ax = plt.subplots(figsize=(6.5, 6))
    measured = np.array([m.measured_us for m in measurements])
    predicted = model.predict([m.plan for m in measurements])
    heldout = set(report.heldout_shapes)
    held = np.array([m.shape in heldout for m in measurements])
    strategy = np.array([m.plan.strategy for m in measurements])
    for name, color in (("single", "tab:blue"), ("split_merge", "tab:orange"),
                        ("fused", "tab:green")):
        for mask, marker, label in ((~held, "o", "fitted"), (held, "x", "held out")):
            sel = (strategy == name) & mask
            if sel.any():
                ax.scatter(measured[sel], predicted[sel], s=12, c=color, marker=marker,
                           label=f"{name}, {label}")
    lo, hi = measured.min() * 0.8, measured.max() * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured us", ylabel="predicted us",
           title=f"{profile.device_name}: fit error {profile.fit_error:.1%}")
    ax.legend(fontsize=7)
    path = folder / f"{stem}-predicted-vs-measured.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    lines.append(f"wrote {path}")

    from ..planner import choose_plan
    from ..core.problem import DecodeProblem

    splits = np.zeros((len(MAP_BATCHES), len(MAP_LENGTHS)))
    fig, ax = plt.subplots(figsize=(8, 6))
    for i, b in enumerate(MAP_BATCHES):
        for j, n in enumerate(MAP_LENGTHS):
            plan = choose_plan(DecodeProblem(np.full(b, n), 32, 8, 128, 16), profile)
            splits[i, j] = plan.num_splits
            tag = {"single": "", "split_merge": "M", "fused": "F"}[plan.strategy]
            ax.text(j, i, f"{plan.num_splits}{tag}", ha="center", va="center", fontsize=8)
    ax.imshow(np.log2(splits), cmap="viridis", alpha=0.6, aspect="auto")
    ax.set_xticks(range(len(MAP_LENGTHS)), [str(n) for n in MAP_LENGTHS])
    ax.set_yticks(range(len(MAP_BATCHES)), [str(b) for b in MAP_BATCHES])
    ax.set(xlabel="tokens per request", ylabel="batch size",
           title=f"{profile.device_name}, 32/8 heads, head_dim 128: splits chosen "
                 "(M split_merge, F fused)")
    path = folder / f"{stem}-decisions.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    lines.append(f"wrote {path}")
    return lines
