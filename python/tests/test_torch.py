"""The fa4 package with torch tensors: autograd, torch.compile, CUDA graphs and streams.

FlashAttention's own rule for the GPU: fa4's error against a float64 evaluation is at most twice
that of a plain PyTorch evaluation in the inputs' precision (plus a small floor). The CPU tests
run wherever torch is installed; the CUDA ones where a GPU is (skipped, not passed, elsewhere).
"""

import math

import pytest

torch = pytest.importorskip("torch")

import fa4  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def attention_ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, upcast=True):
    """(batch, seqlen, heads, dim) attention written from the definition; in float64 when
    `upcast`, else in the inputs' dtype (the plain low-precision evaluation)."""
    dt = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    sq, sk = q.shape[1], k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out if upcast else out.to(dt)


def check(got, ref, plain, floor=1e-5, what="out"):
    e = (got.double() - ref).abs().max().item()
    pe = (plain.double() - ref).abs().max().item()
    assert e <= 2 * pe + floor, f"{what}: fa4 error {e:.3g} > 2 x plain {pe:.3g} + {floor}"


def make(shape_q, shape_kv, dtype, device, seed=0, grad=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda s: torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
    return mk(shape_q), mk(shape_kv), mk(shape_kv)


# ---------------------------------------------------------------------------------------------
# CPU tensors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_forward_and_autograd(dtype):
    q, k, v = make((2, 33, 4, 32), (2, 40, 2, 32), dtype, "cpu", grad=True)
    out = fa4.flash_attn_func(q, k, v, causal=True)
    ref = attention_ref(q, k, v, causal=True)
    plain = attention_ref(q, k, v, causal=True, upcast=False)
    check(out, ref, plain, floor=1e-5 if dtype == torch.float32 else 1e-3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    plain_grads = torch.autograd.grad(plain, (q, k, v), dout)
    for name, a, r, p in zip("qkv", grads, ref_grads, plain_grads):
        check(a, r, p, floor=1e-4 if dtype == torch.float32 else 2e-3, what="d" + name)


def test_cpu_varlen_and_kvcache():
    q, k, v = make((20, 4, 32), (26, 2, 32), torch.float32, "cpu")
    cq = torch.tensor([0, 8, 20], dtype=torch.int32)
    ck = torch.tensor([0, 10, 26], dtype=torch.int32)
    out = fa4.flash_attn_varlen_func(q, k, v, cq, ck, 12, 16, causal=True)
    for i in range(2):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ref = attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=True)[0]
        assert (out[qs].double() - ref).abs().max() < 1e-5
    kc, vc = make((2, 30, 2, 32), (2, 30, 2, 32), torch.float32, "cpu", seed=1)[1:]
    qd = make((2, 1, 4, 32), (1, 1, 1, 32), torch.float32, "cpu", seed=2)[0]
    out = fa4.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=torch.tensor([30, 7], dtype=torch.int32))
    for i, n in enumerate([30, 7]):
        ref = attention_ref(qd[i : i + 1], kc[i : i + 1, :n], vc[i : i + 1, :n])[0]
        assert (out[i].double() - ref).abs().max() < 1e-5


def test_cpu_compile_traces_without_graph_breaks():
    q, k, v = make((1, 16, 2, 32), (1, 16, 2, 32), torch.float32, "cpu")
    f = torch.compile(lambda q, k, v: fa4.flash_attn_func(q, k, v, causal=True) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(q, k, v), fa4.flash_attn_func(q, k, v, causal=True) * 2)


def test_errors_name_the_argument():
    q, k, v = make((1, 8, 2, 16), (1, 8, 2, 16), torch.float32, "cpu")
    with pytest.raises(ValueError, match="dropout_p"):
        fa4.flash_attn_func(q, k, v, dropout_p=0.5)
    with pytest.raises(TypeError, match="k"):
        fa4.flash_attn_func(q, k.half(), v)
    with pytest.raises(TypeError, match="q"):
        fa4.flash_attn_func(q.to(torch.int32), k, v)
    with pytest.raises(TypeError, match="v"):
        fa4.flash_attn_func(q, k, v.numpy())


# ---------------------------------------------------------------------------------------------
# fp8 (e4m3) inputs: docs/attention.md, "FP8 (e4m3) inputs"
# ---------------------------------------------------------------------------------------------

E4M3_MAX = 448.0


