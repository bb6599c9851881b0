#!/usr/bin/env python3
"""Host time per call of the Python package's paged decode (`flash_attn_with_kvcache`), split by
stage, beside the GPU time of the same calls: what a serving loop's host pays per layer, and
whether the GPU is kept fed.

    python3 bench/py_host_time.py [--batch 1] [--keys 32768] [--page 16] [--calls 200]

On one CUDA device, bf16 queries, 32/8 heads, d128, one query row, the block table and lengths
on the CPU (the package's no-synchronisation form). For the bf16 cache and an e4m3 cache with a
scale per KV head it prints, in µs per call:

- `host`: the wall time of `calls` back-to-back calls (the host's enqueue rate);
- `gpu`: one CUDA event pair around `calls` back-to-back calls queued behind a GPU sleep
  long enough to hold them all (the kernels' own rate);
- `gpu, no head start`: the same without the sleep (host-bound where host > gpu);
- the stages of one call (Python argument handling, the table's bytes, the extension's call)
  timed apart, and the top of a cProfile of the calls.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

import fa4
from fa4 import _torch as ft


def per_call_us(f, calls):
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def gpu_us(f, calls, head_start_us):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    f()
    torch.cuda.synchronize()
    if head_start_us > 0:
        torch.cuda._sleep(int(head_start_us * 1.98e3))  # ~cycles at 1.98 GHz
    a.record()
    for _ in range(calls):
        f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    hq, hkv, d = 32, 8, 128
    b, sk, p = a.batch, a.keys, a.page
    torch.manual_seed(0)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, 1, hq, d, **dev)
    k16 = torch.randn(b * sk // p, p, hkv, d, **dev)
    v16 = torch.randn(b * sk // p, p, hkv, d, **dev)
    k8, v8 = k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
    ks = torch.ones(hkv, device="cuda")
    table = torch.randperm(b * sk // p, dtype=torch.int32).view(b, sk // p)
    seqlens = torch.full((b,), sk, dtype=torch.int32)
    calls = {
        "bf16 cache": lambda: fa4.flash_attn_with_kvcache(q, k16, v16, cache_seqlens=seqlens, block_table=table),
        "fp8 cache": lambda: fa4.flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, block_table=table, k_scale=ks, v_scale=ks),
    }
    print(f"{torch.cuda.get_device_name()}: batch {b}, {sk} keys, page {p}, {hq}/{hkv} heads, d{d}; "
          f"µs per call over {a.calls} calls")
    for name, f in calls.items():
        host = per_call_us(f, a.calls)
        g = gpu_us(f, a.calls, 1.5 * host * a.calls)
        g0 = gpu_us(f, a.calls, 0)
        print(f"{name:<11} host {host:8.1f}   gpu {g:8.1f}   gpu, no head start {g0:8.1f}")
    # The stages of one fp8 call, timed apart.
    n = a.calls
    stages = {
        "_paged_host_args": lambda: ft._paged_host_args(q, table, seqlens),
        "_kv_scale x2": lambda: (ft._kv_scale("k_scale", ks, k8), ft._kv_scale("v_scale", ks, v8)),
        "_paged_outputs": lambda: ft._paged_outputs(q, v8),
        "_paged_dev_args": lambda: ft._paged_dev_args(q, k8, v8, None, None),
        "torch op fa4::kvcache_fp8": lambda: torch.ops.fa4.kvcache_fp8(
            q, k8, v8, ks, ks, None, None, table, seqlens, d ** -0.5, False, -1, -1, 0.0, 0),
        "whole call": calls["fp8 cache"],
    }
    for name, f in stages.items():
        print(f"  stage {name:<28} {per_call_us(f, n):8.1f}")
    # The extension alone, arguments prepared once.
    tb, sl = ft._paged_host_args(q, table, seqlens)
    out, lse = ft._paged_outputs(q, v8)
    qa, ka, va, new, _held = ft._paged_dev_args(q, k8, v8, None, None)
    sc = [(ks.data_ptr(), ks.numel())] * 2
    ext = lambda: ft._fa4.paged_fp8_cuda(
        ft._index(q), ft._stream(q), "bf16", qa, ka, va, *sc, ft._dev(out)[1], lse.data_ptr(),
        tb, sl, None, None, False, (-1, -1), d ** -0.5, 0.0, 0)
    print(f"  stage {'extension alone':<28} {per_call_us(ext, n):8.1f}")
    tb16 = ft._paged_host_args(q, table, seqlens)[0]
    qa, ka, va, new, _held = ft._paged_dev_args(q, k16, v16, None, None)
    out16, lse16 = ft._paged_outputs(q, v16)
    ext16 = lambda: ft._fa4.paged_cuda(
        ft._index(q), ft._stream(q), "bf16", qa, ka, va, ft._dev(out16)[1], lse16.data_ptr(),
        tb16, sl, None, None, False, (-1, -1), d ** -0.5, 0.0, 0)
    print(f"  stage {'extension alone, bf16':<28} {per_call_us(ext16, n):8.1f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        calls["fp8 cache"]()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print("\n".join(s.getvalue().splitlines()[:40]))


if __name__ == "__main__":
    main()
