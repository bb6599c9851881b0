"""cuDNN (PyTorch SDPA, contiguous cache) on the issue's decode grid, timed as
examples/decode_bench.rs times fa4: bf16, 32 query / 8 KV heads (GQA through enable_gqa), d128;
one event pair around 10 back-to-back calls, the median of 9 rounds, caches rotated over enough
copies that a round reads more than 400 MB. Prints seqlen_q | batch | keys | us/call | TB/s."""
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CALLS, ROUNDS, ROTATE = 10, int(sys.argv[1]) if len(sys.argv) > 1 else 9, 4e8
HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 32768), (8, 8192), (8, 32768), (32, 4096), (4, 131072)]
print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
print("backend | sq | batch | keys | us/call | TB/s | spread")
for backend, name in [(SDPBackend.CUDNN_ATTENTION, "cudnn")]:
    for sq in (1, 4):
        for b, sk in SHAPES:
            kv_bytes = 2 * b * sk * HKV * D * 2
            copies = max(2, math.ceil(ROTATE / kv_bytes))
            q = torch.randn(b, HQ, sq, D, device="cuda", dtype=torch.bfloat16)
            ks = [torch.randn(b, HKV, sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            vs = [torch.randn(b, HKV, sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            # seqlen_q 4: causal aligned bottom-right (the new rows are the last keys' positions),
            # which SDPA's is_causal (top-left) is not: an explicit mask, made once.
            mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq) if sq > 1 else None
            try:
                with sdpa_kernel([backend]):
                    def call(i):
                        return F.scaled_dot_product_attention(q, ks[i % copies], vs[i % copies], attn_mask=mask, enable_gqa=True)
                    for i in range(3):
                        call(i)
                    torch.cuda.synchronize()
                    times, n = [], 0
                    for _ in range(ROUNDS):
                        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        for _ in range(CALLS):
                            n += 1
                            call(n)
                        e.record()
                        torch.cuda.synchronize()
                        times.append(a.elapsed_time(e) * 1e3 / CALLS)
                times.sort()
                med = times[len(times) // 2]
                print(f"{name} | {sq} | {b} | {sk} | {med:.1f} | {kv_bytes / (med * 1e-6) / 1e12:.2f} | {times[0]:.1f}-{times[-1]:.1f}", flush=True)
            except Exception as ex:  # a backend that refuses a shape says so
                print(f"{name} | {sq} | {b} | {sk} | refused: {str(ex).splitlines()[0][:100]}", flush=True)
            del ks, vs
            torch.cuda.empty_cache()
