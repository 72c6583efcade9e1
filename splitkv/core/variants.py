"""Attention variants of today's models, as the host paths compute them (the GPU kernels run
the window, the soft cap, the sinks and multi-token decode too),
with the names FlashInfer and vLLM users know:

- ``window_left`` (sliding window, Mistral / Gemma / gpt-oss): a query at position p sees KV
  positions p - window_left .. p; -1 (the default): no window.
- ``attention_chunk_size`` (chunked local attention, Llama 4): a query at position p sees only
  the keys of its own chunk, positions (p // C) * C .. p; 0 (the default): none. With a
  window too, the later of the two starts. One query row a request (multi-token rows across a
  chunk boundary would need a start a row, which the kernels do not hold).
- ``logits_soft_cap`` (Gemma-2): each score s = sm_scale * q.k becomes cap * tanh(s / cap)
  before the softmax; None or 0: no cap.
- ``alibi_slopes`` (ALiBi, Press et al.: BLOOM, MPT; vLLM's ``alibi_slopes``): one slope
  m_h per query head; a query at position p adds m_h * (j - p) to its scaled score of key j
  (natural-log units), before the soft cap. None: no bias. ``alibi_slopes(num_heads)`` gives
  the paper's slopes.
- ``sinks`` (gpt-oss): one logit per query head (natural-log units, like the scaled scores)
  that joins the softmax denominator and contributes no value: o = sum_i exp(s_i) v_i /
  (sum_i exp(s_i) + exp(sink)). The returned LSE includes the sink (log of that denominator),
  so o = sum_i exp(s_i - lse) v_i; a state with a sink does not merge with another
  (``merge_states`` would count the sink twice).
- multi-token decode (``qo_indptr``, FlashInfer's name): request b has q_len_b = qo_indptr[b+1]
  - qo_indptr[b] query rows (1 to ``MAX_Q_LEN``), the last q_len_b positions of its KV, causal
  among themselves: row j sees positions up to kv_len - q_len_b + j. q is then [qo_indptr[-1],
  num_qo_heads, head_dim]. A request with no KV has one query row (its output is zeros, or
  only its sink). With a window, each row sees its own (position - window_left .. position);
  a plan then covers every row's window (``covering_window_left``) and masks per row.

The non-finite rule of the plain path holds: a NaN or Inf in q or K (a non-finite raw score,
before the cap) makes that row and head NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from . import validation as V
from .merge import merge_states

MAX_Q_LEN = 16


@dataclass(frozen=True, eq=False)
class Variant:
    """The variant options of one call, checked (``check_variant``)."""

    window_left: int = -1
    logits_soft_cap: float | None = None
    sinks: np.ndarray | None = None           # [num_qo_heads] float64
    attention_chunk_size: int = 0
    alibi_slopes: np.ndarray | None = None    # [num_qo_heads] float64

    @property
    def plain(self) -> bool:
        return (self.window_left < 0 and self.logits_soft_cap is None and self.sinks is None
                and not self.attention_chunk_size and self.alibi_slopes is None)


@dataclass(frozen=True)
class KernelVariant:
    """The hooks a build of the decode kernel compiles in for a call's variant: one flag a
    hook, a field of every ``core.builds.Build``. Their values (the cap, phi, the rows) are the
    kernels' arguments, written at plan time. Each flag reaches decode.cu as the define of its
    name upper-cased (decode_build.cuh turns it into a ``Build`` constant) and names the build
    with its tag; a new hook is a field here, its tag, and its ``if constexpr`` in decode.cu."""

    soft_cap: bool = False      # s -> cap * tanh(s / cap) on the scaled scores
    multi_token: bool = False   # MMA rows of (query row, head), each row masked causally
    unified_max: bool = False   # scores offset by a fixed phi, with the running max's fallback
    alibi: bool = False         # s + m_h * (j - p) before the max (per-head slopes)

    TAGS: ClassVar[dict[str, str]] = {"soft_cap": "softcap", "multi_token": "mt",
                                      "unified_max": "umax", "alibi": "alibi"}

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{f.name}: expected True or False, got {value!r}")
            object.__setattr__(self, f.name, bool(value))

    @property
    def defines(self) -> dict[str, int]:
        """The -D macros of the hooks, in declaration order."""
        return {f.name.upper(): int(getattr(self, f.name)) for f in fields(self)}

    @property
    def tags(self) -> str:
        """The build name's part: ``_<tag>`` for each hook compiled in."""
        return "".join(f"_{self.TAGS[f.name]}" for f in fields(self) if getattr(self, f.name))


PLAIN = KernelVariant()


def check_chunk_size(attention_chunk_size) -> int:
    """``attention_chunk_size`` checked: 0 or None (no chunks), else the tokens a chunk."""
    if attention_chunk_size is None:
        return 0
    return V.check_int("attention_chunk_size", attention_chunk_size, 0, V.MAX_KV_LEN,
                       "MAX_KV_LEN")


