"""The statistics of a decomposition (a cut of every request's KV into chunks) that the cost
model's features are made of, computed three ways that give the same bits:

  decomposition_stats     from a built plan's chunks (``CostModel.features``);
  ragged_candidate_stats  for many candidate cuts of one batch at once, in closed form from
                          the requests' lengths ([candidates x requests] arrays, never a
                          per-chunk one): the planner, on every decode step;
  equal_candidate_stats   the same when every request has the same length, in plain Python.

A candidate cut (a row) is a chunk size c: request b gets k_b = ceil(max(len_b, 1) / c)
chunks, capped at a split count for the split rows (c = one tile); boundaries are aligned to
the 64-token tile, or to c itself for chunks under a tile (``plan.plan_from_chunk_counts``).
Every number is an integer far below 2**53, so any exact float formula gives the same bits as
the per-chunk one.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from ..core.geometry import TILE_TOKENS


# The numbers of a decomposition the features need, rows of a ``stats`` array in this order.
# ``max_splits`` is the most chunks any request has; ``split_chunks`` counts the chunks of
# requests cut into more than one; ``odd_chunks`` the chunks of an odd number of tiles (what a
# build of 128-token tiles runs one more half tile for: ``features.count_build_tiles``),
# computed only where asked for (else 0), since only fp8 fits count those tiles.
STAT_NAMES = ("num_chunks", "total_tokens", "total_tiles", "max_chunk_tokens",
              "max_chunk_tiles", "max_splits", "split_chunks", "odd_chunks")


def rows_of(names, *wanted) -> slice:
    """The rows ``wanted`` of a table in ``names`` order, as one slice, so that one NumPy call
    reads or fills them all; they must be neighbours there, in this order."""
    start = names.index(wanted[0])
    if tuple(names[start:start + len(wanted)]) != wanted:
        raise ValueError(f"rows {wanted} are not neighbours in {names}")
    return slice(start, start + len(wanted))


def indices(names, *wanted) -> tuple[int, ...]:
    """The rows ``wanted`` of a table in ``names`` order, as plain ints (as cheap to index with
    as a literal on the planner's hot path)."""
    return tuple(names.index(name) for name in wanted)


(S_NUM_CHUNKS, S_TOTAL_TOKENS, S_TOTAL_TILES, S_MAX_CHUNK_TOKENS, S_MAX_CHUNK_TILES,
 S_MAX_SPLITS, S_SPLIT_CHUNKS, S_ODD_CHUNKS) = indices(STAT_NAMES, *STAT_NAMES)
# Rows that one NumPy call reads or fills together: the maxima over the requests
# (``ragged_candidate_stats`` takes them in one reduction); the counts and the largest chunk's
# tokens and tiles, which ``features.row_features`` turns into work items and critical paths.
S_MAXIMA = rows_of(STAT_NAMES, "max_chunk_tokens", "max_chunk_tiles", "max_splits")
S_COUNTS = rows_of(STAT_NAMES, "num_chunks", "total_tokens", "total_tiles")
S_LARGEST = rows_of(STAT_NAMES, "max_chunk_tokens", "max_chunk_tiles")

# 0-d arrays rather than Python numbers: NumPy converts a Python number on every call.
ONE, TWO = np.array(1.0), np.array(2.0)
_TILE_TOKENS = np.array(float(TILE_TOKENS))


def decomposition_stats(chunk_tokens, chunks_per_request) -> np.ndarray:
    """``STAT_NAMES`` of a built plan, exactly, from its per-chunk token counts and its chunks
    per request."""
    tok = np.asarray(chunk_tokens, dtype=np.int64)
    cpr = np.asarray(chunks_per_request, dtype=np.int64)
    stats = np.zeros(len(STAT_NAMES))
    if tok.size == 0:
        return stats
    tiles = -(-tok // TILE_TOKENS)
    stats[S_NUM_CHUNKS] = tok.size
    stats[S_TOTAL_TOKENS] = tok.sum()
    stats[S_TOTAL_TILES] = tiles.sum()
    stats[S_MAX_CHUNK_TOKENS] = tok.max()
    stats[S_MAX_CHUNK_TILES] = tiles.max()
    stats[S_MAX_SPLITS] = cpr.max()
    stats[S_SPLIT_CHUNKS] = cpr[cpr > 1].sum()
    stats[S_ODD_CHUNKS] = np.count_nonzero(tiles & 1)
    return stats


@functools.lru_cache(maxsize=64)
def ones(n: int) -> np.ndarray:
    """[n] ones, read-only: a dot product with them sums rows (cheaper than a reduction)."""
    array = np.ones(n)
    array.setflags(write=False)
    return array


def ragged_candidate_stats(out, lens: np.ndarray, min_len: int, max_len: int, total: int,
                           divisors: np.ndarray, splits: slice, split_caps: np.ndarray,
                           num_tiny: int, odd_chunks: bool = False
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Fill ``out`` [len(STAT_NAMES), rows] with the statistics of every candidate row in
    closed form from the lengths; return what the winning row's plan is built from: the chunk
    counts k [rows, requests] and the tiles of each request [requests].

    ``lens`` (float) holds the requests' lengths, ``min_len``, ``max_len`` and ``total`` their
    minimum, maximum and sum. ``divisors`` [rows + 1, 1]: each row's chunk size, then the tile;
    2**60 for no split (one chunk each); 64 for a split row ``splits``, whose k is then capped
    at its split count ``split_caps`` [splits, 1] (fewer for a request of fewer tiles). An
    empty request is one empty chunk. The last ``num_tiny`` rows are chunk sizes under a tile
    (16 or 32 tokens, aligned to themselves: every chunk is one partial tile).

    The largest chunk. A request of len tokens has u = ceil(len / 64) tiles; cut into k chunks
    on tile boundaries floor(j u / k), its chunks hold m - 1 or m tiles (m = ceil(u / k)), the
    last one m, and only the last is short of whole tiles. So the largest chunk has m tiles,
    and min(64 m, len - 64 (k - 1)(m - 1)) tokens: 64 m unless the last chunk is the only one
    of m tiles. Worked example, 1000 tokens (u = 16, the last tile 40 tokens):
      k = 3: m = 6, chunks of 5, 5, 6 tiles = 320, 320, 360 tokens;
             1000 - 64 x 2 x 5 = 360 < 64 x 6: the largest is the last, 360 tokens.
      k = 4: m = 4, chunks of 4 tiles = 256, 256, 256, 232 tokens;
             1000 - 64 x 3 x 3 = 424 > 64 x 4: the largest is a whole one, 256 tokens.

    The odd chunks (``odd_chunks``, else that row is 0). Of the k chunks, r = u - k q hold
    q + 1 tiles and k - r hold q (q = floor(u / k)): r are odd when q is even, k - r when q is
    odd, that is r + (q mod 2)(k - 2 r). For 1000 tokens, k = 3: q = 5, r = 1, so 2 odd chunks
    (the two of 5 tiles).

    This runs on every decode step, and at these sizes each NumPy call costs more than the
    arithmetic (a reduction or a sort several times more than an element-wise call), so the
    formulas are picked for few, cheap calls: one division and one ceiling give the chunk
    counts and the tiles, one dot product sums the chunks, the tiles and min(k, 2), and one
    reduction gives the maxima over the requests.
    """
    n = lens.size
    rows = divisors.shape[0] - 1
    lens1 = lens if min_len else np.maximum(lens, 1.0)
    quotients = lens1 / divisors                         # [len / chunk per row; len / 64]
    # One buffer for the [rows, requests] arrays (blocks of rows), so that those that take the
    # same operation take one call: m - 1, k - 1 (then the largest chunk), m, k, the whole
    # tiles of each request (one row), min(k, 2).
    work = np.empty((5 * rows + 1, n))
    m, k = work[2 * rows:3 * rows], work[3 * rows:4 * rows]
    units = work[4 * rows]
    np.ceil(quotients, work[3 * rows:4 * rows + 1])      # k, units
    tiles = quotients[rows]                              # exact: 1/64 is a power of two
    if not min_len:                                      # an empty request has no tile
        tiles = lens * (1.0 / TILE_TOKENS)
        np.ceil(tiles, units)
    if split_caps.size:
        capped = k[splits]
        np.minimum(capped, split_caps, out=capped)
    np.minimum(k, TWO, out=work[4 * rows + 1:])
    sums = work[3 * rows:].dot(ones(n))                  # chunks, tiles, sum of min(k, 2)
    out[S_NUM_CHUNKS] = sums[:rows]
    # chunks of split requests = all chunks - requests in one chunk
    #                           = chunks + (requests + split requests) - 2 requests
    split_chunks = out[S_SPLIT_CHUNKS]
    np.add(sums[:rows], sums[rows + 1:], split_chunks)
    split_chunks -= 2.0 * n
    out[S_TOTAL_TOKENS] = total
    out[S_TOTAL_TILES] = sums[rows]
    # the largest chunk in tiles, min(m, len / 64 - (k - 1)(m - 1))
    np.divide(units, k, m)
    np.ceil(m, m)
    np.subtract(work[2 * rows:4 * rows], ONE, work[:2 * rows])       # m - 1, k - 1
    largest = work[rows:2 * rows]
    largest *= work[:rows]
    np.subtract(tiles, largest, largest)
    np.minimum(largest, m, out=largest)
    # the maxima of the largest chunk, m and k (in S_MAXIMA order); then tiles -> tokens
    np.maximum.reduce(work[rows:4 * rows], axis=1, out=out[S_MAXIMA].reshape(3 * rows))
    np.multiply(out[S_MAX_CHUNK_TOKENS], _TILE_TOKENS, out[S_MAX_CHUNK_TOKENS])
    if odd_chunks:
        # q = floor(u / k), r = u - k q (exact: integers in floats); k - r chunks hold q
        # tiles, r hold q + 1, so r + (q mod 2)(k - 2 r) are odd. Plain ufuncs only: a
        # float np.mod or np.divmod costs several times a division here.
        q, r, odd = work[:rows], work[rows:2 * rows], work[2 * rows:3 * rows]   # m is done
        np.divide(units, k, q)
        np.floor(q, q)
        np.multiply(q, k, r)
        np.subtract(units, r, r)
        np.multiply(q, 0.5, odd)                         # q mod 2 = q - 2 floor(q / 2)
        np.floor(odd, odd)
        odd *= -2.0
        q += odd
        np.multiply(r, -2.0, odd)
        odd += k
        odd *= q
        odd += r
        out[S_ODD_CHUNKS] = odd.dot(ones(n))
    else:
        out[S_ODD_CHUNKS] = 0.0
    if num_tiny:
        # Every tiny chunk is one tile (a partial one); an empty request has no tile.
        tiny = slice(rows - num_tiny, rows)
        out[S_TOTAL_TILES, tiny] = out[S_NUM_CHUNKS, tiny] - (n - np.count_nonzero(lens))
        out[S_MAX_CHUNK_TOKENS, tiny] = np.minimum(divisors[tiny, 0], max_len)
        out[S_MAX_CHUNK_TILES, tiny] = 1.0 if max_len else 0.0
        if odd_chunks:
            out[S_ODD_CHUNKS, tiny] = out[S_TOTAL_TILES, tiny]
    return k, units


def equal_candidate_stats(out, length: int, copies: int, total: int, chunk: list,
                          splits: slice, split_caps, num_tiny: int,
                          odd_chunks: bool = False) -> list:
    """``ragged_candidate_stats`` when every request has the same length (``copies`` of them),
    with the chunk sizes ``chunk`` (``divisors`` without the tile): each row is a few integers,
    cheaper in plain Python than in NumPy calls. The same formulas, exact (Python integers,
    and floats only where ``ragged_candidate_stats`` has them). Returns each row's chunk count
    as [[k], ...]."""
    length1 = max(length, 1)
    units = -(-length // TILE_TOKENS)
    tiles = length / TILE_TOKENS
    caps = [None] * splits.start + [int(s) for s in split_caps.ravel().tolist()]
    caps += [None] * (len(chunk) - len(caps))
    st = [[] for _ in STAT_NAMES]
    num_chunks, max_tokens = st[S_NUM_CHUNKS], st[S_MAX_CHUNK_TOKENS]
    max_tiles, max_splits = st[S_MAX_CHUNK_TILES], st[S_MAX_SPLITS]
    split_chunks, odd = st[S_SPLIT_CHUNKS], st[S_ODD_CHUNKS]
    for c, cap in zip(chunk, caps):
        k = -(-length1 // int(c))
        if cap is not None and k > cap:
            k = cap
        m = -(-units // k)
        largest = tiles - (k - 1) * (m - 1)
        num_chunks.append(k * copies)
        max_tokens.append((largest if largest < m else m) * TILE_TOKENS)
        max_tiles.append(m)
        split_chunks.append(k * copies if k > 1 else 0)
        max_splits.append(k)
        if odd_chunks:
            q, r = divmod(units, k)
            odd.append((r + (q & 1) * (k - 2 * r)) * copies)
        else:
            odd.append(0)
    st[S_TOTAL_TOKENS] = [total] * len(chunk)
    total_tiles = st[S_TOTAL_TILES] = [units * copies] * len(chunk)
    for j in range(len(chunk) - num_tiny, len(chunk)):
        # Every tiny chunk is one tile (a partial one); an empty request has no tile.
        total_tiles[j] = num_chunks[j] - (copies if length == 0 else 0)
        max_tokens[j] = min(chunk[j], length)
        max_tiles[j] = 1 if length else 0
        if odd_chunks:
            odd[j] = total_tiles[j]
    # one pass through the numbers (setting ``out`` from the nested lists costs twice that)
    out[:] = np.fromiter(itertools.chain.from_iterable(st), np.float64,
                         len(STAT_NAMES) * len(chunk)).reshape(len(STAT_NAMES), len(chunk))
    return [[k] for k in max_splits]
