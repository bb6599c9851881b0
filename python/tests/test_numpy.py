"""The fa4 package on the CPU with numpy arrays: every function against a float64 evaluation
written here from the definition (docs/attention.md), sharing no code with fa4, and the errors
a user meets. Runs in CI (no GPU, no torch)."""

import math

import numpy as np
import pytest

import fa4


def reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """(out, lse) in float64 for (batch, sq, hq, d) inputs; rows with no key get out 0, lse -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(sq)[:, None] + (sk - sq)  # the bottom-right diagonal
    j = np.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    allowed = np.ones((sq, sk), bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe)
    l = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", np.where(l > 0, p / np.where(l > 0, l, 1), 0), vv)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l > 0, l, 1))[..., 0] + m_safe[..., 0], -np.inf)
    return out, lse


def reference_grad(q, k, v, dout, causal=False, scale=None):
    """(dq, dk, dv) in float64, from the softmax's derivative."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        i = np.arange(sq)[:, None] + (sk - sq)
        s = np.where(np.arange(sk)[None, :] <= i, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dvv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dkk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda x: x.reshape(b, sk, hk, g, -1).sum(3)
    return dq, fold(dkk), fold(dvv)


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def err(a, b):
    d = np.abs(np.asarray(a, np.float64) - b)
    return float(d.max()) if d.size else 0.0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 64, 4, 2, 80, 32), (1, 17, 8, 1, 1, 64), (3, 33, 6, 3, 19, 40)])
def test_forward_matches_float64(shape, causal):
    b, sq, hq, hk, sk, d = shape
    rng = np.random.default_rng(sum(shape) + causal)
    q, k, v = rand(rng, b, sq, hq, d), rand(rng, b, sk, hk, d), rand(rng, b, sk, hk, d)
    out, lse, none = fa4.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ro, rl = reference(q, k, v, causal=causal)
    assert none is None
    assert out.shape == (b, sq, hq, d) and out.dtype == np.float32
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32
    assert err(out, ro) < 2e-5
    finite = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse), finite)
    assert err(lse[finite], rl[finite]) < 2e-5


def test_window_softcap_scale_and_dv():
    rng = np.random.default_rng(1)
    q, k = rand(rng, 2, 48, 4, 32), rand(rng, 2, 64, 2, 32)
    v = rand(rng, 2, 64, 2, 16)  # head_dim_v != head_dim
    out = fa4.flash_attn_func(q, k, v, window_size=(8, 3), softcap=5.0, softmax_scale=0.3)
    ro, _ = reference(q, k, v, window=(8, 3), softcap=5.0, scale=0.3)
    assert out.shape == (2, 48, 4, 16)
    assert err(out, ro) < 2e-5


def test_fp16_within_twice_a_plain_fp16_evaluation():
    rng = np.random.default_rng(2)
    q, k, v = (rand(rng, 2, 128, 4, 64, dtype=np.float16) for _ in range(3))
    out = fa4.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == np.float16
    ro, _ = reference(q, k, v, causal=True)
    # A plain evaluation in fp16 storage, as FlashAttention's tests compare with.
    plain = reference(q, k, v, causal=True)[0].astype(np.float16)
    assert err(out, ro) <= 2 * err(plain, ro) + 1e-3


def test_varlen_matches_each_sequence_alone():
    rng = np.random.default_rng(3)
    lq, lk = [5, 0, 37, 64], [9, 4, 37, 70]
    cq, ck = np.cumsum([0] + lq).astype(np.int32), np.cumsum([0] + lk).astype(np.int32)
    q, k, v = rand(rng, cq[-1], 4, 32), rand(rng, ck[-1], 2, 32), rand(rng, ck[-1], 2, 32)
    out, lse, _ = fa4.flash_attn_varlen_func(
        q, k, v, cq, ck, max(lq), max(lk), causal=True, return_attn_probs=True
    )
    assert out.shape == (cq[-1], 4, 32) and lse.shape == (4, cq[-1])
    for i in range(len(lq)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ro, rl = reference(q[None, qs], k[None, ks], v[None, ks], causal=True)
        assert err(out[qs], ro[0]) < 2e-5
        assert err(lse[:, qs], rl[0]) < 2e-5


def test_backward_matches_float64_gradients():
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 2, 40, 4, 32), rand(rng, 2, 56, 2, 32), rand(rng, 2, 56, 2, 32)
    out, lse, _ = fa4.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = rand(rng, *out.shape)
    dq, dk, dv = fa4.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    for got, want in zip((dq, dk, dv), reference_grad(q, k, v, dout, causal=True)):
        assert got.shape == want.shape
        assert err(got, want) < 1e-4 * max(1.0, float(np.abs(want).max()))


