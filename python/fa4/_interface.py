"""FlashAttention's functions over fa4: argument checks, then numpy or torch dispatch.

Every check names the argument as the caller wrote it; what fa4 itself validates (shapes,
strides, GQA ratios, offsets, page tables) comes back from the extension as a ``ValueError``
naming the argument too.
"""

import json
import math
import sys

import numpy as np

from . import _fa4
from . import _numpy


def _is_torch(x):
    torch = sys.modules.get("torch")  # without torch imported, nothing is a torch tensor
    return torch is not None and isinstance(x, torch.Tensor)


def _kind(**arrays):
    """'torch' or 'numpy' for the given arrays (None entries skipped), or a TypeError naming the
    first that is neither or differs from the others."""
    kind = None
    first = None
    for name, a in arrays.items():
        if a is None:
            continue
        if _is_torch(a):
            k = "torch"
        elif isinstance(a, np.ndarray):
            k = "numpy"
        else:
            raise TypeError(f"{name}: expected a torch.Tensor or a numpy.ndarray, got {type(a).__name__}")
        if kind is None:
            kind, first = k, name
        elif k != kind:
            raise TypeError(f"{name}: a {k} array beside {first}, a {kind} one; pass all of one kind")
    return kind


def _common(dropout_p, alibi_slopes, window_size, softcap, softmax_scale):
    """Checks FlashAttention's shared arguments; returns (window, softcap, scale or None)."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: fa4 computes attention without dropout; got {dropout_p!r}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: fa4 does not compute ALiBi; pass None")
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (-1 = unbounded), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size: sides are >= 0 or -1 (unbounded), got {window_size!r}")
    try:
        softcap = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap: expected a float, got {softcap!r}") from None
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite value >= 0 (0 = none), got {softcap!r}")
    if softmax_scale is not None:
        try:
            softmax_scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise TypeError(f"softmax_scale: expected a float or None, got {softmax_scale!r}") from None
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale: expected a finite value, got {softmax_scale!r}")
    return (left, right), softcap, softmax_scale


def _scale(softmax_scale, q):
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _torch_ops():
    from . import _torch

    return _torch


def _is_fp8(x):
    """fp8 (e4m3) inputs: torch.float8_e4m3fn tensors; numpy uint8 (e4m3 bytes) or float8_e4m3fn."""
    if _is_torch(x):
        return _torch_ops().is_fp8(x)
    return isinstance(x, np.ndarray) and _numpy.is_fp8(x)


_OUT_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}


def _out_dtype(out_dtype):
    """O's dtype for fp8 inputs as "bf16" (the default) or "fp16": a torch or numpy dtype, or a
    name."""
    if out_dtype is None:
        return "bf16"
    name = out_dtype if isinstance(out_dtype, str) else str(out_dtype).replace("torch.", "")
    if name not in _OUT_NAMES:
        try:
            name = np.dtype(out_dtype).name
        except (TypeError, ValueError):
            pass
    try:
        return _OUT_NAMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"out_dtype: O of fp8 inputs is bfloat16 or float16, got {out_dtype!r}") from None


def _fp8_only(q, descales, out_dtype):
    """Whether q is fp8; descales and out_dtype with other inputs are a ValueError naming them."""
    if _is_fp8(q):
        return True
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        if d is not None:
            raise ValueError(f"{name}: descales are for fp8 inputs (float8_e4m3fn), q is {q.dtype}")
    if out_dtype is not None:
        raise ValueError(f"out_dtype: for fp8 inputs only; O of {q.dtype} inputs is {q.dtype}")
    return False


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
):
    """Attention over a fixed-length batch, as FlashAttention's ``flash_attn_func``.

    ``q`` ``(batch, seqlen_q, heads_q, head_dim)``, ``k`` ``(batch, seqlen_k, heads_kv,
    head_dim)``, ``v`` ``(batch, seqlen_k, heads_kv, head_dim_v)``, ``heads_q`` a multiple of
    ``heads_kv``. ``causal`` aligns the diagonal to the bottom-right corner; ``window_size``
    ``(left, right)`` keys around it (-1 unbounded). Returns ``out`` ``(batch, seqlen_q,
    heads_q, head_dim_v)``, or ``(out, softmax_lse, None)`` with ``return_attn_probs`` (LSE
    float32 ``(batch, heads_q, seqlen_q)``, natural log). Differentiable (torch), but for fp8.

    fp8 (e4m3) inputs, as FlashAttention-3's: ``q``, ``k``, ``v`` ``torch.float8_e4m3fn`` (numpy:
    ``uint8`` e4m3 bytes or ml_dtypes' ``float8_e4m3fn``), with ``q_descale``, ``k_descale``,
    ``v_descale`` float32 ``(batch, heads_kv)`` on q's device (None: ones): query head ``h`` of
    sequence ``b`` reads ``q_descale[b, h // (heads_q // heads_kv)] * q``, KV head ``hk`` reads
    ``k_descale[b, hk] * k`` and ``v_descale[b, hk] * v``. ``out`` is bfloat16, or float16 with
    ``out_dtype=torch.float16``. On the GPU, a Hopper GPU's kernel; descales are not read back,
    so one that is not finite and positive makes its rows NaN (the CPU checks them). No backward.
    """
    window, softcap, scale = _common(dropout_p, alibi_slopes, window_size, softcap, softmax_scale)
    kind = _kind(q=q, k=k, v=v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    scale = _scale(scale, q)
    descales = (q_descale, k_descale, v_descale)
    if _fp8_only(q, descales, out_dtype):
        out, lse = _fp8_forward(kind, q, k, v, None, None, descales, out_dtype, scale, causal, window, softcap)
    elif kind == "torch":
        out, lse = _torch_ops().forward(q, k, v, None, None, scale, causal, window, softcap, bool(deterministic))
    else:
        out, lse = _numpy.forward(q, k, v, None, None, scale, causal, window, softcap)
    return (out, lse, None) if return_attn_probs else out


def _fp8_forward(kind, q, k, v, cu_q, cu_k, descales, out_dtype, scale, causal, window, softcap):
    """The fp8 forward of torch tensors or numpy arrays: (out, lse)."""
    out_dtype = _out_dtype(out_dtype)
    if kind == "torch":
        return _torch_ops().forward_fp8(q, k, v, cu_q, cu_k, descales, out_dtype, scale, causal, window, softcap)
    return _numpy.forward_fp8(q, k, v, cu_q, cu_k, descales, out_dtype, scale, causal, window, softcap)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
):
    """Attention over a packed variable-length batch, as FlashAttention's
    ``flash_attn_varlen_func``.

    ``q`` ``(total_q, heads_q, head_dim)``, ``k``/``v`` ``(total_k, heads_kv, head_dim[_v])``;
    sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]`` (int32, ``batch + 1`` entries from 0).
    The offsets are validated on the host: CPU tensors cost nothing, CUDA ones are copied to
    the host (one synchronisation). ``max_seqlen_*`` are checked against the offsets. Returns
    ``out`` ``(total_q, heads_q, head_dim_v)``, or ``(out, softmax_lse, None)`` (LSE
    ``(heads_q, total_q)``). Differentiable (torch), but for fp8.

    fp8 inputs, descales and ``out_dtype`` as in :func:`flash_attn_func`, the descales
    ``(batch, heads_kv)`` with ``batch = len(cu_seqlens_q) - 1``.
    """
    if block_table is not None:
        raise ValueError("block_table: use flash_attn_with_kvcache for a paged cache")
    window, softcap, scale = _common(dropout_p, alibi_slopes, window_size, softcap, softmax_scale)
    kind = _kind(q=q, k=k, v=v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name}: expected (total, heads, head_dim), got shape {tuple(x.shape)}")
    cq = _offsets("cu_seqlens_q", cu_seqlens_q)
    ck = _offsets("cu_seqlens_k", cu_seqlens_k)
    for name, cu, m in (("max_seqlen_q", cq, max_seqlen_q), ("max_seqlen_k", ck, max_seqlen_k)):
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool):
            raise TypeError(f"{name}: expected an int, got {m!r}")
        if m < longest:
            raise ValueError(f"{name}: {m} is shorter than the longest sequence ({longest})")
    scale = _scale(scale, q)
    descales = (q_descale, k_descale, v_descale)
    if _fp8_only(q, descales, out_dtype):
        cu = (cu_seqlens_q, cu_seqlens_k) if kind == "torch" else (cq, ck)
        out, lse = _fp8_forward(kind, q, k, v, *cu, descales, out_dtype, scale, causal, window, softcap)
    elif kind == "torch":
        out, lse = _torch_ops().forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap, bool(deterministic)
        )
    else:
        out, lse = _numpy.forward(q, k, v, cq, ck, scale, causal, window, softcap)
    return (out, lse, None) if return_attn_probs else out


def _offsets(name, cu):
    """Host list of int offsets from a tensor, array or sequence (a CUDA tensor is copied)."""
    if cu is None:
        raise ValueError(f"{name}: required")
    if _is_torch(cu):
        if cu.dtype.is_floating_point or cu.dtype.is_complex:
            raise TypeError(f"{name}: expected an integer tensor, got {cu.dtype}")
        if cu.ndim != 1:
            raise ValueError(f"{name}: expected one dimension, got shape {tuple(cu.shape)}")
        return [int(x) for x in cu.tolist()]
    a = np.asarray(cu)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected a 1-D integer array, got {a.dtype} of shape {a.shape}")
    return [int(x) for x in a]


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    k_scale=None,
    v_scale=None,
):
    """Decode over a KV cache, as FlashAttention's ``flash_attn_with_kvcache``.

    ``q`` ``(batch, seqlen_q, heads_q, head_dim)``. Paged: ``k_cache``/``v_cache``
    ``(num_blocks, page_size, heads_kv, head_dim[_v])`` with ``block_table`` ``(batch,
    max_blocks)`` int32; contiguous: ``(batch, seqlen_cache, heads_kv, head_dim)`` without one.
    ``cache_seqlens`` (int or ``(batch,)``; default: the whole cache) counts each sequence's keys.
    With ``k``/``v`` ``(batch, seqlen_new, heads_kv, head_dim)`` the new rows are written into
    the cache at ``cache_seqlens`` first (in place) and attended too; ``cache_seqlens`` is not
    changed. ``block_table`` and ``cache_seqlens`` are validated on the host: CPU tensors cost
    nothing, CUDA ones are copied (one synchronisation). ``num_splits`` 0 lets fa4's planner
    choose. Returns ``out``, or ``(out, softmax_lse)`` with ``return_softmax_lse``.

    fp8 caches, as vLLM's ``kv_cache_dtype="fp8_e4m3"``: ``k_cache``/``v_cache``
    ``torch.float8_e4m3fn`` (numpy: ``uint8`` e4m3 bytes or ml_dtypes' ``float8_e4m3fn``) with
    ``k_scale``/``v_scale``: a float, or a float32 tensor (array) on the cache's device of one
    element (vLLM's per-tensor scale) or ``(heads_kv,)`` (one per KV head); None is 1. A stored
    value ``x`` of KV head ``h`` stands for ``k_scale[h] * x``. ``q``, ``k``, ``v`` and ``out``
    are bfloat16, float16 or (CPU) float32; new rows are quantized into the cache as
    ``k / k_scale[h]`` rounded to e4m3 (nearest, ties to even, saturating at +-448). The CPU
    checks the scales (finite, > 0); the GPU does not read them back.
    """
    for name, val in (
        ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin),
        ("cache_batch_idx", cache_batch_idx),
        ("cache_leftpad", cache_leftpad),
    ):
        if val is not None:
            raise ValueError(f"{name}: not supported by fa4; pass None")
    window, softcap, scale = _common(0.0, alibi_slopes, window_size, softcap, softmax_scale)
    kind = _kind(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    if (k is None) != (v is None):
        raise ValueError(("k" if k is None else "v") + ": give k and v together")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None and x.ndim != 4:
            raise ValueError(f"{name}: expected 4 dimensions, got shape {tuple(x.shape)}")
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0, got {num_splits!r}")
    batch = q.shape[0]
    scale = _scale(scale, q)
    scales = _fp8_cache(q, k_cache, v_cache, k_scale, v_scale)
    if kind == "torch":
        out, lse = _torch_ops().kvcache(
            q, k_cache, v_cache, k, v, block_table, cache_seqlens, scale, causal, window, softcap, int(num_splits),
            scales,
        )
        return (out, lse) if return_softmax_lse else out
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"k_cache: a contiguous cache has one row per sequence ({batch}), got {k_cache.shape[0]}"
            )
        table, max_blocks = np.arange(batch, dtype=np.int32).tobytes(), 1
    else:
        bt = np.asarray(block_table)
        if bt.ndim != 2 or not np.issubdtype(bt.dtype, np.integer):
            raise TypeError(f"block_table: expected a 2-D integer array, got {bt.dtype} of shape {bt.shape}")
        if bt.shape[0] != batch:
            raise ValueError(f"block_table: {bt.shape[0]} rows for a batch of {batch}")
        if bt.dtype != np.int32 and bt.size and (int(bt.max()) >= 2**31 or int(bt.min()) < -(2**31)):
            raise ValueError("block_table: entries beyond int32")
        table, max_blocks = np.ascontiguousarray(bt, dtype=np.int32).tobytes(), bt.shape[1]
    if cache_seqlens is None:
        seqlens = [k_cache.shape[1] * max_blocks] * batch
    elif isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        seqlens = [int(cache_seqlens)] * batch
    else:
        seqlens = _offsets("cache_seqlens", cache_seqlens)
        if len(seqlens) != batch:
            raise ValueError(f"cache_seqlens: {len(seqlens)} entries for a batch of {batch}")
    out, lse = _numpy.kvcache(
        q, k_cache, v_cache, k, v, (table, max_blocks), seqlens, scale, causal, window, softcap, int(num_splits),
        scales,
    )
    return (out, lse) if return_softmax_lse else out


def _fp8_cache(q, k_cache, v_cache, k_scale, v_scale):
    """For an fp8 (e4m3) cache, (k_scale, v_scale) as given (None: 1), checked by the torch or
    numpy layer; for another cache None, and scales given with it are a ValueError naming them."""
    if not _is_fp8(k_cache):
        if _is_fp8(v_cache):
            raise TypeError(f"v_cache: an fp8 cache holds K in fp8 too; k_cache is {k_cache.dtype}")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{name}: scales are for an fp8 (float8_e4m3fn) cache; k_cache is {k_cache.dtype}")
        return None
    if not _is_fp8(v_cache):
        raise TypeError(f"v_cache: k_cache is fp8 (e4m3), so v_cache must be too; got {v_cache.dtype}")
    if _is_fp8(q):
        raise TypeError(
            "q: the queries over an fp8 cache are bfloat16, float16 or float32; float8_e4m3fn queries take "
            "flash_attn_func and flash_attn_varlen_func"
        )
    return (1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale)


def flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
):
    """The backward as a function: ``(dq, dk, dv)`` of attention's output gradient ``dout``,
    given the forward's inputs, ``out`` and ``softmax_lse`` (with the forward's options).
    Fixed-length tensors as in :func:`flash_attn_func`, packed ones with ``cu_seqlens`` as in
    :func:`flash_attn_varlen_func`. ``deterministic`` gives the same bits every run."""
    window, softcap, scale = _common(0.0, None, window_size, softcap, softmax_scale)
    kind = _kind(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse)
    if _is_fp8(q):
        raise ValueError("q: fa4 has no backward for fp8 (float8_e4m3fn) inputs; the fp8 forward is for inference")
    scale = _scale(scale, q)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_k: give both cu_seqlens or neither")
    if kind == "torch":
        return _torch_ops().backward(
            dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap,
            bool(deterministic),
        )
    cq = None if cu_seqlens_q is None else _offsets("cu_seqlens_q", cu_seqlens_q)
    ck = None if cu_seqlens_k is None else _offsets("cu_seqlens_k", cu_seqlens_k)
    return _numpy.backward(dout, q, k, v, out, softmax_lse, cq, ck, scale, causal, window, softcap)


def plan(depth, num_q_heads=32, group=1, dtype="bf16", swizzle="128B"):
    """FA4Config (the SM100 planner of FlashAttention-4 kernels): its fields, constants and
    methods' results for one configuration, as a dict (``fa4 plan --json``)."""
    for name, val in (("depth", depth), ("num_q_heads", num_q_heads), ("group", group)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or not 0 <= val < 2**32:
            raise ValueError(f"{name}: expected a non-negative int, got {val!r}")
    return json.loads(_fa4.plan(int(depth), int(num_q_heads), int(group), str(dtype), str(swizzle)))


def combine(o_parts, lse_parts):
    """The exact merge of split-KV partial results: ``o_parts`` ``(n_splits, rows, dv)`` and
    ``lse_parts`` ``(n_splits, rows)`` (natural-log LSE of each part) into ``(out, lse)``,
    ``(rows, dv)`` and ``(rows,)``, float32 (numpy, or torch tensors on the CPU)."""
    was_torch = _is_torch(o_parts) or _is_torch(lse_parts)
    o = _numpy.as_f32("o_parts", o_parts)
    lse = _numpy.as_f32("lse_parts", lse_parts)
    if o.ndim != 3:
        raise ValueError(f"o_parts: expected (n_splits, rows, dv), got shape {o.shape}")
    if lse.ndim != 2:
        raise ValueError(f"lse_parts: expected (n_splits, rows), got shape {lse.shape}")
    n, rows, dv = o.shape
    out, l = _fa4.combine(o.tobytes(), lse.tobytes(), n, rows, dv)
    out = np.frombuffer(out, dtype=np.float32).reshape(rows, dv)
    l = np.frombuffer(l, dtype=np.float32).reshape(rows)
    if was_torch:
        import torch

        return torch.from_numpy(out), torch.from_numpy(l)
    return out, l


def build_info():
    """``{"version", "commit"}`` of the build."""
    version, commit = _fa4.build_info()
    return {"version": version, "commit": commit}


def cuda_status():
    """``(usable, why)``: whether a CUDA GPU and NVRTC are usable here, and what was found."""
    return _fa4.cuda_status()
