"""fa4 as torch.library custom ops: ``fa4::fwd``, ``fa4::fwd_fp8``, ``fa4::bwd``,
``fa4::kvcache`` and ``fa4::kvcache_fp8`` (an fp8 e4m3 cache with its ``k_scale``/``v_scale``).

Each op has a fake (meta) implementation, so ``torch.compile`` traces it without a graph break,
and ``fa4::fwd`` has an autograd formula (``fa4::bwd``). ``fa4::fwd_fp8`` (float8_e4m3fn inputs
with FlashAttention-3's descales) has none: its backward raises. CUDA tensors run fa4's kernels on
torch's current stream with no copies and no host synchronisation (varlen offsets, page tables
and cache lengths are validated on the host: given as CPU tensors they cost nothing, as CUDA
tensors one copy to the host). Fixed-length calls are capturable in a CUDA graph once a call
of the same shape has run on the capturing stream (kernels are compiled and loaded then). CPU
tensors run fa4's CPU backend.
"""

from typing import List, Optional, Tuple

import torch

from . import _fa4

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "f32"}


_FP8 = getattr(torch, "float8_e4m3fn", None)  # None in a torch without fp8 types
_OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _dtype(name, t):
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        if is_fp8(t):
            raise TypeError(f"{name}: float8_e4m3fn inputs take flash_attn_func and flash_attn_varlen_func (forward "
                            "only)") from None
        raise TypeError(f"{name}: fa4 computes bfloat16, float16, float32 and float8_e4m3fn, got {t.dtype}") from None


def is_fp8(t):
    """Whether a tensor holds fp8 inputs (float8_e4m3fn)."""
    return _FP8 is not None and t.dtype == _FP8


def _check_same(**ts):
    first_name, first = next(iter(ts.items()))
    for name, t in ts.items():
        if t is None:
            continue
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {first_name}'s {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{name}: on {t.device}, {first_name} on {first.device}")


