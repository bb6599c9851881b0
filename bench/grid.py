"""fa4 beside its peers, every library timed the same way, in one run on one GPU.

Forward, bf16. Default shapes: the FlashAttention grid, 16k tokens (batch = 16384 / seqlen),
hidden 2048 (heads = 2048 / d), d = 64/128/256, seqlen 1k/4k/16k, causal and not; `--extra` adds
the shapes users run besides (GQA 32/8 heads d128 causal at 2k/4k/8k, odd lengths 2000 and
3000, 40 heads × d128). Peers: PyTorch SDPA with its cuDNN and FlashAttention-2 backends forced,
and FlashAttention-4 (CuTe DSL) when its wheels are importable.

Method (docs/perf.md, "fair grid"), the same for every library:
- untimed warm-up calls (JIT compilation, autotuning, handle creation stay out);
- a round = one CUDA event pair around `--calls` back-to-back calls, no synchronize inside, so
  a library's host launch path overlaps the previous call's kernel as in a model;
- `--rounds` rounds, interleaved: fa4, cuDNN, FA2, FA4-CuTe, fa4, … so clock and thermal drift
  hit all alike; fa4's rounds run in its own process (`fa4 bench --rounds-from-stdin`), one
  round per request, while this process waits;
- per library the median round and the spread between rounds, (max − min) / median;
- spread: the interquartile range over the median (one slow round, a clock dip, widens the
  min–max range of every library it hits but not this); grid.json keeps every round;
- verdict: "win" when fa4's median time is below the best peer's by more than the larger of the
  two spreads, "loss" when above by more than it, "tie" otherwise;
- FLOPs from fa4's `Problem::flops` (printed by fa4 for each shape), one count for every library;
- inputs rotate between several sets when one set (Q, K, V, O) is under twice the L2 cache (the
  grid's sets are 256 MiB: one set);
- per-call: one call and a synchronize between host clock reads (includes the host path), the
  median of `--rounds`, each after an untimed call (the switch between the fa4 process's GPU
  context and this one's would otherwise land on it), an extra column only;
- host enqueue: the host time to enqueue one call inside a round; where it reaches the GPU time
  per call, that library's round measures its host path, and only the ncu column says its kernel.

    python3 bench/grid.py --fa4 ./fa4 [--extra] [--only-extra] [--calls 10] [--rounds 9]
                          [--variant NAME="fa4 bench flags" ...]   (e.g. sm80="--kernel sm80")
    python3 bench/grid.py --from-json grid.json     (the table again, from the saved rounds)
    python3 bench/grid.py --ncu-peers LABELS.json [--shapes ...]   (under ncu: see bench/fair_grid.sh)
    python3 bench/grid.py --ncu-table FA4.csv PEERS.csv LABELS.json [--grid-json grid.json]

A --variant is one more fa4 process with extra flags, timed in the same interleaved rounds as
another column (it is not a peer: the verdict is the default fa4's). Writes grid.json and grid.md
(the table as markdown) under $OUT (or .).
"""
import argparse, csv, json, math, os, subprocess, sys, time, warnings

warnings.filterwarnings("ignore")

