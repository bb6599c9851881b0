#!/usr/bin/env python3
"""fa4 against fa4: kernel variants, tile choices, builds and environments, interleaved on one
GPU. No peers here (bench/peers.py times fa4 beside them).

Forward, through `fa4 bench` (one process per variant and round):
    python3 bench/sweep.py --fa4 DIR/fa4 [--rounds 2] [--reps 20] [--kernel sm90|sm80]
                           [--bin NAME=PATH ...] [--warm N] NAME@D=TILES ...
  TILES is `plan` (the planner's choice per shape, as `fa4 bench --kernel sm90` makes it) or the
  ten fields of `--sm90-tiles` (block_n,wgs,stages,preg,creg,lazy,overlap,pingpong,persistent,
  poly), thirteen (then longest_first,tma_store,cross_tile), fourteen (then dynamic) or fifteen
  (then uniform_desc); with `--kernel sm80`, the eight fields of `--tiles`. `--bin NAME=PATH`
  runs variant NAME with another fa4 binary (an A/B of two builds: `--bin new=DIR/fa4-new
  plan@256=plan new@256=plan`). Every variant runs the six shapes of its head dim (seqlen
  1k/4k/16k × causal 0/1, bf16, 16k tokens, hidden 2048), or with `--lengths L,L,...` one
  packed varlen batch of those lengths × causal 0/1 (`fa4 bench --lengths`; e.g.
  `bench/peers.py lengths`: the ragged batch of docs/perf.md).
  `--warm N` first runs every variant once, N processes at a time, so that NVRTC compiles the
  variants in parallel into the disk cache (FA4_CACHE_DIR) instead of inside the first round.
  Table: each variant's median over rounds in TFLOP/s and its ratio to `plan` of its head dim.
  Writes sweep.json under $OUT.

Backward, through examples/bwd_bench (one long-lived process per column, one round per request):
    python3 bench/sweep.py --backward --bwd-bench DIR/bwd_bench [--rounds 7] [--calls 10]
                           [--shapes D,SEQLEN,CAUSAL ...] [--bin NAME=PATH ...]
                           [--env NAME="KEY=VALUE ..." ...] [--det]
  Columns: fa4 (the --bwd-bench binary), each --bin (another build's bwd_bench), each --env
  (the binary with that environment, e.g. sm80="FA4_BWD_KERNEL=sm80"), `det` (deterministic
  mode) with --det. Shapes default to the grid (d 64/128/256 × 1k/4k/16k × causal; bf16, 16k
  tokens, hidden 2048). A round is one event pair around --calls back-to-back calls inside the
  column's process; rounds are rotated (round r starts at column r, bench/peers.py's
  round_order). Table: TFLOP/s (2.5 × the forward's FLOPs) ± IQR spread, ratio to fa4.
  Writes sweep-bwd.json under $OUT.

Both are fa4-only Rust processes with host paths of about 10 µs, so running them side by side
times kernels; a Python peer in another process would not be timed fairly that way
(bench/README.md, "what decode_peers.py measured").
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import GRID_DIMS, GRID_SEQLENS, HIDDEN, TOKENS, iqr_spread, round_order, stats  # noqa: E402


def parse_variant(text):
    """NAME@D=TILES as (name, d, tiles); a ValueError naming the text."""
    head, eq, tiles = text.partition("=")
    name, at, d = head.partition("@")
    if not eq or not at or not name or not tiles or not d.isdigit():
        raise ValueError(f"variant {text!r}: expected NAME@D=TILES")
    return name, int(d), tiles


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
    """An --env value NAME="KEY=VALUE ..." as (name, {key: value}); a ValueError naming it."""
    name, eq, rest = spec.partition("=")
    env = {}
    for kv in rest.split():
        key, eq2, val = kv.partition("=")
        if not eq2 or not key:
            raise ValueError(f"--env {spec!r}: expected NAME=\"KEY=VALUE ...\", got {kv!r}")
        env[key] = val
    if not eq or not name or not env:
        raise ValueError(f"--env {spec!r}: expected NAME=\"KEY=VALUE ...\"")
    return name, env


def parse_shape(text):
    """D,SEQLEN,CAUSAL as (d, seqlen, causal, batch, heads) on the grid's 16k tokens, hidden 2048."""
    f = text.split(",")
    if len(f) != 3 or not all(x.isdigit() for x in f) or f[2] not in ("0", "1"):
        raise ValueError(f"--shapes {text!r}: expected D,SEQLEN,CAUSAL")
    d, s, c = (int(x) for x in f)
    if HIDDEN % d or TOKENS % s:
        raise ValueError(f"--shapes {text!r}: D must divide {HIDDEN} and SEQLEN {TOKENS}")
    return d, s, c, TOKENS // s, HIDDEN // d


