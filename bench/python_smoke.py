#!/usr/bin/env python3
"""One small call of each fa4 Python entry point on the GPU (fixed-length and varlen forward,
autograd backward, paged decode with an append), for compute-sanitizer:

    compute-sanitizer --tool memcheck python3 bench/python_smoke.py

Checks nothing itself beyond finiteness; python/tests/test_torch.py holds the correctness tests.
"""
import torch

import fa4


def main():
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)
    outs = []
    for d in (64, 96, 128):
        q, k, v = (rnd(2, 200, 4, d).requires_grad_() for _ in range(3))
        out = fa4.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        outs.append(out)
    cu = torch.tensor([0, 50, 173], dtype=torch.int32)
    qv = rnd(173, 4, 128)
    outs.append(fa4.flash_attn_varlen_func(qv, qv, qv, cu, cu, 123, 123, causal=True))
    kc, vc = rnd(9, 16, 2, 128), rnd(9, 16, 2, 128)
    table = torch.tensor([[3, 1, 7], [0, 2, 8]], dtype=torch.int32)
    outs.append(
        fa4.flash_attn_with_kvcache(
            rnd(2, 1, 8, 128), kc, vc, k=rnd(2, 1, 2, 128), v=rnd(2, 1, 2, 128),
            cache_seqlens=torch.tensor([20, 5], dtype=torch.int32), block_table=table,
        )
    )
    torch.cuda.synchronize()
    bad = [i for i, o in enumerate(outs) if not torch.isfinite(o.float()).all()]
    print("python_smoke:", "non-finite outputs in calls", bad if bad else "none")


if __name__ == "__main__":
    main()