def _dev(t):
    """(address, shape, element strides) of a CUDA tensor whose last dimension is contiguous."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, (t.data_ptr(), list(t.shape), list(t.stride()))


def _host(t):
    """(bytes, shape) of a CPU tensor, C-contiguous."""
    t = t.detach().contiguous()
    # numpy has no bfloat16 nor fp8: their bits cross as integers.
    raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8) if t.element_size() == 1 else t
    return (raw.numpy().tobytes(), list(t.shape))


def _from_host(buf, dtype, shape):
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream


def _index(t):
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _host_list(t: Optional[torch.Tensor]) -> Optional[List[int]]:
    return None if t is None else [int(x) for x in t.tolist()]


def _out_shapes(q, v):
    if q.dim() == 4:
        b, s, h, _ = q.shape
        return (b, s, h, v.shape[-1]), (b, h, s)
    t, h, _ = q.shape
    return (t, h, v.shape[-1]), (h, t)


def _fwd_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_same(q=q, k=k, v=v)
    dt = _dtype("q", q)
    cq, ck = _host_list(cu_seqlens_q), _host_list(cu_seqlens_k)
    window = (window_left, window_right)
    o_shape, lse_shape = _out_shapes(q, v)
    if q.is_cuda:
        out = torch.empty(o_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        (q, qa), (k, ka), (v, va) = _dev(q), _dev(k), _dev(v)
        _fa4.forward_cuda(
            _index(q), _stream(q), dt, qa, ka, va, _dev(out)[1], lse.data_ptr(), cq, ck,
            causal, window, softmax_scale, softcap,
        )
        return out, lse
    o, l = _fa4.forward_cpu(dt, _host(q), _host(k), _host(v), cq, ck, causal, window, softmax_scale, softcap, 0)
    return _from_host(o, q.dtype, o_shape), _from_host(l, torch.float32, lse_shape)


_fwd = torch.library.custom_op("fa4::fwd", _fwd_body, mutates_args=())


@_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
              deterministic):
    o_shape, lse_shape = _out_shapes(q, v)
    return q.new_empty(o_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _fwd_fp8_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    out_dtype: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    cq, ck = _host_list(cu_seqlens_q), _host_list(cu_seqlens_k)
    window = (window_left, window_right)
    o_shape, lse_shape = _out_shapes(q, v)
    descales = [None if d is None else d.contiguous() for d in (q_descale, k_descale, v_descale)]
    if q.is_cuda:
        out = torch.empty(o_shape, dtype=_OUT_DTYPES[out_dtype], device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        (q, qa), (k, ka), (v, va) = _dev(q), _dev(k), _dev(v)
        ds = [None if d is None else (d.data_ptr(), d.numel()) for d in descales]
        _fa4.forward_fp8_cuda(
            _index(q), _stream(q), out_dtype, qa, ka, va, _dev(out)[1], lse.data_ptr(), *ds, cq, ck,
            causal, window, softmax_scale, softcap,
        )
        return out, lse
    ds = [None if d is None else d.detach().numpy().tobytes() for d in descales]
    o, l = _fa4.forward_fp8_cpu(
        out_dtype, _host(q), _host(k), _host(v), cq, ck, *ds, causal, window, softmax_scale, softcap, 0
    )
    return _from_host(o, _OUT_DTYPES[out_dtype], o_shape), _from_host(l, torch.float32, lse_shape)


_fwd_fp8 = torch.library.custom_op("fa4::fwd_fp8", _fwd_fp8_body, mutates_args=())


@_fwd_fp8.register_fake
def _fwd_fp8_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, softmax_scale, causal,
                  window_left, window_right, softcap, out_dtype):
    o_shape, lse_shape = _out_shapes(q, v)
    return q.new_empty(o_shape, dtype=_OUT_DTYPES[out_dtype]), q.new_empty(lse_shape, dtype=torch.float32)


def _fwd_fp8_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])


def _fwd_fp8_backward(ctx, dout, dlse):
    raise ValueError("q: fa4 has no backward for fp8 (float8_e4m3fn) inputs; the fp8 forward is for inference")


torch.library.register_autograd("fa4::fwd_fp8", _fwd_fp8_backward, setup_context=_fwd_fp8_setup)


@torch.library.custom_op("fa4::bwd", mutates_args=())
def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_same(q=q, k=k, v=v, out=out, dout=dout)
    if lse.dtype != torch.float32:
        raise TypeError(f"softmax_lse: expected float32, got {lse.dtype}")
    dt = _dtype("q", q)
    cq, ck = _host_list(cu_seqlens_q), _host_list(cu_seqlens_k)
    window = (window_left, window_right)
    if q.is_cuda:
        if not lse.is_cuda:
            raise ValueError(f"softmax_lse: on {lse.device}, q on {q.device}")
        lse = lse.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (q, qa), (k, ka), (v, va), (out, oa), (dout, da) = _dev(q), _dev(k), _dev(v), _dev(out), _dev(dout)
        _fa4.backward_cuda(
            _index(q), _stream(q), dt, qa, ka, va, oa, lse.data_ptr(), da,
            _dev(dq)[1], _dev(dk)[1], _dev(dv)[1], cq, ck, causal, window, softmax_scale, softcap, deterministic,
        )
        return dq, dk, dv
    lse_bytes = lse.detach().contiguous().numpy().tobytes()
    g = _fa4.backward_cpu(
        dt, _host(q), _host(k), _host(v), _host(out), lse_bytes, _host(dout), cq, ck,
        causal, window, softmax_scale, softcap, 0,
    )
    return tuple(_from_host(b, t.dtype, t.shape) for b, t in zip(g, (q, k, v)))


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
              window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, scale, causal, wl, wr, softcap, det = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.opts = (scale, causal, wl, wr, softcap, det)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _bwd(dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse, cu_q, cu_k, *ctx.opts)
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("fa4::fwd", _fwd_backward, setup_context=_fwd_setup)


def _paged_host_args(q, block_table, cache_seqlens):
    """(table, cache_seqlens) of a paged call as the extension takes them: the table as int32
    bytes and its width, the lengths as a list; wrong shapes are a ValueError naming them."""
    b = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table: expected ({b}, max_blocks), got shape {tuple(block_table.shape)}")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens: expected ({b},), got shape {tuple(cache_seqlens.shape)}")
    # As int32 bytes: a Python list of a long table costs milliseconds a call.
    bt = block_table.to("cpu")
    if bt.dtype != torch.int32 and bt.numel() and (int(bt.max()) >= 2**31 or int(bt.min()) < -(2**31)):
        raise ValueError("block_table: entries beyond int32")
    table = (bt.to(torch.int32).contiguous().numpy().tobytes(), block_table.shape[1])
    return table, _host_list(cache_seqlens)


def _paged_outputs(q, v_cache):
    """Fresh out and lse of a paged call on q's device."""
    b, s, h, _ = q.shape
    out = torch.empty((b, s, h, v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    return out, torch.empty((b, h, s), dtype=torch.float32, device=q.device)


def _paged_dev_args(q, k_cache, v_cache, k_new, v_new):
    """Device arguments of a paged CUDA call: q, the caches (last dimension contiguous, used in
    place) and the new rows (made contiguous), and the tensors they point into, which the caller
    holds until the call has been enqueued."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1:
            raise ValueError(f"{name}: its last dimension must be contiguous")
    held = [_dev(t) for t in (q, k_cache, v_cache)]
    held += [_dev(t.contiguous()) for t in (k_new, v_new) if t is not None]
    args = [a for _, a in held]
    new = args[3:] if k_new is not None else [None, None]
    return args[0], args[1], args[2], new, [t for t, _ in held]


def _kvcache_body(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: Optional[torch.Tensor],
    v_new: Optional[torch.Tensor],
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_same(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new)
    dt = _dtype("q", q)
    window = (window_left, window_right)
    table, cache_seqlens = _paged_host_args(q, block_table, cache_seqlens)
    if q.is_cuda:
        out, lse = _paged_outputs(q, v_cache)
        qa, ka, va, new, _held = _paged_dev_args(q, k_cache, v_cache, k_new, v_new)
        _fa4.paged_cuda(
            _index(q), _stream(q), dt, qa, ka, va, _dev(out)[1], lse.data_ptr(),
            table, cache_seqlens, new[0], new[1], causal, window, softmax_scale, softcap, num_splits,
        )
        return out, lse
    parts = _fa4.paged_cpu(
        dt, _host(q), _host(k_cache), _host(v_cache), table, cache_seqlens,
        None if k_new is None else _host(k_new), None if v_new is None else _host(v_new),
        causal, window, softmax_scale, softcap, num_splits, 0,
    )
    return _paged_host_results(parts, q, k_cache, v_cache, k_new is not None)


_kvcache = torch.library.custom_op("fa4::kvcache", _kvcache_body, mutates_args=("k_cache", "v_cache"))


def _paged_host_results(parts, q, k_cache, v_cache, appended):
    """(out, lse) of a paged CPU call; with `appended` the caches the extension returned are
    copied back into k_cache and v_cache."""
    o, l, kc, vc = parts
    if appended:
        # As bytes of the caches' own dtype (numpy has no bfloat16 nor fp8).
        for c, buf in ((k_cache, kc), (v_cache, vc)):
            raw = torch.frombuffer(buf, dtype=torch.uint8).view(c.dtype).reshape(c.shape)
            c.copy_(raw)
    b, s, h, _ = q.shape
    return _from_host(o, q.dtype, (b, s, h, v_cache.shape[-1])), _from_host(l, torch.float32, (b, h, s))


@_kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, k_new, v_new, block_table, cache_seqlens, softmax_scale,
                  causal, window_left, window_right, softcap, num_splits):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v_cache.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


def _kvcache_fp8_body(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_new: Optional[torch.Tensor],
    v_new: Optional[torch.Tensor],
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_same(k_cache=k_cache, v_cache=v_cache)
    _check_same(q=q, k=k_new, v=v_new)
    if k_cache.device != q.device:
        raise ValueError(f"k_cache: on {k_cache.device}, q on {q.device}")
    dt = _dtype("q", q)
    window = (window_left, window_right)
    table, cache_seqlens = _paged_host_args(q, block_table, cache_seqlens)
    if q.is_cuda:
        out, lse = _paged_outputs(q, v_cache)
        qa, ka, va, new, _held = _paged_dev_args(q, k_cache, v_cache, k_new, v_new)
        scales = [(s.data_ptr(), s.numel()) for s in (k_scale, v_scale)]
        _fa4.paged_fp8_cuda(
            _index(q), _stream(q), dt, qa, ka, va, *scales, _dev(out)[1], lse.data_ptr(),
            table, cache_seqlens, new[0], new[1], causal, window, softmax_scale, softcap, num_splits,
        )
        return out, lse
    parts = _fa4.paged_fp8_cpu(
        dt, _host(q), _host(k_cache), _host(v_cache), *(s.numpy().tobytes() for s in (k_scale, v_scale)),
        table, cache_seqlens, None if k_new is None else _host(k_new), None if v_new is None else _host(v_new),
        causal, window, softmax_scale, softcap, num_splits, 0,
    )
    return _paged_host_results(parts, q, k_cache, v_cache, k_new is not None)


_kvcache_fp8 = torch.library.custom_op("fa4::kvcache_fp8", _kvcache_fp8_body, mutates_args=("k_cache", "v_cache"))


@_kvcache_fp8.register_fake
def _kvcache_fp8_fake(q, k_cache, v_cache, k_scale, v_scale, k_new, v_new, block_table, cache_seqlens,
                      softmax_scale, causal, window_left, window_right, softcap, num_splits):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v_cache.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


def _cu(name, t):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t, dtype=torch.int32)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected an int32 tensor, got {t.dtype}")
    return t


def forward(q, k, v, cu_q, cu_k, scale, causal, window, softcap, deterministic):
    args = (q, k, v, _cu("cu_seqlens_q", cu_q), _cu("cu_seqlens_k", cu_k), float(scale), bool(causal), window[0],
            window[1], float(softcap), deterministic)
    return (_fwd_body if _plain_eager(args) else _fwd)(*args)


def _descale(name, d, q, shape):
    """Checks a descale tensor: float32, on q's device, of `shape` (sequences, heads_kv)."""
    if d is None:
        return None
    if not isinstance(d, torch.Tensor):
        raise ValueError(f"{name}: expected a float32 tensor of shape {shape}, got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32, got {d.dtype}")
    if d.device != q.device:
        raise ValueError(f"{name}: on {d.device}, q on {q.device}")
    if tuple(d.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} (sequences, heads_kv), got {tuple(d.shape)}")
    return d


def forward_fp8(q, k, v, cu_q, cu_k, descales, out_dtype, scale, causal, window, softcap):
    """float8_e4m3fn q, k, v; `descales` (q, k, v) tensors or None; `out_dtype` "bf16" or "fp16"."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, q on {q.device}")
    cu_q, cu_k = _cu("cu_seqlens_q", cu_q), _cu("cu_seqlens_k", cu_k)
    sequences = q.shape[0] if cu_q is None else cu_q.shape[0] - 1
    shape = (sequences, k.shape[-2])
    ds = [_descale(n, d, q, shape) for n, d in zip(("q_descale", "k_descale", "v_descale"), descales)]
    args = (q, k, v, cu_q, cu_k, *ds, float(scale), bool(causal), window[0], window[1], float(softcap), out_dtype)
    return (_fwd_fp8_body if _plain_eager(args) else _fwd_fp8)(*args)


def backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, window, softcap, deterministic):
    return _bwd(dout, q, k, v, out, lse, _cu("cu_seqlens_q", cu_q), _cu("cu_seqlens_k", cu_k), float(scale),
                bool(causal), window[0], window[1], float(softcap), deterministic)


def _kv_scale(name, s, cache):
    """An fp8 cache's scales as float32 ``(heads_kv,)`` on the cache's device, from a number or a
    float32 tensor of one element (one scale for every head, vLLM's per-tensor form) or of
    ``(heads_kv,)``. On CUDA this is device work on the current stream, no synchronisation."""
    hkv = cache.shape[-2]
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return torch.full((hkv,), float(s), dtype=torch.float32, device=cache.device)
    if not isinstance(s, torch.Tensor):
        raise ValueError(f"{name}: expected a float or a float32 tensor, got {type(s).__name__}")
    if s.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32, got {s.dtype}")
    if s.device != cache.device:
        raise ValueError(f"{name}: on {s.device}, the cache on {cache.device}")
    if s.dim() > 1 or s.numel() not in (1, hkv):
        raise ValueError(f"{name}: expected one value or (heads_kv,) = ({hkv},), got shape {tuple(s.shape)}")
    return s.reshape(-1).expand(hkv).contiguous()


def kvcache(q, k_cache, v_cache, k, v, block_table, cache_seqlens, scale, causal, window, softcap, num_splits,
            scales=None):
    """`scales`: (k_scale, v_scale) of an fp8 (float8_e4m3fn) cache, else None."""
    b = q.shape[0]
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache: a contiguous cache has one row per sequence ({b}), got {k_cache.shape[0]}")
        block_table = torch.arange(b, dtype=torch.int32).view(b, 1)
    elif not isinstance(block_table, torch.Tensor):
        block_table = torch.as_tensor(block_table, dtype=torch.int32)
    if block_table.dtype.is_floating_point:
        raise TypeError(f"block_table: expected an int32 tensor, got {block_table.dtype}")
    if cache_seqlens is None:
        cache_seqlens = torch.full((b,), k_cache.shape[1] * block_table.shape[-1], dtype=torch.int32)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32)
    elif not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.as_tensor(cache_seqlens, dtype=torch.int32)
    if cache_seqlens.dtype.is_floating_point:
        raise TypeError(f"cache_seqlens: expected an int32 tensor, got {cache_seqlens.dtype}")
    opts = (float(scale), bool(causal), window[0], window[1], float(softcap), num_splits)
    if scales is None:
        args = (q, k_cache, v_cache, k, v, block_table, cache_seqlens, *opts)
        op, body = _kvcache, _kvcache_body
    else:
        ks, vs = (_kv_scale(n, s, k_cache) for n, s in zip(("k_scale", "v_scale"), scales))
        args = (q, k_cache, v_cache, ks, vs, k, v, block_table, cache_seqlens, *opts)
        op, body = _kvcache_fp8, _kvcache_fp8_body
    if not _plain_eager(args):
        return op(*args)
    out = body(*args)
    if k is not None:
        # What the op's in-place layer does for its mutated arguments (a no-op on inference tensors).
        torch.autograd.graph.increment_version([k_cache, v_cache])
    return out


def _plain_eager(args):
    """Whether a call with these arguments may run its op's body directly instead of through
    PyTorch's dispatcher, whose custom-op layers cost about 50 µs of host time per call
    (docs/perf.md, "An fp8 cache"), more than a decode step's GPU time at one sequence: outside
    torch.compile's tracing (which needs the registered op and its fake), on plain tensors (no
    fake or other subclass, as under make_fx), none of which autograd records (the forward's
    backward is the op's; the paged op has none)."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in args:
        if isinstance(t, torch.Tensor) and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True