def quantize_fp8(x, heads_kv):
    """x (batch, seqlen, heads, d) as the docs quantize it: per (batch, KV head) descale =
    amax / 448 (over the group's query heads for Q; 1 when 0), x / descale rounded to e4m3."""
    b, s, h, d = x.shape
    g = h // heads_kv
    amax = x.float().abs().reshape(b, s, heads_kv, g, d).amax(dim=(1, 3, 4))
    ds = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x8 = (x.float() / ds.repeat_interleave(g, 1)[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return x8.to(torch.float8_e4m3fn), ds


def dequantize_fp8(x8, ds, dtype=torch.float64):
    g = x8.shape[2] // ds.shape[1]
    return x8.to(dtype) * ds.to(dtype).repeat_interleave(g, 1)[:, None, :, None]


def naive_fp8(q, k, v, out_dtype, causal=False):
    """The naive fp8 evaluation (dequantized f32 inputs, f32 scores, P~ = 2^8 exp(s - max) rounded to
    e4m3, the row sum over the unrounded P~, O rounded to out_dtype): what fp8 itself costs."""
    q, k, v = q.float(), k.float(), v.float()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    sq, sk = q.shape[1], k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        s = s.masked_fill(torch.arange(sk, device=q.device)[None, :] > i, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = 256 * torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(torch.float8_e4m3fn).float(), v)
    l = l.permute(0, 2, 1, 3)
    o = torch.where(l > 0, o / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(o))
    return o.to(out_dtype)


def check_fp8(out, ref, naive, what="out"):
    """The docs' bound for fp8 inputs: 2 x the naive evaluation's error + the output's rounding."""
    atol = (ref.to(out.dtype).double() - ref).abs().max().item()
    e = (out.double() - ref).abs().max().item()
    ne = (naive.double() - ref).abs().max().item()
    assert e <= 2 * ne + atol, f"{what}: fa4 error {e:.3g} > 2 x naive {ne:.3g} + {atol:.3g}"


def make_fp8(b, sq, sk, hq, hk, d, device, seed=0):
    """Quantized standard normal Q, K, V (a few K rows scaled up) and their descales."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, generator=g) for n, h in ((sq, hq), (sk, hk), (sk, hk)))
    k[:, torch.randperm(sk, generator=g)[:2]] *= 8
    out = []
    for x in (q, k, v):
        x8, ds = quantize_fp8(x, hk)
        out += [x8.to(device), ds.to(device)]
    return out


def fp8_case(q8, dq, k8, dk, v8, dv, causal, want, **kw):
    """fa4's fp8 forward (O of dtype `want`) against the oracle; `kw` goes to flash_attn_func."""
    out, lse, _ = fa4.flash_attn_func(q8, k8, v8, causal=causal, q_descale=dq, k_descale=dk, v_descale=dv,
                                      return_attn_probs=True, **kw)
    assert out.dtype == want and lse.dtype == torch.float32
    deq = [dequantize_fp8(x, d) for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    ref = attention_ref(*deq, causal=causal)
    check_fp8(out, ref, naive_fp8(*deq, want, causal=causal))
    return out, lse


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_cpu_fp8_forward(out_dtype):
    q8, dq, k8, dk, v8, dv = make_fp8(2, 33, 40, 4, 2, 64, "cpu", seed=11)
    kw = {} if out_dtype == torch.bfloat16 else dict(out_dtype=out_dtype)
    out, lse = fp8_case(q8, dq, k8, dk, v8, dv, True, out_dtype, **kw)
    assert out.shape == (2, 33, 4, 64) and lse.shape == (2, 4, 33)


def test_cpu_fp8_varlen_and_compile():
    q8, dq, k8, dk, v8, dv = make_fp8(1, 20, 26, 4, 2, 32, "cpu", seed=12)
    cq = torch.tensor([0, 8, 20], dtype=torch.int32)
    ck = torch.tensor([0, 10, 26], dtype=torch.int32)
    # Two sequences, each with its own descales (the packed batch's (sequences, heads_kv)).
    dqs, dks, dvs = (torch.stack([d[0], d[0] * 2]) for d in (dq, dk, dv))
    out = fa4.flash_attn_varlen_func(q8[0], k8[0], v8[0], cq, ck, 12, 16, causal=True, q_descale=dqs,
                                     k_descale=dks, v_descale=dvs)
    for i in range(2):
        qs, ks = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        deq = [dequantize_fp8(x[:, r], d[i : i + 1]) for x, r, d in ((q8, qs, dqs), (k8, ks, dks), (v8, ks, dvs))]
        check_fp8(out[None, qs], attention_ref(*deq, causal=True), naive_fp8(*deq, torch.bfloat16, causal=True))
    f = torch.compile(lambda q, k, v: fa4.flash_attn_func(q, k, v, q_descale=dq, k_descale=dk, v_descale=dv).float(),
                      backend="aot_eager", fullgraph=True)
    want = fa4.flash_attn_func(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv).float()
    assert torch.equal(f(q8, k8, v8), want)


def test_fp8_errors_name_the_argument():
    q8, dq, k8, dk, v8, dv = make_fp8(2, 8, 8, 4, 2, 16, "cpu", seed=13)
    for kw, name in (
        (dict(q_descale=dq[:1]), "q_descale"),
        (dict(k_descale=dk.double()), "k_descale"),
        (dict(v_descale=dv.numpy()), "v_descale"),
        (dict(v_descale=torch.zeros_like(dv)), "`v_descale`"),
        (dict(out_dtype=torch.float32), "out_dtype"),
    ):
        with pytest.raises(ValueError, match=name):
            fa4.flash_attn_func(q8, k8, v8, **kw)
    with pytest.raises(TypeError, match="k"):
        fa4.flash_attn_func(q8, k8.to(torch.bfloat16), v8)
    with pytest.raises(TypeError, match="q"):
        e5m2 = q8.float().to(torch.float8_e5m2)
        fa4.flash_attn_func(e5m2, e5m2, e5m2)
    with pytest.raises(TypeError, match="flash_attn_func"):
        fa4.flash_attn_with_kvcache(q8, k8, v8)
    qb = q8.to(torch.bfloat16)
    with pytest.raises(ValueError, match="q_descale"):
        fa4.flash_attn_func(qb, qb, qb, q_descale=dq)
    out, lse, _ = fa4.flash_attn_func(q8, k8, v8, return_attn_probs=True)
    with pytest.raises(ValueError, match="q"):
        fa4.flash_attn_backward(out, q8, k8, v8, out, lse)
    q8.requires_grad_()
    out = fa4.flash_attn_func(q8, k8, v8)
    with pytest.raises(ValueError, match="no backward for fp8"):
        out.float().sum().backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_forward_eager_call_matches_the_registered_op(device, monkeypatch):
    """Outside torch.compile, with no input autograd records, flash_attn_func runs the op's body
    directly (16-bit and fp8): the same bits as the registered op. An input that autograd records
    goes through the op, whose backward it needs; under no_grad it does not."""
    from fa4 import _torch as ft

    g = torch.Generator().manual_seed(42)
    q, k, v = (torch.randn(2, 40, 4, 64, generator=g).to(device, torch.bfloat16) for _ in range(3))
    out, lse, _ = fa4.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    want = torch.ops.fa4.fwd(q, k, v, None, None, 64**-0.5, True, -1, -1, 0.0, False)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    calls = []
    body = ft._fwd_body
    monkeypatch.setattr(ft, "_fwd_body", lambda *a: calls.append(1) or body(*a))
    fa4.flash_attn_func(q, k, v, causal=True)
    assert len(calls) == 1
    qg = q.detach().clone().requires_grad_()
    tracked = fa4.flash_attn_func(qg, k, v, causal=True)
    assert len(calls) == 1 and tracked.grad_fn is not None
    tracked.float().sum().backward()
    assert qg.grad is not None and qg.grad.shape == q.shape
    with torch.no_grad():
        fa4.flash_attn_func(qg, k, v, causal=True)
    assert len(calls) == 2
    if device == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        return  # the fp8 forward runs on Hopper GPUs and the CPU
    q8, dq, k8, dk, v8, dv = make_fp8(2, 33, 40, 4, 2, 64, device, seed=43)
    out8 = fa4.flash_attn_func(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv)
    want8 = torch.ops.fa4.fwd_fp8(q8, k8, v8, None, None, dq, dk, dv, 64**-0.5, False, -1, -1, 0.0, "bf16")
    assert torch.equal(out8, want8[0])


# ---------------------------------------------------------------------------------------------
# fp8 KV caches (vLLM's kv_cache_dtype="fp8_e4m3"): docs/decode.md, "An fp8 cache"
# ---------------------------------------------------------------------------------------------


def quantize_cache_fp8(x):
    """A (pages, page_size, heads_kv, d) cache with one scale per KV head: scale = amax / 448 over
    the head's elements, x / scale rounded to e4m3. Returns (float8_e4m3fn cache, float32 scales)."""
    amax = x.float().abs().amax(dim=(0, 1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / s[None, None, :, None]).to(torch.float8_e4m3fn), s


def fp8_kvcache_case(device, dtype, page, d, seed):
    """Decode with an append over a paged fp8 cache on `device`: the appended bytes are torch's
    quantization of the new rows (f32 division, nearest e4m3), and O passes the GPU rule against
    the float64 evaluation of the dequantized keys and values."""
    b, hq, hk, new, blocks = 3, 8, 2, 2, 5
    g = torch.Generator().manual_seed(seed)
    lens = [page * 2 - 1, 0, page * blocks - new]
    num_pages = b * blocks + 1
    kc, ks = quantize_cache_fp8(torch.randn(num_pages, page, hk, d, generator=g) * torch.tensor([1.0, 6.0])[:, None])
    vc, vs = quantize_cache_fp8(torch.randn(num_pages, page, hk, d, generator=g))
    table = torch.randperm(num_pages, generator=g)[: b * blocks].view(b, blocks).to(torch.int32)
    q = torch.randn(b, new, hq, d, generator=g).to(dtype)
    kn, vn = ((torch.randn(b, new, hk, d, generator=g) * 0.5).to(dtype) for _ in range(2))
    kc, ks, vc, vs, q, kn, vn = (t.to(device) for t in (kc, ks, vc, vs, q, kn, vn))

    def gather(cache, i, n):  # sequence i's first n rows, through bytes (indexing takes no fp8)
        idx = torch.arange(n)
        rows = cache.view(torch.uint8)[table[i, idx // page].long().to(device), (idx % page).to(device)]
        return rows.view(torch.float8_e4m3fn)

    old = [(gather(kc, i, lens[i]), gather(vc, i, lens[i])) for i in range(b)]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = fa4.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=seqlens, block_table=table, causal=True,
                                      k_scale=ks, v_scale=vs)
    assert out.dtype == dtype and out.device == q.device and out.shape == (b, new, hq, d)
    kn8, vn8 = ((x.float() / s[None, None, :, None]).to(torch.float8_e4m3fn) for x, s in ((kn, ks), (vn, vs)))
    for i in range(b):
        for cache, rows in ((kc, kn8), (vc, vn8)):
            got = gather(cache, i, lens[i] + new)[lens[i] :]
            assert torch.equal(got.view(torch.uint8), rows[i].view(torch.uint8))
        kk = torch.cat([old[i][0], kn8[i]]).double() * ks.double()[:, None]
        vv = torch.cat([old[i][1], vn8[i]]).double() * vs.double()[:, None]
        ref = attention_ref(q[i : i + 1], kk[None], vv[None], causal=True)
        plain = attention_ref(q[i : i + 1], kk[None].to(dtype), vv[None].to(dtype), causal=True, upcast=False)
        check(out[i : i + 1], ref, plain)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_fp8_kvcache_with_append(dtype):
    fp8_kvcache_case("cpu", dtype, 16, 64, seed=30)


def test_cpu_fp8_kvcache_scales_and_compile():
    """vLLM's per-tensor scale (a 0-d tensor), a float and a (heads_kv,) tensor of equal values
    are one scale; the op traces under torch.compile without graph breaks."""
    g = torch.Generator().manual_seed(31)
    kc, _ = quantize_cache_fp8(torch.randn(2, 16, 2, 32, generator=g))
    vc, _ = quantize_cache_fp8(torch.randn(2, 16, 2, 32, generator=g))
    q = torch.randn(2, 1, 4, 32, generator=g).to(torch.bfloat16)
    lens = torch.tensor([16, 5], dtype=torch.int32)
    run = lambda ks, vs: fa4.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k_scale=ks, v_scale=vs)
    want = run(torch.tensor(0.02), torch.tensor([0.5]))
    assert torch.equal(want, run(0.02, 0.5))
    assert torch.equal(want, run(torch.full((2,), 0.02), torch.full((2,), 0.5)))
    f = torch.compile(lambda q, kc, vc, ks, vs: fa4.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k_scale=ks,
                                                                            v_scale=vs).float(),
                      backend="aot_eager", fullgraph=True)
    assert torch.equal(f(q, kc, vc, torch.tensor(0.02), torch.tensor([0.5])), want.float())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("fp8", [False, True])
def test_kvcache_eager_call_matches_the_registered_op(device, fp8, monkeypatch):
    """Outside torch.compile a paged call runs its op's body directly (the dispatcher's custom-op
    layers cost more host time than a decode step's GPU time): the same bits and the same appended
    rows as the registered op, and the append bumps both caches' version counters as the op's
    in-place layer does. With an input that autograd records it goes through the op."""
    g = torch.Generator().manual_seed(41)
    page, hk, d = 16, 2, 32
    kc, vc = (torch.randn(4, page, hk, d, generator=g) for _ in range(2))
    ks = vs = None
    if fp8:
        (kc, ks), (vc, vs) = quantize_cache_fp8(kc), quantize_cache_fp8(vc)
    else:
        kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    q = torch.randn(2, 1, 4, d, generator=g).to(torch.bfloat16)
    kn, vn = (torch.randn(2, 1, hk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    kc, vc, q, kn, vn = (t.to(device) for t in (kc, vc, q, kn, vn))
    ks, vs = (None if s is None else s.to(device) for s in (ks, vs))
    table = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    k2, v2 = kc.clone(), vc.clone()
    versions = kc._version, vc._version
    out, lse = fa4.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, block_table=table,
                                           return_softmax_lse=True, k_scale=ks, v_scale=vs)
    assert kc._version > versions[0] and vc._version > versions[1]
    opts = (d**-0.5, False, -1, -1, 0.0, 0)
    if fp8:
        want = torch.ops.fa4.kvcache_fp8(q, k2, v2, ks, vs, kn, vn, table, lens, *opts)
    else:
        want = torch.ops.fa4.kvcache(q, k2, v2, kn, vn, table, lens, *opts)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert torch.equal(kc.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), v2.view(torch.uint8))
    # Which path a call takes: the body directly (counted) or the op (which holds the original).
    from fa4 import _torch as ft

    name = "_kvcache_fp8_body" if fp8 else "_kvcache_body"
    calls = []
    body = getattr(ft, name)
    monkeypatch.setattr(ft, name, lambda *a: calls.append(1) or body(*a))
    run = lambda q: fa4.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, k_scale=ks,
                                                v_scale=vs)
    plain = run(q)
    assert len(calls) == 1
    tracked = run(q.detach().clone().requires_grad_())
    assert len(calls) == 1, "an input that autograd records must go through the op"
    with torch.no_grad():
        run(q.detach().clone().requires_grad_())
    assert len(calls) == 2
    assert torch.equal(plain, tracked.detach())


def test_fp8_kvcache_errors_name_the_argument():
    g = torch.Generator().manual_seed(32)
    kc, ks = quantize_cache_fp8(torch.randn(2, 16, 2, 32, generator=g))
    q = torch.randn(2, 1, 4, 32, generator=g).to(torch.bfloat16)
    for kw, name in (
        (dict(k_scale=torch.ones(3)), "k_scale"),
        (dict(v_scale=torch.ones(2, 1)), "v_scale"),
        (dict(k_scale=ks.double()), "k_scale"),
        (dict(v_scale=ks.numpy()), "v_scale"),
        (dict(k_scale=torch.tensor([1.0, 0.0])), "`k_scale`"),
        (dict(v_scale=float("nan")), "`v_scale`"),
    ):
        with pytest.raises(ValueError, match=name):
            fa4.flash_attn_with_kvcache(q, kc, kc, **kw)
    kb = kc.to(torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale"):
        fa4.flash_attn_with_kvcache(q, kb, kb, k_scale=ks)
    with pytest.raises(TypeError, match="v_cache"):
        fa4.flash_attn_with_kvcache(q, kc, kb)
    with pytest.raises(TypeError, match="k"):
        fa4.flash_attn_with_kvcache(q, kc, kc, k=q[:, :, :2].half(), v=q[:, :, :2], cache_seqlens=3)


# ---------------------------------------------------------------------------------------------
# CUDA tensors
# ---------------------------------------------------------------------------------------------

FWD_CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim): the Hopper kernel's head dims,
    # the Ampere-class kernel's, GQA, ragged lengths.
    (2, 256, 256, 8, 8, 64),
    (2, 300, 300, 8, 2, 128),
    (1, 512, 700, 4, 4, 256),
    (2, 128, 128, 6, 3, 80),
    (1, 200, 333, 4, 1, 96),
    (3, 1, 257, 8, 2, 128),
]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", FWD_CASES)
def test_cuda_forward(case, causal, dtype):
    b, sq, sk, hq, hk, d = case
    q = make((b, sq, hq, d), (b, sk, hk, d), dtype, "cuda", seed=sum(case))[0]
    k, v = make((b, sk, hk, d), (b, sk, hk, d), dtype, "cuda", seed=sum(case) + 1)[1:]
    out, lse, _ = fa4.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref = attention_ref(q, k, v, causal=causal)
    check(out, ref, attention_ref(q, k, v, causal=causal, upcast=False))
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32


@cuda
def test_cuda_window_softcap():
    q, k, v = make((2, 256, 8, 128), (2, 256, 2, 128), torch.bfloat16, "cuda", seed=3)
    out = fa4.flash_attn_func(q, k, v, window_size=(64, 16), softcap=20.0)
    ref = attention_ref(q, k, v, window=(64, 16), softcap=20.0)
    check(out, ref, attention_ref(q, k, v, window=(64, 16), softcap=20.0, upcast=False))


@cuda
@pytest.mark.parametrize("offsets_on", ["cpu", "cuda"])
def test_cuda_varlen(offsets_on):
    lens_q, lens_k = [1, 200, 0, 511, 64], [30, 200, 5, 600, 64]
    cq = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q, k, v = make((int(cq[-1]), 8, 128), (int(ck[-1]), 4, 128), torch.bfloat16, "cuda", seed=4)
    out = fa4.flash_attn_varlen_func(
        q, k, v, cq.to(offsets_on), ck.to(offsets_on), max(lens_q), max(lens_k), causal=True
    )
    for i in range(len(lens_q)):
        qs, ks = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        if qs.stop == qs.start:
            continue
        ref = attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=True)[0]
        plain = attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=True, upcast=False)[0]
        check(out[qs], ref, plain)