def test_backward_deterministic_bits():
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 1, 64, 2, 32), rand(rng, 1, 64, 2, 32), rand(rng, 1, 64, 2, 32)
    out, lse, _ = fa4.flash_attn_func(q, k, v, return_attn_probs=True)
    dout = rand(rng, *out.shape)
    a = fa4.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True)
    b = fa4.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_paged_kvcache_with_append(page):
    rng = np.random.default_rng(page)
    b, hq, hk, d, pages_per_seq = 3, 8, 2, 64, 6
    lens = np.array([page * 2 - 1, 0, page * pages_per_seq - 3], np.int32)
    new = 2
    num_pages = b * pages_per_seq + 1
    k_cache, v_cache = rand(rng, num_pages, page, hk, d), rand(rng, num_pages, page, hk, d)
    table = rng.permutation(num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
    q = rand(rng, b, new, hq, d)
    kn, vn = rand(rng, b, new, hk, d), rand(rng, b, new, hk, d)
    # The sequences as contiguous arrays, before the append.
    def gather(cache, i, n):
        rows = [cache[table[i, j // page], j % page] for j in range(n)]
        return np.stack(rows) if rows else np.zeros((0, hk, d), np.float32)
    old_k = [gather(k_cache, i, lens[i]) for i in range(b)]
    old_v = [gather(v_cache, i, lens[i]) for i in range(b)]
    out, lse = fa4.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, block_table=table, causal=True,
        return_softmax_lse=True,
    )
    assert out.shape == (b, new, hq, d) and lse.shape == (b, hq, new)
    for i in range(b):
        ks = np.concatenate([old_k[i], kn[i]])[None]
        vs = np.concatenate([old_v[i], vn[i]])[None]
        ro, rl = reference(q[i : i + 1], ks, vs, causal=True)
        assert err(out[i], ro[0]) < 2e-5
        assert err(lse[i], rl[0]) < 2e-5
        # The new rows are in the cache, where cache_seqlens said.
        assert np.array_equal(gather(k_cache, i, lens[i] + new)[lens[i]:], kn[i])


def test_contiguous_kvcache():
    rng = np.random.default_rng(7)
    kc, vc = rand(rng, 2, 50, 2, 32), rand(rng, 2, 50, 2, 32)
    q = rand(rng, 2, 1, 4, 32)
    out = fa4.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.array([50, 20], np.int32))
    for i, n in enumerate([50, 20]):
        ro, _ = reference(q[i : i + 1], kc[i : i + 1, :n], vc[i : i + 1, :n])
        assert err(out[i], ro[0]) < 2e-5


def test_combine_is_the_exact_merge():
    rng = np.random.default_rng(8)
    o_parts, lse_parts = rand(rng, 3, 10, 16), rand(rng, 3, 10)
    out, lse = fa4.combine(o_parts, lse_parts)
    w = np.exp(lse_parts.astype(np.float64) - np.log(np.exp(lse_parts.astype(np.float64)).sum(0)))
    assert err(out, (w[..., None] * o_parts).sum(0)) < 1e-5
    assert err(lse, np.log(np.exp(lse_parts.astype(np.float64)).sum(0))) < 1e-5


def test_plan_is_fa4config():
    p = fa4.plan(128, num_q_heads=32, group=4)
    assert (p["BM"], p["BN"], p["depth"], p["group"]) == (256, 128, 128, 4)
    with pytest.raises(ValueError, match="swizzle"):
        fa4.plan(128, swizzle="16B")


def test_build_info():
    info = fa4.build_info()
    assert info["version"] == fa4.__version__
    assert isinstance(info["commit"], str) and info["commit"]


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(dropout_p=0.1), ValueError, "dropout_p"),
        (dict(alibi_slopes=np.zeros(4, np.float32)), ValueError, "alibi_slopes"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(window_size=3), TypeError, "window_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ],
)
def test_bad_arguments_are_named(kwargs, exc, name):
    rng = np.random.default_rng(9)
    q = rand(rng, 1, 8, 2, 16)
    with pytest.raises(exc, match=name):
        fa4.flash_attn_func(q, q, q, **kwargs)


def test_bad_tensors_are_named():
    rng = np.random.default_rng(10)
    q = rand(rng, 1, 8, 4, 16)
    with pytest.raises(ValueError, match="`k`"):
        fa4.flash_attn_func(q, rand(rng, 1, 8, 3, 16), rand(rng, 1, 8, 3, 16))
    with pytest.raises(TypeError, match="k"):
        fa4.flash_attn_func(q, [[1.0]], q)
    with pytest.raises(TypeError, match="q"):
        fa4.flash_attn_func(q.astype(np.int32), q, q)
    with pytest.raises(TypeError, match="k"):
        fa4.flash_attn_func(q, q.astype(np.float16), q)
    with pytest.raises(ValueError, match="q"):
        fa4.flash_attn_func(q[0], q, q)


def test_bad_varlen_offsets_are_named():
    rng = np.random.default_rng(11)
    q = rand(rng, 10, 2, 16)
    good = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fa4.flash_attn_varlen_func(q, q, q, np.array([0, 6, 4], np.int32), good, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        fa4.flash_attn_varlen_func(q, q, q, good, good, 6, 5)
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        fa4.flash_attn_varlen_func(q, q, q, good, good.astype(np.float32), 6, 6)


def test_bad_paged_arguments_are_named():
    rng = np.random.default_rng(12)
    kc = rand(rng, 4, 16, 2, 32)
    q = rand(rng, 2, 1, 2, 32)
    with pytest.raises(ValueError, match="`block_table`"):
        fa4.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=np.array([20, 3], np.int32),
                                    block_table=np.array([[0, 9], [1, 2]], np.int32))
    with pytest.raises(ValueError, match="rotary_cos"):
        fa4.flash_attn_with_kvcache(q, kc, kc, rotary_cos=np.zeros(3), block_table=np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="num_splits"):
        fa4.flash_attn_with_kvcache(q, kc, kc, block_table=np.zeros((2, 1), np.int32), num_splits=-1)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa4.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=np.array([3], np.int32),
                                    block_table=np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="`cache_seqlens`"):
        fa4.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=np.array([17, 3], np.int32),
                                    block_table=np.zeros((2, 1), np.int32))
