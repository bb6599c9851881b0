"""fa4's GPU decode beside cuDNN and FlashAttention-2 (PyTorch SDPA, contiguous cache), timed the
same way and interleaved round by round, on the issue's decode grid: bf16, 32 query / 8 KV
heads (GQA through enable_gqa), d128.

Method, the same for every library: a round is one CUDA event pair around 10 back-to-back
calls; caches rotate over enough copies that a round reads more than 400 MB (the L2 is 50 MB);
caches hold random values; untimed warm-up calls first. Each round runs every fa4 variant (one
`examples/decode_bench --serve` process, one request per round, which also takes one untimed
call first), then cuDNN, then FlashAttention-2, so that clock and thermal drift hit all alike.
Per library the median round and the spread (max − min) / median.

    python3 bench/decode_peers.py --fa4 PATH/decode_bench [--rounds 7] [--ab] [--json OUT.json]
        [--variants auto,plain,heads,heads+bulk,...] [--cases 16:1,64:1,...]

Cases: pages 16, 64 and 256 at seqlen_q 1, page 16 at seqlen_q 4 (causal, bottom-right: the
peers get an explicit mask, as SDPA's is_causal is top-left) and page 1 at seqlen_q 1. `--ab`
adds fa4 columns: the same calls on caches of zeros, and forced split counts. `--variants`
gives one fa4 column per kernel variant (`FA4_DECODE_VARIANT` values, sent per request, so one
process and the same buffers serve them all; `auto`, the default, is labelled `fa4`).
"""
import argparse, json, math, subprocess, sys, warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

warnings.filterwarnings("ignore")  # SDPA explains every backend it skips, once per shape

CALLS, ROTATE = 10, 4e8
HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 32768), (8, 8192), (8, 32768), (32, 4096), (4, 131072)]
PEERS = [(SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "fa2")]


def variants(page, sq, b, sk, ab, kernels=("auto",)):
    """(label, forced splits or 0, cache fill, kernel variant) of the fa4 columns."""
    out = [("fa4" if k == "auto" else k, 0, "random", k) for k in kernels]
    if not ab:
        return out
    # The same kernel on caches and queries of zeros (the last session's fill), and more splits
    # where the planner leaves SMs idle.
    out.append(("zeros", 0, "zeros", "auto"))
    if sq == 1 and page == 16 and (b, sk) in ((1, 32768), (8, 8192)):
        for s in (16, 32) if b == 1 else (4,):
            out.append((f"s{s}", s, "random", "auto"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fa4", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ab", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--cases", default="16:1,64:1,256:1,16:4,1:1", help="PAGE:SEQLEN_Q list")
    ap.add_argument("--variants", default="auto", help="FA4_DECODE_VARIANT values, comma-separated")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}", flush=True)
    fa4 = subprocess.Popen([a.fa4, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def fa4_round(page, sq, b, sk, splits, fill, kernel):
        fa4.stdin.write(f"{page} {sq} {b} {sk} {splits} {fill} {kernel}\n")
        fa4.stdin.flush()
        line = fa4.stdout.readline()
        if not line:
            sys.exit(f"decode_bench --serve ended (case {page} {sq} {b} {sk} {splits} {fill} {kernel})")
        s, us = line.split()
        return int(s), float(us)

    results = []
    cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
    for page, sq in cases:
        for b, sk in SHAPES:
            kv_bytes = 2 * b * sk * HKV * D * 2
            copies = max(2, math.ceil(ROTATE / kv_bytes))
            q = torch.randn(b, HQ, sq, D, device="cuda", dtype=torch.bfloat16)
            ks = [torch.randn(b, HKV, sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            vs = [torch.randn(b, HKV, sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq) if sq > 1 else None
            cols = {}
            splits = {}
            peer_calls = {}
            for backend, name in PEERS:
                n = [0]

                # The backend is chosen once per round (outside the timed calls): entering
                # sdpa_kernel costs host time that a model does not pay per call.
                def call(n=n):
                    n[0] += 1
                    return F.scaled_dot_product_attention(q, ks[n[0] % copies], vs[n[0] % copies], attn_mask=mask, enable_gqa=True)

                try:
                    with sdpa_kernel([backend]):
                        for _ in range(3):
                            call()
                    torch.cuda.synchronize()
                    peer_calls[name] = (backend, call)
                    cols[name] = []
                except Exception as ex:  # a backend that refuses a shape says so
                    cols[name] = f"refused: {str(ex).splitlines()[0][:80]}"
            vs_list = variants(page, sq, b, sk, a.ab, a.variants.split(","))
            for label, _, _, _ in vs_list:
                cols[label] = []
            for _ in range(a.rounds):
                for label, s, fill, kernel in vs_list:
                    splits[label], us = fa4_round(page, sq, b, sk, s, fill, kernel)
                    cols[label].append(us)
                for name, (backend, call) in peer_calls.items():
                    with sdpa_kernel([backend]):
                        call()  # untimed: the switch back from the fa4 process's context lands here
                        torch.cuda.synchronize()
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        for _ in range(CALLS):
                            call()
                        e1.record()
                        torch.cuda.synchronize()
                    cols[name].append(e0.elapsed_time(e1) * 1e3 / CALLS)
            row = {"page": page, "sq": sq, "batch": b, "keys": sk, "kv_bytes": kv_bytes, "splits": splits, "rounds": cols}
            results.append(row)
            parts = []
            for k, v in cols.items():
                if isinstance(v, str):
                    parts.append(f"{k} {v}")
                    continue
                t = sorted(v)
                med = t[len(t) // 2]
                sp = (t[-1] - t[0]) / med
                extra = f" s{splits[k]}" if k in splits else ""
                parts.append(f"{k}{extra} {med:.1f}us {kv_bytes / (med * 1e-6) / 1e12:.2f}TB/s ±{sp * 50:.0f}%")
            # Each fa4 column's median against cuDNN's (> 1: fa4 faster), the goal's measure.
            med = {k: sorted(v)[len(v) // 2] for k, v in cols.items() if not isinstance(v, str) and v}
            if "cudnn" in med:
                parts.append("vs cudnn: " + " ".join(f"{k} {med['cudnn'] / med[k]:.2f}x" for k in splits))
            print(f"page {page} sq {sq} b {b} keys {sk}: " + " | ".join(parts), flush=True)
            del ks, vs
            torch.cuda.empty_cache()
    fa4.stdin.close()
    fa4.wait()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