BWD_CASES = [(2, 256, 8, 8, 64), (2, 384, 8, 2, 128), (1, 256, 4, 4, 256), (2, 200, 4, 2, 96)]


@cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", BWD_CASES)
def test_cuda_autograd(case, causal):
    b, s, hq, hk, d = case
    q = make((b, s, hq, d), (1,), torch.bfloat16, "cuda", seed=sum(case), grad=True)[0]
    k, v = make((b, s, hk, d), (b, s, hk, d), torch.bfloat16, "cuda", seed=sum(case) + 1, grad=True)[1:]
    out = fa4.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = attention_ref(q, k, v, causal=causal)
    plain = attention_ref(q, k, v, causal=causal, upcast=False)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    plain_grads = torch.autograd.grad(plain, (q, k, v), dout)
    check(out, ref, plain)
    for name, a, r, p in zip("qkv", grads, ref_grads, plain_grads):
        check(a, r, p, floor=1e-4, what="d" + name)


@cuda
def test_cuda_varlen_autograd_and_deterministic():
    cq = torch.tensor([0, 100, 356], dtype=torch.int32)
    q, k, v = make((356, 4, 64), (356, 4, 64), torch.bfloat16, "cuda", seed=5)
    for t in (q, k, v):
        t.requires_grad_()
    out = fa4.flash_attn_varlen_func(q, k, v, cq, cq, 256, 256, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    a = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    b = torch.autograd.grad(out, (q, k, v), dout)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "deterministic backward gave different bits"
    for i in range(2):
        sl = slice(int(cq[i]), int(cq[i + 1]))
        ref = attention_ref(q[None, sl], k[None, sl], v[None, sl], causal=True)[0]
        plain = attention_ref(q[None, sl], k[None, sl], v[None, sl], causal=True, upcast=False)[0]
        check(out[sl], ref, plain)


@cuda
@pytest.mark.parametrize("page", [16, 64, 256])
def test_cuda_paged_kvcache_with_append(page):
    b, hq, hk, d, new = 4, 32, 8, 128, 1
    lens = [page * 3 + 5, 1, 0, page * 8 - new]
    blocks = 8
    num_pages = b * blocks + 3
    g = torch.Generator().manual_seed(page)
    kc = torch.randn(num_pages, page, hk, d, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(num_pages, page, hk, d, generator=g).to("cuda", torch.bfloat16)
    table = torch.randperm(num_pages, generator=g)[: b * blocks].view(b, blocks).to(torch.int32)
    q = torch.randn(b, new, hq, d, generator=g).to("cuda", torch.bfloat16)
    kn = torch.randn(b, new, hk, d, generator=g).to("cuda", torch.bfloat16)
    vn = torch.randn(b, new, hk, d, generator=g).to("cuda", torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32)

    def gather(cache, i, n):
        idx = torch.arange(n)
        return cache[table[i, idx // page].long().cuda(), (idx % page).cuda()]

    old = [(gather(kc, i, lens[i]), gather(vc, i, lens[i])) for i in range(b)]
    out = fa4.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=seqlens, block_table=table, causal=True)
    for i in range(b):
        ks = torch.cat([old[i][0], kn[i]])[None]
        vs = torch.cat([old[i][1], vn[i]])[None]
        ref = attention_ref(q[i : i + 1], ks, vs, causal=True)
        check(out[i : i + 1], ref, attention_ref(q[i : i + 1], ks, vs, causal=True, upcast=False))
        assert torch.equal(gather(kc, i, lens[i] + new)[lens[i] :], kn[i])


@cuda
def test_cuda_compile_fullgraph_forward_and_backward():
    q, k, v = make((2, 256, 8, 128), (2, 256, 8, 128), torch.bfloat16, "cuda", seed=6, grad=True)

    def f(q, k, v):
        return fa4.flash_attn_func(q, k, v, causal=True).float().square().mean()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager, got):
        assert torch.allclose(a.float(), b.float(), atol=1e-3, rtol=1e-2)


@cuda
def test_cuda_graph_capture_and_replay():
    q, k, v = make((2, 512, 8, 128), (2, 512, 8, 128), torch.bfloat16, "cuda", seed=7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compiles and loads the kernels on this stream before capture
            fa4.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        out = fa4.flash_attn_func(q, k, v, causal=True)
    q2, k2, v2 = make((2, 512, 8, 128), (2, 512, 8, 128), torch.bfloat16, "cuda", seed=8)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fa4.flash_attn_func(q2, k2, v2, causal=True))


@cuda
def test_cuda_runs_on_the_current_stream():
    q, k, v = make((4, 1024, 16, 128), (4, 1024, 16, 128), torch.bfloat16, "cuda", seed=9)
    want = fa4.flash_attn_func(q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)  # the result must wait for work queued before it
        got = fa4.flash_attn_func(q, k, v)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, want)


@cuda
def test_cuda_errors_name_the_argument():
    q, k, v = make((1, 64, 4, 64), (1, 64, 4, 64), torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="k"):
        fa4.flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ValueError, match="q|head_dim"):
        fa4.flash_attn_func(q[..., :60], k[..., :60], v[..., :60])  # head_dim 60: not a multiple of 8
    with pytest.raises(ValueError, match="max_seqlen_q"):
        qq = q.view(64, 4, 64)
        fa4.flash_attn_varlen_func(qq, qq, qq, torch.tensor([0, 64], dtype=torch.int32),
                                   torch.tensor([0, 64], dtype=torch.int32), 10, 64)


hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="fa4's fp8 kernel needs a Hopper GPU",
)

FP8_CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim): the kernel's head dims, GQA,
    # ragged lengths, a single query row.
    (2, 256, 256, 8, 8, 64),
    (2, 300, 300, 8, 2, 128),
    (1, 512, 700, 4, 4, 256),
    (3, 1, 257, 8, 2, 128),
    (1, 200, 333, 4, 1, 96),
]


@hopper
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", FP8_CASES)
def test_cuda_fp8_forward(case, causal, out_dtype):
    b, sq, sk, hq, hk, d = case
    q8, dq, k8, dk, v8, dv = make_fp8(b, sq, sk, hq, hk, d, "cuda", seed=sum(case))
    kw = {} if out_dtype == torch.bfloat16 else dict(out_dtype=out_dtype)
    out, lse = fp8_case(q8, dq, k8, dk, v8, dv, causal, out_dtype, **kw)
    assert out.is_cuda and lse.shape == (b, hq, sq)
    # The CPU's evaluation of the same bytes (P in f32) passes the same bound.
    cpu = fa4.flash_attn_func(q8.cpu(), k8.cpu(), v8.cpu(), causal=causal, q_descale=dq.cpu(), k_descale=dk.cpu(),
                              v_descale=dv.cpu(), **kw)
    deq = [dequantize_fp8(x, dd) for x, dd in ((q8, dq), (k8, dk), (v8, dv))]
    check_fp8(cpu.cuda(), attention_ref(*deq, causal=causal), naive_fp8(*deq, out_dtype, causal=causal), "cpu")