def per_head_values(name: str, values, num_qo_heads: int) -> np.ndarray:
    """``values`` (host or CuPy) as float64 [num_qo_heads], or an error naming ``name``."""
    if hasattr(values, "get"):
        values = values.get()
    given = np.asarray(values)
    if given.dtype.kind not in "iuf":        # no bools, complex, strings or objects
        raise TypeError(f"{name}: expected {num_qo_heads} numbers (one per query head), got "
                        f"{type(values).__name__} of {given.dtype}")
    out = given.astype(np.float64)
    if out.shape != (num_qo_heads,):
        raise ValueError(f"{name}: expected shape [{num_qo_heads}] (one per query head), got "
                         f"{list(out.shape)}")
    return out


def check_alibi_slopes(num_qo_heads: int, alibi_slopes) -> np.ndarray | None:
    """ALiBi's slopes checked: None, or [num_qo_heads] finite numbers."""
    if alibi_slopes is None:
        return None
    slopes = per_head_values("alibi_slopes", alibi_slopes, num_qo_heads)
    if not np.all(np.isfinite(slopes)):
        raise ValueError("alibi_slopes: expected finite values (0: no bias for that head)")
    return slopes


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes for ``num_heads`` heads: for n = 2**k heads, 2**(-8 i / n) for
    head i = 1..n; otherwise those of the largest power of two below, then every other slope
    of twice that many."""
    num_heads = V.check_int("num_heads", num_heads, 1, V.MAX_HEADS, "MAX_HEADS")
    n = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / n)
    slopes = [base ** i for i in range(1, n + 1)]
    if n < num_heads:
        extra = 2.0 ** (-4.0 / n)
        slopes += [extra ** i for i in range(1, 2 * (num_heads - n), 2)]
    return np.array(slopes, dtype=np.float64)


def alibi_bias(slopes: np.ndarray | None, positions, query_position: int):
    """[heads, keys] bias m_h * (j - p) of keys at ``positions`` for a query at p; None: 0."""
    if slopes is None:
        return None
    return slopes[:, None] * (np.asarray(positions, np.float64)[None, :] - query_position)


def check_variant(num_qo_heads: int, window_left=-1, logits_soft_cap=None, sinks=None, *,
                  attention_chunk_size=0, alibi_slopes=None) -> Variant:
    window_left = V.check_int("window_left", window_left, -1, V.MAX_KV_LEN, "MAX_KV_LEN")
    chunk = check_chunk_size(attention_chunk_size)
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap,
                                                                  (int, float, np.number)):
            raise TypeError(f"logits_soft_cap: expected a number or None, got "
                            f"{type(logits_soft_cap).__name__}")
        cap = float(logits_soft_cap)
        if not np.isfinite(cap) or cap < 0:
            raise ValueError(f"logits_soft_cap: expected a finite value >= 0 (0: no cap), got "
                             f"{logits_soft_cap!r}")
        logits_soft_cap = cap if cap > 0 else None
    if sinks is not None:
        values = per_head_values("sinks", sinks, num_qo_heads)
        if np.any(np.isnan(values)) or np.any(values == np.inf):
            raise ValueError("sinks: expected values that are not NaN or +inf (-inf: no sink "
                             "for that head)")
        sinks = values
    return Variant(window_left, logits_soft_cap, sinks, chunk,
                   check_alibi_slopes(num_qo_heads, alibi_slopes))


def refuse_chunks_with_rows(attention_chunk_size: int, max_q_len: int) -> None:
    """Chunked attention takes one query row a request: the plans and kernels hold one start a
    request (a window's moves with each row, a chunk's does not)."""
    if attention_chunk_size and max_q_len > 1:
        raise ValueError(f"attention_chunk_size: {attention_chunk_size} with {max_q_len} query "
                         "rows a request (qo_indptr / max_q_len); chunked attention takes one "
                         "query row a request")


@dataclass(frozen=True)
class QueryRows:
    """Each request's query rows: its first row in q and their count."""

    first: np.ndarray       # [batch] int64
    count: np.ndarray       # [batch] int64
    num_rows: int

    @property
    def max_q_len(self) -> int:
        return int(self.count.max(initial=1))

    def position(self, b: int, j: int, kv_len: int) -> int:
        """KV position of request b's query row j (the last rows of its KV)."""
        return kv_len - int(self.count[b]) + j