GRID = [(d, s, c) for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (0, 1)]
# d, seqlen, causal, batch, heads, kv_heads.
EXTRA = [(128, s, 1, 16384 // s, 32, 8) for s in (2048, 4096, 8192)]
EXTRA += [(128, 2000, c, 8, 16, 16) for c in (0, 1)] + [(128, 3000, c, 5, 16, 16) for c in (0, 1)]
EXTRA += [(128, 4096, c, 4, 40, 40) for c in (0, 1)]
MAX_INPUT_SETS = 16
PEERS = ("cudnn", "fa2", "fa4cute")


def full(shape):
    """(d, seqlen, causal[, batch, heads[, kv_heads]]) with the grid's defaults filled in."""
    d, s, c = shape[:3]
    b, h = shape[3:5] if len(shape) >= 5 else (16384 // s, 2048 // d)
    return (d, s, int(c), b, h, shape[5] if len(shape) == 6 else h)


def parse_shape(text):
    f = tuple(int(x) for x in text.split(","))
    if len(f) not in (3, 5, 6):
        raise SystemExit(f"--shapes: `{text}`: expected D,SEQLEN,CAUSAL[,BATCH,HEADS[,KV_HEADS]]")
    return full(f)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def stats(xs):
    """median, min, max, q1, q3 (linear interpolation, as fa4's Spread)."""
    s = sorted(xs)
    def at(f):
        x = f * (len(s) - 1)
        lo, hi = math.floor(x), math.ceil(x)
        return s[lo] + (s[hi] - s[lo]) * (x - lo)
    return dict(median=at(0.5), min=s[0], max=s[-1], q1=at(0.25), q3=at(0.75), n=len(s))


def verdict(ours, best):
    """win / tie / loss of fa4 against the best peer (both `stats` of ms per call)."""
    spread = max((ours["q3"] - ours["q1"]) / ours["median"], (best["q3"] - best["q1"]) / best["median"])
    rel = best["median"] / ours["median"] - 1  # > 0: fa4 faster
    return ("win" if rel > spread else "loss" if rel < -spread else "tie"), spread


def input_sets(set_bytes, l2_bytes):
    return max(1, min(MAX_INPUT_SETS, -(-2 * l2_bytes // set_bytes)))


def peer_fns(torch, F, sdpa_kernel, SDPBackend, fa4cute, causal, gqa):
    """name -> (context manager factory, call(q, k, v)) with q, k, v in (batch, seq, heads, d)."""
    import contextlib
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=gqa)
    fns = {"cudnn": (lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), sdpa),
           "fa2": (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]), sdpa)}
    if fa4cute is not None:
        fns["fa4cute"] = (contextlib.nullcontext, lambda q, k, v: fa4cute(q, k, v, causal=causal))
    return fns


def load_torch():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4cute
    except Exception as ex:
        print(f"FlashAttention-4 (CuTe) not importable: {type(ex).__name__}: {ex}", flush=True)
        fa4cute = None
    return torch, F, sdpa_kernel, SDPBackend, fa4cute


class Fa4:
    """fa4 bench --rounds-from-stdin: one shape at a time, one round per request."""

    def __init__(self, binary, shapes, warmup, extra):
        specs = [",".join(str(x) for x in sh) for sh in shapes]
        cmd = [binary, "bench", "--backend", "cuda", "--dtype", "bf16", "--rounds-from-stdin",
               "--warmup", str(warmup), *extra, "--grid", *specs]
        print("$", " ".join(cmd), flush=True)
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def _read(self):
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"fa4 bench ended early (rc={self.p.wait()}); its error is above")
        return json.loads(line)

    def ready(self):
        return self._read()

    def ask(self, what):
        """`round N` -> (GPU ms per call, host ms to enqueue one); `call` -> ms."""
        self.p.stdin.write(what + "\n")
        self.p.stdin.flush()
        r = self._read()
        return (r["ms"], r["host_ms"]) if "host_ms" in r else r["ms"]

    def next(self):
        self.p.stdin.write("next\n")
        self.p.stdin.flush()


def timed_grid(a, shapes):
    torch, F, sdpa_kernel, SDPBackend, fa4cute = load_torch()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"{props.name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"L2 {l2 >> 20} MiB; {a.rounds} interleaved rounds of {a.calls} back-to-back calls, "
          f"{a.warmup} warm-up calls", flush=True)
    fa4s = {"fa4": Fa4(a.fa4, shapes, a.warmup, a.fa4_flags)}
    for v in a.variant:
        name, _, flags = v.partition("=")
        fa4s[name] = Fa4(a.fa4, shapes, a.warmup, flags.split() + a.fa4_flags)
    rows = []
    for shape in shapes:
        d, s, c, b, h, hkv = shape
        heads = {n: p.ready() for n, p in fa4s.items()}
        head = heads["fa4"]
        assert (head["d"], head["seqlen"], head["batch"], head["heads"], head["kv_heads"], int(head["causal"])) == \
            (d, s, b, h, hkv, c), (head, shape)
        flops = head["flops"]
        set_bytes = 2 * (2 * b * s * h * d + 2 * b * s * hkv * d)
        n_sets = input_sets(set_bytes, l2)
        sets = []
        for _ in range(n_sets):
            q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16)
            sets.append((q, k, v))
        fns = peer_fns(torch, F, sdpa_kernel, SDPBackend, fa4cute, bool(c), h != hkv)
        first = {}
        live = {}
        for name, (ctx, fn) in fns.items():
            try:
                with ctx():
                    t0 = time.time()
                    fn(*sets[0])
                    torch.cuda.synchronize()
                    first[name] = time.time() - t0
                    for i in range(a.warmup):
                        fn(*sets[i % n_sets])
                    torch.cuda.synchronize()
                live[name] = (ctx, fn)
            except Exception as ex:  # a backend that refuses a shape
                print(f"  {name} refuses d{d} s{s} c{c} b{b} h{h}/{hkv}: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                torch.cuda.synchronize()

        def peer_round(ctx, fn):
            with ctx():
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t0 = time.perf_counter()
                for i in range(a.calls):
                    fn(*sets[i % n_sets])
                host = (time.perf_counter() - t0) * 1e3 / a.calls
                e1.record()
                torch.cuda.synchronize()
                return e0.elapsed_time(e1) / a.calls, host

        def peer_call(ctx, fn):
            # An untimed call first, as fa4's `call`: it takes the GPU context switch back
            # from the fa4 process, a few hundred µs that the timed call should not carry.
            with ctx():
                fn(*sets[0])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(*sets[0])
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) * 1e3

        order = list(fa4s) + [n for n in PEERS if n in live]
        rounds = {n: [] for n in order}
        hosts = {n: [] for n in order}
        calls = {n: [] for n in order}
        for _ in range(a.rounds):
            for n in order:
                ms, host = fa4s[n].ask(f"round {a.calls}") if n in fa4s else peer_round(*live[n])
                rounds[n].append(ms)
                hosts[n].append(host)
        for _ in range(a.rounds):
            for n in order:
                calls[n].append(fa4s[n].ask("call") if n in fa4s else peer_call(*live[n]))
        for p in fa4s.values():
            p.next()
        r = dict(d=d, seqlen=s, batch=b, heads=h, kv_heads=hkv, causal=bool(c), flops=flops,
                 kernel={n: x["kernel"] for n, x in heads.items()}, input_sets=n_sets,
                 fa4_input_sets=head["input_sets"], variants=list(fa4s)[1:],
                 first_call_s={**{n: x["first_call_s"] for n, x in heads.items()}, **first})
        for n in order:
            r[n] = dict(per_call_ms=stats(calls[n])["median"], host_enqueue_ms=stats(hosts[n])["median"],
                        rounds_ms=rounds[n])
        summarise(r)
        rows.append(r)
        print_row(r)
        del sets
        torch.cuda.empty_cache()
    for p in fa4s.values():
        p.p.stdin.close()
        p.p.wait()
    return rows