@hopper
def test_cuda_fp8_varlen():
    lens_q, lens_k = [1, 200, 0, 511, 64], [30, 200, 5, 600, 64]
    cq = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    n = len(lens_q)
    g = torch.Generator().manual_seed(21)
    q8, k8, v8 = (torch.randn(int(c[-1]), h, 128, generator=g).clamp(-4, 4).to(torch.float8_e4m3fn).cuda()
                  for c, h in ((cq, 8), (ck, 4), (ck, 4)))
    dq, dk, dv = (torch.rand(n, 4, generator=g).add(0.5).cuda() for _ in range(3))
    out = fa4.flash_attn_varlen_func(q8, k8, v8, cq, ck, max(lens_q), max(lens_k), causal=True, q_descale=dq,
                                     k_descale=dk, v_descale=dv)
    for i in range(n):
        qs, ks = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        if qs.stop == qs.start:
            continue
        deq = [dequantize_fp8(x[None, r], d[i : i + 1]) for x, r, d in ((q8, qs, dq), (k8, ks, dk), (v8, ks, dv))]
        check_fp8(out[None, qs], attention_ref(*deq, causal=True), naive_fp8(*deq, torch.bfloat16, causal=True))


@hopper
def test_cuda_fp8_errors_name_the_argument():
    q8, dq, k8, dk, v8, dv = make_fp8(1, 64, 64, 4, 2, 128, "cuda")
    with pytest.raises(ValueError, match="q_descale"):
        fa4.flash_attn_func(q8, k8, v8, q_descale=dq.cpu())  # not on q's device
    with pytest.raises(ValueError, match="k_descale"):
        fa4.flash_attn_func(q8, k8, v8, k_descale=dk.half())
    with pytest.raises(ValueError, match="v"):
        fa4.flash_attn_func(q8, k8, v8.cpu())
    q8.requires_grad_()
    with pytest.raises(ValueError, match="no backward for fp8"):
        fa4.flash_attn_func(q8, k8, v8).float().sum().backward()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [16, 64])
