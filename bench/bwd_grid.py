"""fa4's GPU backward beside PyTorch SDPA's (cuDNN and FlashAttention-2 backends forced), timed
the same way in one run on one GPU: bf16, 16k tokens (batch = 16384 / seqlen), hidden 2048
(heads = 2048 / d).

Method (as bench/grid.py's fair grid): warm-up calls untimed; a round is one CUDA event pair
around --calls back-to-back backward calls; --rounds rounds interleaved, round r starting at the
r-th library (fa4, cuDNN, FA2, … then cuDNN, FA2, …, fa4), so each takes each place alike;
the median round per library and the interquartile spread. fa4 runs in its own process
(`examples/bwd_bench.rs`, one request per round). A peer's backward call is
`torch.autograd.grad(O, (Q, K, V), dO, retain_graph=True)` on a forward recorded once: the
backward kernels (dO·O preprocess, main, dQ convert) and the gradient allocations, as fa4's
call. FLOPs = 2.5 × fa4's `Problem::flops` (causal halved), one count for every library.

    python3 bench/bwd_grid.py --fa4 ./bwd_bench [--shapes 128,16384,0 ...] [--calls 10] [--rounds 7]
        [--alt-env "FA4_BWD_KERNEL=sm80 ..." ...]  (more fa4 processes with that environment, interleaved)
        [--bin NAME=PATH ...]             (other fa4 builds' bwd_bench, interleaved: A/B of kernels)

FlashAttention-4 (CuTe DSL) is a fourth peer (column fa4cute) when `flash_attn.cute` imports (see
bench/device_session.sh for carrying its wheels to the device): its `flash_attn_func` on
(batch, seqlen, heads, d) copies of the same inputs, backward through autograd as for SDPA.
`--no-fa4cute` leaves it out.
"""
import argparse, functools, json, os, subprocess, sys

GRID = [(d, s, c) for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (0, 1)]


def stats(xs):
    xs = sorted(xs)
    def at(f):
        i = f * (len(xs) - 1)
        lo = int(i)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)
    return {"median": at(0.5), "q1": at(0.25), "q3": at(0.75), "min": xs[0], "max": xs[-1]}


def timed_round(torch, call, calls):
    """A peer's round: `call` warmed up (3 untimed calls), then a function timing one CUDA event
    pair around `calls` back-to-back calls, in ms per call."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()

    def rnd():
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        st.record()
        for _ in range(calls):
            call()
        en.record()
        torch.cuda.synchronize()
        return st.elapsed_time(en) / calls
    return rnd


def round_order(names, r):
    """The libraries' order in round r: the list rotated to start at its (r mod len)-th entry."""
    first = r % len(names)
    return names[first:] + names[:first]


def parse_bins(specs):
    """--bin NAME=PATH values as (name, path) pairs; a ValueError naming the bad value."""
    out = []
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--bin {spec!r}: expected NAME=PATH")
        out.append((name, path))
    return out


