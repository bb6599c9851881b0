"""The CPU path for numpy arrays (and, through them, CPU torch tensors).

Arrays cross to the extension as C-contiguous bytes and come back as bytearrays viewed as
arrays (``python/src/lib.rs``, "Host data"). bfloat16 arrays are ml_dtypes' ``bfloat16``
(what JAX and others use); float16 and float32 are numpy's own. numpy has no fp8 type: fp8
(e4m3) inputs are ``uint8`` arrays of e4m3 bytes, or ml_dtypes' ``float8_e4m3fn``.
"""

import numpy as np

from . import _fa4


def dtype_name(name, a):
    """fa4's name of an array's dtype, or a TypeError naming the argument."""
    dt = np.dtype(a.dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "fp16"
    if dt.name == "bfloat16":
        return "bf16"
    raise TypeError(f"{name}: fa4 computes float32, float16 and bfloat16, got {dt}")


def as_f32(name, a):
    if hasattr(a, "detach"):  # a CPU torch tensor
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"{name}: expected float32, got {a.dtype}")
    return np.ascontiguousarray(a)


def _same_dtype(**arrays):
    names = list(arrays)
    first = dtype_name(names[0], arrays[names[0]])
    for n in names[1:]:
        if arrays[n] is not None and dtype_name(n, arrays[n]) != first:
            raise TypeError(f"{n}: dtype {arrays[n].dtype} differs from {names[0]}'s {arrays[names[0]].dtype}")
    return first


def _arg(a):
    a = np.ascontiguousarray(a)
    return (a.tobytes(), list(a.shape))


def _view(buf, dtype, shape):
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def forward(q, k, v, cu_q, cu_k, scale, causal, window, softcap, threads=0):
    dt = _same_dtype(q=q, k=k, v=v)
    o, lse = _fa4.forward_cpu(dt, _arg(q), _arg(k), _arg(v), cu_q, cu_k, bool(causal), window, scale, softcap, threads)
    o_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if q.ndim == 4:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return _view(o, q.dtype, o_shape), _view(lse, np.float32, lse_shape)


def backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, window, softcap, threads=0):
    dt = _same_dtype(q=q, k=k, v=v, out=out, dout=dout)
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    dq, dk, dv = _fa4.backward_cpu(
        dt, _arg(q), _arg(k), _arg(v), _arg(out), lse.tobytes(), _arg(dout), cu_q, cu_k,
        bool(causal), window, scale, softcap, threads,
    )
    return _view(dq, q.dtype, q.shape), _view(dk, k.dtype, k.shape), _view(dv, v.dtype, v.shape)