def summarise(r):
    """Fills in a row's statistics, best peer, ratio and verdict from its rounds."""
    for n in ["fa4"] + r.get("variants", []) + list(PEERS):
        if n in r:
            st = stats(r[n]["rounds_ms"])
            r[n].update(ms=st, tflops=r["flops"] / st["median"] / 1e9, spread=(st["q3"] - st["q1"]) / st["median"],
                        range=(st["max"] - st["min"]) / st["median"])
    peers = [n for n in PEERS if n in r]
    best = min(peers, key=lambda n: r[n]["ms"]["median"]) if peers else None
    if best:
        r["best"] = best
        r["ratio"] = r["fa4"]["tflops"] / r[best]["tflops"]
        r["verdict"], r["spread"] = verdict(r["fa4"]["ms"], r[best]["ms"])


def tf(r, n):
    return r[n]["tflops"] if n in r else float("nan")


def print_row(r):
    cols = ("fa4",) + tuple(r.get("variants", [])) + PEERS
    print(f"{r['d']:>4} {r['seqlen']:>6} {r['batch']:>3} {r['heads']:>3}/{r['kv_heads']:<3} {int(r['causal']):>2} "
          + " ".join(f"{n}:{tf(r, n):>4.0f} ±{100 * r[n]['spread'] if n in r else float('nan'):>4.1f}%" for n in cols)
          + f"  {r.get('best', '-'):>7} {r.get('ratio', float('nan')):>5.3f} {100 * r.get('spread', float('nan')):>5.1f}% "
          + f"{r.get('verdict', '-'):>4}  per-call ms " + " ".join(f"{r[n]['per_call_ms'] if n in r else float('nan'):.3f}" for n in cols)
          + "  host enqueue µs " + " ".join(f"{1e3 * r[n].get('host_enqueue_ms', float('nan')) if n in r else float('nan'):.0f}" for n in cols),
          flush=True)