def parse_env(spec):
    """An --alt-env value (space-separated KEY=VALUE pairs) as a dict; a ValueError naming it."""
    env = {}
    for kv in spec.split():
        key, eq, val = kv.partition("=")
        if not eq or not key:
            raise ValueError(f"--alt-env {spec!r}: expected KEY=VALUE pairs, got {kv!r}")
        env[key] = val
    if not env:
        raise ValueError(f"--alt-env {spec!r}: expected KEY=VALUE pairs")
    return env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fa4", required=True)
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--det", action="store_true", help="also time fa4's deterministic mode")
    ap.add_argument("--tiles", default=None,
                    help="also time fa4 with FA4_BWD_TILES=block_m,block_n,dsplit (column 'fa4 t')")
    ap.add_argument("--alt-env", action="append", default=[],
                    help="also time fa4 in a process with these KEY=VALUE pairs (space-separated) in its "
                         "environment (column 'alt', or alt1, alt2, … when repeated), e.g. FA4_BWD_KERNEL=sm80")

    ap.add_argument("--bin", action="append", default=[],
                    help="NAME=PATH: also time this bwd_bench (another build) in the same rounds, column NAME")
    ap.add_argument("--no-fa4cute", action="store_true", help="leave FlashAttention-4 (CuTe) out")
    a = ap.parse_args()
    try:
        bins = parse_bins(a.bin)
        alt_envs = [parse_env(spec) for spec in a.alt_env]
    except ValueError as ex:
        ap.error(str(ex))
    for name, path in bins:
        if not os.access(path, os.X_OK):
            ap.error(f"--bin {name}={path}: {path} is not an executable file")
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else GRID
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fa4cute = None
    if not a.no_fa4cute:
        try:
            from flash_attn.cute.interface import flash_attn_func as fa4cute
        except Exception as ex:
            print(f"FlashAttention-4 (CuTe) not importable: {type(ex).__name__}: {ex}", flush=True)
    fa4 = subprocess.Popen([a.fa4], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    fa4d = subprocess.Popen([a.fa4], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1) if a.det else None
    fa4t = subprocess.Popen([a.fa4], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                            env=dict(os.environ, FA4_BWD_TILES=a.tiles)) if a.tiles else None
    extra = {}
    for i, (spec, alt) in enumerate(zip(a.alt_env, alt_envs)):
        env = dict(os.environ, **alt)
        name = "alt" if len(a.alt_env) == 1 else f"alt{i + 1}"
        print(f"column {name}: {a.fa4} with {spec}", flush=True)
        extra[name] = subprocess.Popen([a.fa4], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                       env=env)
    for name, path in bins:
        extra[name] = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(p, line):
        p.stdin.write(line + "\n")
        p.stdin.flush()
        r = p.stdout.readline()
        if not r:
            raise SystemExit(f"bwd_bench ended early (rc={p.wait()})")
        return r.split()

    results = []
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} | {'fa4':>7} {'fa4 det':>7} {'fa4 t':>7} {'cudnn':>7} {'fa2':>7} {'fa4cute':>7} "
          + "".join(f"{n:>10} " for n in extra) + "| TFLOP/s  (spread: IQR/median)", flush=True)
    for d, s, c in shapes:
        b, h = 16384 // s, 2048 // d
        libs = {}
        flops = float(ask(fa4, f"shape {d} {s} {c} {b} {h} 0")[1])
        libs["fa4"] = lambda: float(ask(fa4, f"round {a.calls}")[0])
        if fa4d is not None:
            ask(fa4d, f"shape {d} {s} {c} {b} {h} 1")
            libs["fa4 det"] = lambda: float(ask(fa4d, f"round {a.calls}")[0])
        if fa4t is not None:
            ask(fa4t, f"shape {d} {s} {c} {b} {h} 0")
            libs["fa4 t"] = lambda: float(ask(fa4t, f"round {a.calls}")[0])
        for name, proc in extra.items():
            ask(proc, f"shape {d} {s} {c} {b} {h} 0")
            libs[name] = lambda proc=proc: float(ask(proc, f"round {a.calls}")[0])
        torch.manual_seed(0)
        mk = lambda: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = mk(), mk(), mk()
        do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(c))
                libs[name] = timed_round(torch, functools.partial(torch.autograd.grad, o, (q, k, v), do,
                                                                  retain_graph=True), a.calls)
            except Exception as ex:
                print(f"{name} d{d} s{s} c{c}: {type(ex).__name__}: {ex}", flush=True)
        if fa4cute is not None:
            try:
                # FlashAttention-4 takes (batch, seqlen, heads, d): copies of the same values.
                qc, kc, vc = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
                doc = do.transpose(1, 2).contiguous()
                r = fa4cute(qc, kc, vc, causal=bool(c))
                oc = r[0] if isinstance(r, tuple) else r
                libs["fa4cute"] = timed_round(torch, functools.partial(torch.autograd.grad, oc, (qc, kc, vc), doc,
                                                                       retain_graph=True), a.calls)
            except Exception as ex:
                print(f"fa4cute d{d} s{s} c{c}: {type(ex).__name__}: {ex}", flush=True)
        rounds = {n: [] for n in libs}
        # Round r starts at library r (mod their count): each takes each place in the order
        # equally often, so that what a library's predecessor leaves behind (a hot GPU, lower
        # clocks) falls on all of them alike. On the H200 the place alone moved a figure by up to
        # 11% (fourteenth session, docs/perf.md).
        for r in range(a.rounds):
            for n in round_order(list(libs), r):
                rounds[n].append(libs[n]())
        st = {n: stats(r) for n, r in rounds.items()}
        tf = {n: flops / (x["median"] * 1e-3) / 1e12 for n, x in st.items()}
        sp = {n: (x["q3"] - x["q1"]) / x["median"] for n, x in st.items()}
        cell = lambda n: f"{tf[n]:7.1f}" if n in tf else f"{'-':>7}"
        print(f"{d:>4} {s:>6} {c:>6} | {cell('fa4')} {cell('fa4 det')} {cell('fa4 t')} {cell('cudnn')} {cell('fa2')} {cell('fa4cute')} "
              + "".join(f"{tf[n]:10.1f} " if n in tf else f"{'-':>10} " for n in extra) + "| "
              + " ".join(f"{n} {sp[n]:.1%}" for n in sp), flush=True)
        results.append({"d": d, "seqlen": s, "causal": c, "batch": b, "heads": h, "flops": flops,
                        "rounds_ms": rounds, "tflops": tf})
        del q, k, v, do
        libs.clear()
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "bwd_grid.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
