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
