"""reference_decode against attention written out the slow, obvious way."""

import numpy as np
import pytest
from scipy.special import logsumexp, softmax

from splitkv import PageTable, reference_decode
from splitkv.testing import block_table_of, scattered_block_table


def dense_attention(q, k_cache, v_cache, block_table, kv_lens, sm_scale=None):
    """Brute force: gather each request's pages into one dense K and V, softmax with np.exp."""
    batch, hq, d = q.shape
    page_size, hk = k_cache.shape[1], k_cache.shape[2]
    sm_scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    out, lse = np.zeros((batch, hq, d)), np.full((batch, hq), -np.inf)
    for b in range(batch):
        n = int(kv_lens[b])
        pages = block_table[b][: -(-n // page_size)]
        k = np.concatenate([k_cache[p] for p in pages] or [np.zeros((0, hk, d))])[:n]
        v = np.concatenate([v_cache[p] for p in pages] or [np.zeros((0, hk, d))])[:n]
        for h in range(hq):
            kv_head = h // (hq // hk)
            if n == 0:
                continue
            e = np.exp(sm_scale * (k[:, kv_head] @ q[b, h]))
            out[b, h] = (e / e.sum()) @ v[:, kv_head]
            lse[b, h] = np.log(e.sum())
    return out, lse


@pytest.mark.parametrize("hq, hk", [(8, 8), (8, 2), (10, 2), (16, 2)])   # groups 1, 4, 5, 8
def test_matches_dense_softmax(rng, hq, hk):
    kv_lens = np.array([1, 15, 16, 17, 100, 0, 33])
    page_size, d = 16, 64
    table, num_pages = scattered_block_table(kv_lens, page_size, rng, 2)
    q = rng.standard_normal((kv_lens.size, hq, d))
    k = rng.standard_normal((num_pages, page_size, hk, d))
    v = rng.standard_normal((num_pages, page_size, hk, d))
    pt = PageTable.from_block_table(table, kv_lens, page_size, num_pages=num_pages)
    out, lse = reference_decode(q, k, v, pt)
    want_out, want_lse = dense_attention(q, k, v, table, kv_lens)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert out.dtype == lse.dtype == np.float64
    assert out.shape == (kv_lens.size, hq, d) and lse.shape == (kv_lens.size, hq)


def test_explicit_sm_scale(rng):
    kv_lens = np.array([40, 7])
    table, num_pages = scattered_block_table(kv_lens, 8, rng, 2)
    q = rng.standard_normal((2, 4, 64))
    k = rng.standard_normal((num_pages, 8, 2, 64))
    v = rng.standard_normal((num_pages, 8, 2, 64))
    pt = PageTable.from_block_table(table, kv_lens, 8)
    out, lse = reference_decode(q, k, v, pt, sm_scale=0.05)
    want_out, want_lse = dense_attention(q, k, v, table, kv_lens, sm_scale=0.05)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_length_one_requests_return_their_value_row(make_batch):
    bt = make_batch([1, 1, 1], num_qo_heads=8, num_kv_heads=2)
    out, lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    k_flat = bt.k_cache.reshape(-1, 2, 64)
    v_flat = bt.v_cache.reshape(-1, 2, 64)
    for b in range(3):
        slot = bt.page_table.token_slots(b)[0]
        for h in range(8):
            np.testing.assert_allclose(out[b, h], v_flat[slot, h // 4], rtol=1e-14)
            np.testing.assert_allclose(lse[b, h], k_flat[slot, h // 4] @ bt.q[b, h] / 8, rtol=1e-12)


def test_zero_length_request_gives_zeros_and_minus_inf(make_batch):
    bt = make_batch([5, 0, 20])
    out, lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    assert np.all(np.isfinite(out[[0, 2]])) and np.all(np.isfinite(lse[[0, 2]]))


def test_empty_batch_gives_empty_outputs():
    pt = PageTable.from_flashinfer([0], [], [], 16)
    q = np.zeros((0, 8, 128))
    k = np.zeros((4, 16, 2, 128))
    out, lse = reference_decode(q, k, k, pt)
    assert out.shape == (0, 8, 128) and lse.shape == (0, 8)


@pytest.mark.parametrize("q_scale", [1e2, 1e4])
def test_huge_logits_stay_finite_and_exact(make_batch, q_scale):
    # |scores| reach ~1e4..1e6: a naive exp overflows, the reference must not.
    bt = make_batch([50, 3, 130], num_qo_heads=4, num_kv_heads=1, q_scale=q_scale)
    out, lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.abs(lse).max() > q_scale / 10
    k_flat, v_flat = bt.k_cache.reshape(-1, 64), bt.v_cache.reshape(-1, 64)
    for b in range(3):
        slots = bt.page_table.token_slots(b)
        s = (k_flat[slots] @ bt.q[b].T).T / 8          # [heads, tokens]
        np.testing.assert_allclose(lse[b], logsumexp(s, axis=1), rtol=1e-13)
        np.testing.assert_allclose(out[b], softmax(s, axis=1) @ v_flat[slots], rtol=1e-9, atol=1e-12)


def test_all_equal_scores_average_the_values(make_batch):
    bt = make_batch([37], num_qo_heads=2, num_kv_heads=1)
    q = np.zeros_like(bt.q)                             # every score is 0
    out, lse = reference_decode(q, bt.k_cache, bt.v_cache, bt.page_table)
    v = bt.v_cache.reshape(-1, 64)[bt.page_table.token_slots(0)]
    np.testing.assert_allclose(out[0], np.broadcast_to(v.mean(axis=0), (2, 64)), rtol=1e-12)
    np.testing.assert_allclose(lse[0], np.log(37), rtol=1e-14)


def test_one_dominant_token_takes_all_the_weight(make_batch):
    bt = make_batch([64], num_qo_heads=1, num_kv_heads=1)
    slots = bt.page_table.token_slots(0)
    k_flat = bt.k_cache.reshape(-1, 64)
    q = np.zeros_like(bt.q)
    q[0, 0, 0] = 1e5
    k_flat[slots, 0] = -1.0
    k_flat[slots[17], 0] = 1.0                          # score +1.25e4, the rest -1.25e4
    out, lse = reference_decode(q, bt.k_cache, bt.v_cache, bt.page_table)
    np.testing.assert_array_equal(out[0, 0], bt.v_cache.reshape(-1, 64)[slots[17]])
    assert lse[0, 0] == pytest.approx(1e5 / 8, rel=1e-15)


def test_low_precision_inputs_are_read_exactly(make_batch):
    bt = make_batch([30, 9])
    q16, k16, v16 = (x.astype(np.float16) for x in (bt.q, bt.k_cache, bt.v_cache))
    got = reference_decode(q16, k16, v16, bt.page_table)
    want = reference_decode(*(x.astype(np.float64) for x in (q16, k16, v16)), bt.page_table)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_raw_bfloat16_bits_in_uint16(make_batch):
    bt = make_batch([21])

    def to_bf16_bits(x):   # truncate float32 to its top 16 bits: an exact bfloat16 value
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def from_bits(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    q, k, v = (to_bf16_bits(x) for x in (bt.q, bt.k_cache, bt.v_cache))
    got = reference_decode(q, k, v, bt.page_table)
    want = reference_decode(from_bits(q), from_bits(k), from_bits(v), bt.page_table)
    np.testing.assert_array_equal(got[0], want[0])


def test_contiguous_cache(rng):
    lens = np.array([5, 12, 0])
    q = rng.standard_normal((3, 4, 64))
    k = rng.standard_normal((3, 12, 2, 64))        # [batch, max_len, kv_heads, head_dim]
    v = rng.standard_normal((3, 12, 2, 64))
    out, lse = reference_decode(q, k, v, PageTable.contiguous(lens, 12))
    table = np.arange(3)[:, None]
    want_out, want_lse = dense_attention(q, k, v, table, lens)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_block_table_of_gives_the_block_table_back(rng):
    kv_lens = np.array([1, 15, 16, 17, 100, 0, 33])
    table, num_pages = scattered_block_table(kv_lens, 16, rng, 2)
    pt = PageTable.from_block_table(table, kv_lens, 16, num_pages=num_pages)
    np.testing.assert_array_equal(block_table_of(pt), table.astype(np.int32))
    wide = block_table_of(pt, 9, pad=0)
    assert wide.shape == (7, 9) and (wide[:, table.shape[1]:] == 0).all()