def query_rows(qo_indptr, kv_lens: np.ndarray) -> QueryRows:
    """The rows of ``qo_indptr`` checked against the requests' lengths; None: one row each."""
    batch = kv_lens.size
    if qo_indptr is None:
        ones = np.ones(batch, np.int64)
        return QueryRows(np.arange(batch, dtype=np.int64), ones, batch)
    indptr = V.host_int_array("qo_indptr", qo_indptr, 1)
    if indptr.size != batch + 1:
        raise ValueError(f"qo_indptr: expected {batch + 1} elements (batch_size + 1), got "
                         f"{indptr.size}")
    if indptr[0] != 0:
        raise ValueError(f"qo_indptr: expected qo_indptr[0] == 0, got {indptr[0]}")
    counts = np.diff(indptr)
    bad = np.flatnonzero((counts < 1) | (counts > MAX_Q_LEN))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"qo_indptr: request {b} has {counts[b]} query rows; expected 1 to "
                         f"MAX_Q_LEN={MAX_Q_LEN}")
    past = np.flatnonzero(counts > np.maximum(kv_lens, 1))
    if past.size:
        b = int(past[0])
        raise ValueError(f"qo_indptr: request {b} has {counts[b]} query rows but {kv_lens[b]} "
                         f"KV tokens; its new tokens are the last q_len of its KV")
    return QueryRows(indptr[:-1].astype(np.int64), counts.astype(np.int64), int(indptr[-1]))


def plan_query_rows(qo_indptr, kv_lens: np.ndarray, *, max_q_len: int, graph_stable: bool,
                    given_plan: bool) -> QueryRows | None:
    """A wrapper's ``plan(qo_indptr=)`` checked: the QueryRows the multi-token build reads, or
    None where the plain build runs (one query row a request, and not a graph-stable wrapper
    made for more). ``max_q_len``: a graph-stable wrapper's rows a request (its captured launch
    holds them), else 1; ``given_plan``: plan() was given a plan (the planner sizes a
    multi-token plan's rows itself)."""
    if qo_indptr is None and max_q_len == 1:
        return None
    rows = query_rows(qo_indptr, kv_lens)
    if graph_stable and rows.max_q_len > max_q_len:
        b = int(np.argmax(rows.count))
        raise ValueError(f"qo_indptr: request {b} has {rows.count[b]} query rows; this "
                         f"graph-stable wrapper's captured launch holds max_q_len={max_q_len} "
                         "(BatchDecodeWrapper(..., max_q_len=))")
    if max(max_q_len, rows.max_q_len) == 1:
        return None
    if given_plan and max_q_len > 1:
        raise ValueError("plan: a wrapper made with max_q_len > 1 plans its own rows (its "
                         "plans count max_q_len x num_qo_heads query heads); pass "
                         "num_splits / strategy instead")
    if given_plan:
        raise ValueError("qo_indptr: pass num_splits / strategy rather than a plan; the "
                         "planner sizes a multi-token plan's rows itself")
    return rows


def covering_window_left(window_left: int, max_q_len: int) -> int:
    """The window a plan must cover so that each of up to ``max_q_len`` query rows finds its
    own window in the plan's chunks: the last row's window_left + 1 tokens and the rows before
    it (-1: no window); at most ``MAX_KV_LEN``, a window that covers any request whole."""
    return -1 if window_left < 0 else min(window_left + max_q_len - 1, V.MAX_KV_LEN)


def visible(position: int, kv_len: int, window_left: int,
            attention_chunk_size: int = 0) -> tuple[int, int]:
    """The KV positions a query at ``position`` sees: [lo, hi)."""
    hi = min(position + 1, kv_len)
    lo = 0 if window_left < 0 else max(0, position - window_left)
    if attention_chunk_size and position >= 0:
        lo = max(lo, position // attention_chunk_size * attention_chunk_size)
    return lo, max(lo, hi)


def read_begin(kv_lens: np.ndarray, window_left: int, attention_chunk_size: int):
    """[batch] the first token each request's last position sees (its window's or its
    chunk's, the later), or None where every request reads all its tokens."""
    if window_left < 0 and not attention_chunk_size:
        return None
    last = np.maximum(kv_lens - 1, 0)
    begin = np.zeros_like(kv_lens) if window_left < 0 else np.maximum(last - window_left, 0)
    if attention_chunk_size:
        begin = np.maximum(begin, last // attention_chunk_size * attention_chunk_size)
    return begin


def cap_scores(s: np.ndarray, cap: float | None) -> np.ndarray:
    return s if cap is None else cap * np.tanh(s / cap)


def add_sinks(o: np.ndarray, lse: np.ndarray, sinks: np.ndarray | None):
    """The state (o [..., heads, dim], lse [..., heads]) with each head's sink joined to its
    denominator (a state of no value and LSE = the sink)."""
    if sinks is None:
        return o, lse
    sink_lse = np.broadcast_to(sinks, lse.shape).astype(np.float64)
    return merge_states(o, lse, np.zeros_like(o), sink_lse)