def test_cuda_fp8_kvcache_with_append(page, dtype):
    """The GPU's fp8 decode kernels and append: torch's bytes, the GPU rule; the CPU on the same
    cache and rows gives the same appended bytes."""
    out = fp8_kvcache_case("cuda", dtype, page, 128, seed=page)
    cpu = fp8_kvcache_case("cpu", dtype, page, 128, seed=page)
    assert (out.cpu().double() - cpu.double()).abs().max() < 0.05


@cuda
def test_cuda_fp8_kvcache_scales_stay_on_the_device():
    g = torch.Generator().manual_seed(33)
    kc, ks = quantize_cache_fp8(torch.randn(2, 16, 2, 128, generator=g))
    q = torch.randn(2, 1, 4, 128, generator=g).to(torch.bfloat16)
    kc, ks, q = kc.cuda(), ks.cuda(), q.cuda()
    with pytest.raises(ValueError, match="k_scale"):
        fa4.flash_attn_with_kvcache(q, kc, kc, k_scale=ks.cpu())
    with pytest.raises(ValueError, match="q"):  # the GPU kernels take 16-bit queries
        fa4.flash_attn_with_kvcache(q.float(), kc, kc, k_scale=ks, v_scale=ks)
    a = fa4.flash_attn_with_kvcache(q, kc, kc, k_scale=torch.tensor(0.03, device="cuda"), v_scale=0.5)
    b = fa4.flash_attn_with_kvcache(q, kc, kc, k_scale=torch.full((2,), 0.03, device="cuda"),
                                    v_scale=torch.full((2,), 0.5, device="cuda"))
    assert torch.equal(a, b)