def kvcache(q, k_cache, v_cache, k, v, table, seqlens, scale, causal, window, softcap, num_splits, scales=None,
            threads=0):
    """Returns (out, lse); with k/v the new rows are written into k_cache/v_cache in place.
    `scales`: (k_scale, v_scale) of an fp8 cache (uint8 e4m3 bytes or float8_e4m3fn), else None."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if k is not None and not c.flags.writeable:
            raise ValueError(f"{name}: read-only, but k and v are to be appended to it")
    new = (None if k is None else _arg(k), None if v is None else _arg(v))
    opts = (bool(causal), window, scale, softcap, num_splits, threads)
    if scales is None:
        dt = _same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
        parts = _fa4.paged_cpu(dt, _arg(q), _arg(k_cache), _arg(v_cache), table, seqlens, *new, *opts)
    else:
        dt = _same_dtype(q=q, k=k, v=v)
        hkv = k_cache.shape[-2]
        ks, vs = (kv_scale_bytes(n, s, hkv) for n, s in zip(("k_scale", "v_scale"), scales))
        caches = (_arg(c.view(np.uint8)) for c in (k_cache, v_cache))
        parts = _fa4.paged_fp8_cpu(dt, _arg(q), *caches, ks, vs, table, seqlens, *new, *opts)
    o, lse, kc, vc = parts
    if k is not None:
        k_cache[...] = _view(kc, k_cache.dtype, k_cache.shape)
        v_cache[...] = _view(vc, v_cache.dtype, v_cache.shape)
    o_shape = tuple(q.shape[:-1]) + (v_cache.shape[-1],)
    return _view(o, q.dtype, o_shape), _view(lse, np.float32, (q.shape[0], q.shape[2], q.shape[1]))


def kv_scale_bytes(name, s, heads_kv):
    """f32 bytes of `heads_kv` scales of an fp8 cache from a number or a float32 array of one
    element (one scale for every head) or of ``(heads_kv,)``."""
    if isinstance(s, (int, float, np.integer, np.floating)) and not isinstance(s, bool):
        return np.full(heads_kv, s, np.float32).tobytes()
    if not isinstance(s, np.ndarray):
        raise ValueError(f"{name}: expected a float or a float32 numpy array, got {type(s).__name__}")
    if s.dtype != np.float32:
        raise ValueError(f"{name}: expected float32, got {s.dtype}")
    if s.ndim > 1 or s.size not in (1, heads_kv):
        raise ValueError(f"{name}: expected one value or (heads_kv,) = ({heads_kv},), got shape {s.shape}")
    return np.broadcast_to(s.reshape(-1), (heads_kv,)).astype(np.float32).tobytes()


def is_fp8(a):
    """Whether a numpy array holds fp8 (e4m3) bytes: uint8, or ml_dtypes' float8_e4m3fn."""
    dt = np.dtype(a.dtype)
    return dt == np.uint8 or dt.name == "float8_e4m3fn"


def _fp8_arg(name, a):
    if not is_fp8(a):
        raise TypeError(f"{name}: q is fp8, so {name} must be too (uint8 e4m3 bytes or float8_e4m3fn); got {a.dtype}")
    return _arg(np.ascontiguousarray(a).view(np.uint8))


def out_type(out_dtype):
    """The numpy dtype of O for fp8 inputs ("bf16" or "fp16"); bfloat16 is ml_dtypes'."""
    if out_dtype == "fp16":
        return np.float16
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError(
            "out_dtype: O of fp8 inputs is bfloat16 by default, which numpy holds through ml_dtypes "
            "(not installed); install it or pass out_dtype=numpy.float16"
        ) from None
    return ml_dtypes.bfloat16


def descale_bytes(name, d, shape):
    """f32 bytes of a descale array of `shape` ``(sequences, heads_kv)``; None stays None."""
    if d is None:
        return None
    if not isinstance(d, np.ndarray):
        raise ValueError(f"{name}: expected a float32 numpy array of shape {shape}, got {type(d).__name__}")
    if d.dtype != np.float32:
        raise ValueError(f"{name}: expected float32, got {d.dtype}")
    if tuple(d.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} (sequences, heads_kv), got {tuple(d.shape)}")
    return np.ascontiguousarray(d).tobytes()


def forward_fp8(q, k, v, cu_q, cu_k, descales, out_dtype, scale, causal, window, softcap, threads=0):
    """fp8 (e4m3) inputs: `descales` (q, k, v) f32 arrays or None, `out_dtype` "bf16" or "fp16".
    Returns (out, lse) as forward's."""
    ot = out_type(out_dtype)
    args = [_fp8_arg(n, x) for n, x in (("q", q), ("k", k), ("v", v))]
    sequences = q.shape[0] if cu_q is None else len(cu_q) - 1
    shape = (sequences, k.shape[-2])
    ds = [descale_bytes(n, d, shape) for n, d in zip(("q_descale", "k_descale", "v_descale"), descales)]
    o, lse = _fa4.forward_fp8_cpu(out_dtype, *args, cu_q, cu_k, *ds, bool(causal), window, scale, softcap, threads)
    o_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if q.ndim == 4:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return _view(o, ot, o_shape), _view(lse, np.float32, lse_shape)