def markdown(rows):
    variants = rows[0].get("variants", []) if rows else []
    out = ["| d | seqlen × batch | heads (q/kv) | causal | fa4 | " + "".join(f"{v} | " for v in variants)
           + "cuDNN | FA2 | FA4-CuTe | best | ratio | spread | verdict | per-call ms fa4 / best (host path incl.) |",
           "|---|---|---|---|---|" + "---|" * len(variants) + "---|---|---|---|---|---|---|---|"]
    names = {"cudnn": "cuDNN", "fa2": "FA2", "fa4cute": "FA4-CuTe"}
    for r in rows:
        f = lambda n: f"{tf(r, n):.0f}" if n in r else "–"
        best = r.get("best")
        out.append(f"| {r['d']} | {r['seqlen']} × {r['batch']} | {r['heads']}/{r['kv_heads']} | {'yes' if r['causal'] else 'no'} | "
                   f"{f('fa4')} | " + "".join(f"{f(v)} | " for v in variants) + f"{f('cudnn')} | {f('fa2')} | {f('fa4cute')} | {f(best) + ' (' + names[best] + ')' if best else '–'} | "
                   f"{r.get('ratio', float('nan')):.2f} | {100 * r.get('spread', float('nan')):.1f}% | {r.get('verdict', '–')} | "
                   f"{r['fa4']['per_call_ms']:.3f} / {r[best]['per_call_ms'] if best else float('nan'):.3f} |")
    on_grid = lambda r: r["heads"] * r["d"] == 2048 and r["batch"] * r["seqlen"] == 16384 and r["heads"] == r["kv_heads"]
    for what, sel in (("grid", [r for r in rows if on_grid(r)]), ("other", [r for r in rows if not on_grid(r)])):
        ratios = [r["ratio"] for r in sel if "ratio" in r]
        if ratios:
            g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            v = [r.get("verdict") for r in sel]
            out.append(f"\n{what}: geomean ratio {g:.3f} over {len(ratios)} shapes (min {min(ratios):.2f}, max {max(ratios):.2f}); "
                       f"{v.count('win')} win, {v.count('tie')} tie, {v.count('loss')} loss")
    return "\n".join(out)


# ---- kernel-only durations under Nsight Compute ----------------------------------------------

MARK_CYCLES = 1000


