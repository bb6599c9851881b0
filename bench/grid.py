"""fa4 beside its peers on the FlashAttention grid, measured in one run on one GPU.

Forward, bf16, 16k tokens (batch = 16384 / seqlen), hidden 2048 (heads = 2048 / head_dim),
d = 64/128/256, seqlen 1k/4k/16k, causal and not. Peers: PyTorch SDPA with the FlashAttention-2
and cuDNN backends forced, and FlashAttention-4 (CuTe DSL) when its wheels are importable.
FLOPs = 4·b·h·s²·d, halved for causal; every number is the median of event-timed runs.

    python3 bench/grid.py --fa4 ./fa4 [--d 128] [--s 4096] [--reps 30]
                          [--variant NAME=lazy,overlap,pingpong,persistent,poly ...]
                          [--variant NAME@D=block_n,wgs,stages,preg,creg,lazy,overlap,pingpong,persistent,poly]

A --variant also runs the Hopper kernel as an extra column: NAME=flags takes the planner's tiles
for each head dim (`fa4 plan --arch sm90 --json`) with these switches; NAME@D=tiles runs the
given tiles at head dim D only; --with-sm80 adds the Ampere-class kernel. The peers are measured
once for all columns.

fa4's numbers come from `fa4 bench --backend cuda --json` on the same shapes, run first; the
table and a JSON file (under $OUT, or .) come last.
"""
import argparse, json, os, subprocess, sys, warnings

warnings.filterwarnings("ignore")
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from flash_attn.cute.interface import flash_attn_func as fa4cute
except Exception:
    fa4cute = None

ap = argparse.ArgumentParser()
ap.add_argument("--fa4", required=True, help="path to the fa4 binary")
ap.add_argument("--d", type=int, nargs="*", default=[64, 128, 256])
ap.add_argument("--s", type=int, nargs="*", default=[1024, 4096, 16384])
ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
ap.add_argument("--reps", type=int, default=30)
ap.add_argument("--variant", action="append", default=[], help="NAME=lazy,overlap,pingpong,persistent,poly")
ap.add_argument("--with-sm80", action="store_true", help="add a column for the Ampere-class kernel (--kernel sm80)")
ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more fa4 bench flags")
a = ap.parse_args()

shapes = [(d, s, c) for d in a.d for s in a.s for c in a.causal]


def fa4_bench(shapes, extra):
    cmd = [a.fa4, "bench", "--backend", "cuda", "--json", "--reps", str(a.reps), "--dtype", "bf16", "--grid"]
    cmd += [f"{d},{s},{c}" for d, s, c in shapes] + extra
    print("$", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stdout, res.stderr, file=sys.stderr)
        sys.exit(res.returncode)
    return {(r["d"], r["seqlen"], int(r["causal"])): r["tflops"] for r in json.loads(res.stdout)}


ours = {"fa4": fa4_bench(shapes, a.extra)}
if a.with_sm80:
    ours["sm80"] = fa4_bench(shapes, ["--kernel", "sm80"] + a.extra)
def planned_tiles(d):
    plan = json.loads(subprocess.run([a.fa4, "plan", "--arch", "sm90", "--depth", str(d), "--json"],
                                     capture_output=True, text=True, check=True).stdout)["tiles"]
    return ",".join(str(plan[k]) for k in ("block_n", "consumer_wgs", "stages", "producer_regs", "consumer_regs"))


for v in a.variant:
    name, spec = v.split("=")
    name, only = (name.split("@")[0], int(name.split("@")[1])) if "@" in name else (name, None)
    ours.setdefault(name, {})
    for d in a.d:
        if only is not None and d != only:
            continue
        tiles = spec if only is not None else f"{planned_tiles(d)},{spec}"
        ours[name].update(fa4_bench([x for x in shapes if x[0] == d], ["--kernel", "sm90", "--sm90-tiles", tiles] + a.extra))

dev = torch.device("cuda")
torch.manual_seed(0)


def bench(fn, iters, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


rows = []
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
cols = list(ours)
hdr = f"{'d':>4} {'seqlen':>6} {'b':>3} {'causal':>6} " + " ".join(f"{n:>9}" for n in cols)
hdr += f" {'fa2':>7} {'cudnn':>7} {'fa4cute':>8} {'best peer':>10} " + " ".join(f"{'/' + n:>9}" for n in cols)
print(hdr)
for d, s, c in shapes:
    h, b = 2048 // d, 16384 // s
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fl = 4 * b * h * s * s * d / (2 if c else 1)
    r = dict(d=d, seqlen=s, batch=b, heads=h, causal=bool(c), **{n: ours[n].get((d, s, c), float("nan")) for n in cols})
    for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                r[name] = fl / bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(c)), a.reps) / 1e9
        except Exception as ex:  # a backend that refuses a shape
            r[name] = float("nan")
    r["fa4cute"] = fl / bench(lambda: fa4cute(q, k, v, causal=bool(c)), a.reps) / 1e9 if fa4cute else float("nan")
    peers = [r[n] for n in ("fa2", "cudnn", "fa4cute") if r[n] == r[n]]
    r["best_peer"] = max(peers)
    r["ratio"] = r["fa4"] / r["best_peer"]
    rows.append(r)
    line = f"{d:>4} {s:>6} {b:>3} {c:>6} " + " ".join(f"{r[n]:>9.0f}" for n in cols)
    line += f" {r['fa2']:>7.0f} {r['cudnn']:>7.0f} {r['fa4cute']:>8.0f} {r['best_peer']:>10.0f} "
    line += " ".join(f"{r[n] / r['best_peer']:>9.2f}" for n in cols)
    print(line, flush=True)
    del q, k, v, qt, kt, vt
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "grid.json"), "w"), indent=1)