# ---- forward: fa4 bench processes ----------------------------------------------------------


def bench_cmd(a, bins, name, d, tiles, reps):
    cmd = [bins.get(name, a.fa4), "bench", "--backend", "cuda", "--kernel", a.kernel, "--dtype", "bf16", "--json",
           "--reps", str(reps), "--grid"] + [f"{d},{s},{c}" for s in a.seqlens for c in (0, 1)]
    if a.lengths:
        # The lengths replace each shape's sequences; its SEQLEN (a.seqlens: 2048) only sets the
        # heads through --hidden.
        cmd += ["--lengths", a.lengths]
    if tiles != "plan":
        cmd += ["--sm90-tiles" if a.kernel == "sm90" else "--tiles", tiles]
    return cmd


def forward(a):
    variants = [parse_variant(v) for v in a.variants]
    bins = dict(parse_bins(a.bin))
    if a.warm > 0:
        t0 = time.time()
        pending = [bench_cmd(a, bins, n, d, t, 1) + ["--warmup", "1", "--calls", "1"] for n, d, t in variants]
        running = []
        while pending or running:
            while pending and len(running) < a.warm:
                running.append(subprocess.Popen(pending.pop(0), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            running[0].wait()
            running = [p for p in running if p.poll() is None]
        print(f"warm: {len(variants)} variants compiled in {time.time() - t0:.0f} s", flush=True)
    results = {}  # (name, d) -> {(seqlen, causal): [tflops per round]}
    for rnd in range(a.rounds):
        for name, d, tiles in round_order(variants, rnd):
            res = subprocess.run(bench_cmd(a, bins, name, d, tiles, a.reps), capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{name}@{d} round {rnd}: rc {res.returncode}: {res.stderr.strip()[-300:]}", flush=True)
                continue
            got = results.setdefault((name, d), {})
            runs = json.loads(res.stdout)
            for r in runs:
                seqlen = a.seqlens[0] if a.lengths else r["seqlen"]  # varlen: the longest, one column
                got.setdefault((seqlen, int(r["causal"])), []).append(r["tflops"])
            # As it goes, so that a run cut short still says what it measured.
            print(f"round {rnd} {name}@{d}: " + " ".join(f"{r['tflops']:.0f}" for r in runs), flush=True)
    cols = [(s, c) for s in a.seqlens for c in (0, 1)]
    label = (lambda s, c: f"vl{'c' if c else ' '}") if a.lengths else (lambda s, c: f"{s // 1024}k{'c' if c else ' '}")
    print(f"{'variant':<16} {'d':>4} " + " ".join(label(s, c).rjust(7) for s, c in cols)
          + "   ratio to plan")
    rows = []
    for name, d, tiles in variants:
        got = results.get((name, d), {})
        med = {k: statistics.median(v) for k, v in got.items()}
        bmed = {k: statistics.median(v) for k, v in results.get(("plan", d), {}).items()}
        line = f"{name:<16} {d:>4} " + " ".join(f"{med[k]:>7.0f}" if k in med else f"{'-':>7}" for k in cols)
        line += "  " + " ".join(f"{med[k] / bmed[k]:>5.2f}" if k in med and k in bmed else f"{'-':>5}" for k in cols)
        print(line)
        rows.append(dict(name=name, d=d, tiles=tiles, tflops={f"{s},{c}": got.get((s, c), []) for s, c in cols}))
    with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if results else 1


# ---- backward: bwd_bench processes ---------------------------------------------------------


class BwdBench:
    """One examples/bwd_bench process: `shape` sets a problem up, `round` times one round."""

    def __init__(self, name, path, env=None):
        self.name = name
        self.p = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                  env=dict(os.environ, **(env or {})))

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        r = self.p.stdout.readline()
        if not r:
            raise RuntimeError(f"{self.name}: bwd_bench ended (rc {self.p.wait()}) after `{line}`")
        return r.split()

    def close(self):
        self.p.stdin.close()
        self.p.wait()
        self.p.stdout.close()


def bwd_columns(a):
    """[(column name, bwd_bench path, environment, deterministic)]."""
    cols = [("fa4", a.bwd_bench, {}, 0)]
    cols += [(n, p, {}, 0) for n, p in parse_bins(a.bin)]
    cols += [(n, a.bwd_bench, env, 0) for n, env in (parse_env(s) for s in a.env)]
    if a.det:
        cols.append(("det", a.bwd_bench, {}, 1))
    names = [c[0] for c in cols]
    if len(set(names)) != len(names):
        raise ValueError(f"column names must differ: {', '.join(names)}")
    return cols


def backward(a):
    cols = bwd_columns(a)
    shapes = [parse_shape(s) for s in a.shapes] if a.shapes else \
        [(d, s, c, TOKENS // s, HIDDEN // d) for d in GRID_DIMS for s in GRID_SEQLENS for c in (0, 1)]
    procs = {}
    for name, path, env, det in cols:
        procs[name] = (BwdBench(name, path, env), det)
        if env:
            print(f"column {name}: {path} with {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
    names = [c[0] for c in cols]
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} | " + " ".join(f"{n:>14}" for n in names)
          + " | TFLOP/s ± IQR/median; ratio to fa4", flush=True)
    rows = []
    try:
        for d, s, c, b, h in shapes:
            flops = None
            for name, (p, det) in procs.items():
                ready = p.ask(f"shape {d} {s} {c} {b} {h} {det}")
                flops = float(ready[1])
            rounds = {n: [] for n in names}
            for r in range(a.rounds):
                for n in round_order(names, r):
                    rounds[n].append(float(procs[n][0].ask(f"round {a.calls}")[0]))
            st = {n: stats(v) for n, v in rounds.items()}
            tf = {n: flops / (x["median"] * 1e-3) / 1e12 for n, x in st.items()}
            cell = lambda n: f"{tf[n]:7.1f} ±{100 * iqr_spread(st[n]):4.1f}%"
            ratio = " ".join(f"{n} {st['fa4']['median'] / st[n]['median']:.3f}" for n in names[1:])
            print(f"{d:>4} {s:>6} {c:>6} | " + " ".join(f"{cell(n):>14}" for n in names) + f" | {ratio}", flush=True)
            rows.append(dict(d=d, seqlen=s, causal=c, batch=b, heads=h, flops=flops, rounds_ms=rounds, tflops=tf))
    finally:
        for p, _ in procs.values():
            p.close()
        with open(os.path.join(os.environ.get("OUT", "."), "sweep-bwd.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backward", action="store_true", help="A/B of the backward through bwd_bench")
    ap.add_argument("--fa4", default="target/device/fa4", help="forward: the fa4 binary")
    ap.add_argument("--bwd-bench", help="backward: the bwd_bench binary (examples/bwd_bench.rs)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (forward 2, backward 7)")
    ap.add_argument("--reps", type=int, default=20, help="forward: fa4 bench --reps")
    ap.add_argument("--calls", type=int, default=10, help="backward: back-to-back calls per round")
    ap.add_argument("--seqlens", default="1024,4096,16384", help="forward: seqlens per head dim")
    ap.add_argument("--lengths", default=None, help="forward: one packed varlen batch of these lengths (L,L,...)")
    ap.add_argument("--kernel", default="sm90", choices=["sm80", "sm90"])
    ap.add_argument("--bin", action="append", default=[], help="NAME=PATH: another build's binary")
    ap.add_argument("--env", action="append", default=[], help='backward: NAME="KEY=VALUE ...": one more column')
    ap.add_argument("--det", action="store_true", help="backward: also the deterministic mode")
    ap.add_argument("--shapes", nargs="*", help="backward: D,SEQLEN,CAUSAL (default: the grid)")
    ap.add_argument("--warm", type=int, default=0, help="forward: compile every variant first, N at a time")
    ap.add_argument("variants", nargs="*", help="forward: NAME@D=TILES (TILES: plan, ten, thirteen, fourteen or fifteen fields)")
    a = ap.parse_args(argv)
    a.seqlens = [2048] if a.lengths else [int(s) for s in a.seqlens.split(",")]
    if a.lengths is not None and not all(x.strip().isdigit() for x in a.lengths.split(",")):
        ap.error(f"--lengths {a.lengths!r}: expected comma-separated whole numbers")
    try:
        if a.backward:
            if not a.bwd_bench:
                ap.error("--backward needs --bwd-bench PATH")
            a.rounds = a.rounds or 7
            bwd_columns(a)
            for s in a.shapes or []:
                parse_shape(s)
            for _, path, _, _ in bwd_columns(a):
                if not os.access(path, os.X_OK):
                    ap.error(f"{path} is not an executable file")
            return backward(a)
        if not a.variants:
            ap.error("give variants NAME@D=TILES (or --backward)")
        a.rounds = a.rounds or 2
        for v in a.variants:
            parse_variant(v)
        parse_bins(a.bin)
    except ValueError as ex:
        ap.error(str(ex))
    return forward(a)


if __name__ == "__main__":
    sys.exit(main())