def ncu_peers(a, shapes):
    """Runs under ncu (--profile-from-start off): per shape and peer, warm-ups outside the
    profiled window, then 3 calls inside it, each followed by torch.cuda._sleep (a kernel named
    spin_kernel) as a marker: a call's kernels are those since the previous marker (nothing runs
    between two windows), so the table step can tell which kernels belong to which call."""
    torch, F, sdpa_kernel, SDPBackend, fa4cute = load_torch()
    dev = torch.device("cuda")
    labels = []
    for shape in shapes:
        d, s, c, b, h, hkv = shape
        q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16)
        for name, (ctx, fn) in peer_fns(torch, F, sdpa_kernel, SDPBackend, fa4cute, bool(c), h != hkv).items():
            try:
                with ctx():
                    for _ in range(3):
                        fn(q, k, v)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    for _ in range(3):
                        fn(q, k, v)
                        torch.cuda._sleep(MARK_CYCLES)
                        labels.append(dict(lib=name, shape=list(shape)))
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
            except Exception as ex:
                print(f"ncu-peers: {name} refuses {shape}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
        del q, k, v
    write(a.ncu_peers, json.dumps(labels))


def read_ncu_csv(path):
    """(kernel name, duration ns) in launch order from `ncu --csv --page raw --print-units base`."""
    rows, hdr = [], None
    with open(path, errors="replace") as f:
        lines = [l for l in f if not l.startswith("==")]
    for rec in csv.reader(lines):
        if hdr is None:
            if "Kernel Name" in rec and "gpu__time_duration.sum" in rec:
                hdr = rec
            continue
        row = dict(zip(hdr, rec))
        try:
            rows.append((row["Kernel Name"], float(row["gpu__time_duration.sum"].replace(",", ""))))
        except ValueError:
            pass  # the units row
    return rows


def ncu_table(a):
    fa4_csv, peers_csv, labels_path = a.ncu_table
    out = {}
    # fa4: `fa4 bench --warmup 1 --reps 3 --calls 1` launches 1 + 3 + 3 kernels per shape, in
    # the order of --shapes; the warm-up one is left out.
    k = [t for n, t in read_ncu_csv(fa4_csv) if n.startswith("fa4_fwd")]
    per = 7
    if len(k) != per * len(a.ncu_shapes):
        print(f"ncu-table: {len(k)} fa4 kernels for {len(a.ncu_shapes)} shapes, expected {per} each", file=sys.stderr)
    for i, shape in enumerate(a.ncu_shapes):
        ts = k[i * per + 1:(i + 1) * per]
        if ts:
            out.setdefault(tuple(shape), {})["fa4"] = stats([t / 1e3 for t in ts])["median"]
    # Peers: kernels between spin_kernel markers, summed per call.
    labels = read_json(labels_path)
    groups, cur = [], []
    for n, t in read_ncu_csv(peers_csv):
        if "spin_kernel" in n:
            groups.append(cur)
            cur = []
        else:
            cur.append((n, t))
    if len(groups) != len(labels):
        print(f"ncu-table: {len(groups)} marked peer calls for {len(labels)} labels", file=sys.stderr)
    per_call = {}
    for lab, g in zip(labels, groups):
        per_call.setdefault((tuple(lab["shape"]), lab["lib"]), []).append((sum(t for _, t in g) / 1e3, [n[:60] for n, _ in g]))
    for (shape, lib), v in per_call.items():
        out.setdefault(shape, {})[lib] = stats([t for t, _ in v])["median"]
        out[shape].setdefault("names", {})[lib] = v[0][1]
    lines = ["| d | seqlen × batch | heads | causal | fa4 µs | cuDNN µs | FA2 µs | FA4-CuTe µs | fa4 / best peer (time ratio, > 1 = faster) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape, v in out.items():
        d, s, c, b, h, hkv = shape
        peers = [v[n] for n in PEERS if n in v]
        ratio = min(peers) / v["fa4"] if peers and "fa4" in v else float("nan")
        f = lambda n: f"{v[n]:.0f}" if n in v else "–"
        lines.append(f"| {d} | {s} × {b} | {h}/{hkv} | {'yes' if c else 'no'} | {f('fa4')} | {f('cudnn')} | {f('fa2')} | {f('fa4cute')} | {ratio:.2f} |")
    text = "\n".join(lines)
    print(text)
    for shape, v in out.items():
        print(shape, json.dumps(v.get("names", {})))
    od = os.environ.get("OUT", ".")
    write(os.path.join(od, "ncu.md"), text + "\n")
    write(os.path.join(od, "ncu.json"), json.dumps({",".join(map(str, s)): v for s, v in out.items()}, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fa4", help="path to the fa4 binary")
    ap.add_argument("--shapes", nargs="*", type=parse_shape, help="D,SEQLEN,CAUSAL[,BATCH,HEADS[,KV_HEADS]]")
    ap.add_argument("--extra", action="store_true", help="add the GQA, odd-length and 40-head shapes")
    ap.add_argument("--only-extra", action="store_true", help="only those")
    ap.add_argument("--calls", type=int, default=10, help="back-to-back calls per round (≥ 10 for the method)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per library (≥ 7)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[], help='NAME="fa4 bench flags": one more fa4 column')
    ap.add_argument("--from-json", metavar="GRID.json", help="print the table again from saved rounds")
    ap.add_argument("--fa4-flags", nargs=argparse.REMAINDER, default=[], help="more fa4 bench flags (last)")
    ap.add_argument("--ncu-peers", metavar="LABELS.json", help="profiled-process mode (run under ncu)")
    ap.add_argument("--ncu-table", nargs=3, metavar=("FA4.csv", "PEERS.csv", "LABELS.json"))
    a = ap.parse_args()
    if a.shapes:
        shapes = a.shapes
    else:
        shapes = [] if a.only_extra else [full(x) for x in GRID]
        shapes += [full(x) for x in EXTRA] if (a.extra or a.only_extra) else []
    if a.ncu_peers:
        return ncu_peers(a, shapes)
    if a.ncu_table:
        a.ncu_shapes = shapes
        return ncu_table(a)
    if a.from_json:
        rows = read_json(a.from_json)
        for r in rows:
            summarise(r)
            print_row(r)
        print(markdown(rows))
        return
    if not a.fa4:
        ap.error("--fa4 is required to time")
    if a.calls < 1 or a.rounds < 1 or a.warmup < 0:
        ap.error("--calls and --rounds must be ≥ 1, --warmup ≥ 0")
    print(f"{'d':>4} {'seqlen':>6} {'b':>3} {'h/kv':>7} {'c':>2} " + " ".join(f"{n:>14}" for n in ("fa4",) + PEERS)
          + f"  {'best':>7} {'ratio':>5} {'spread':>6} verdict (TFLOP/s ±spread)", flush=True)
    rows = timed_grid(a, shapes)
    od = os.environ.get("OUT", ".")
    write(os.path.join(od, "grid.json"), json.dumps(rows, indent=1))
    md = markdown(rows)
    write(os.path.join(od, "grid.md"), md + "\n")
    print(md)


if __name__ == "__main__":
    main()
