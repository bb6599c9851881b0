#!/usr/bin/env python3
"""Kernel variants against the planner, interleaved, on the FlashAttention grid.

Run on the GPU machine from the repository root with the fa4 binary built on the host:
    python3 bench/sweep.py --fa4 .device/fa4 --rounds 2 NAME@D=TILES ...
TILES is `plan` (the planner's choice per shape, as `fa4 bench --kernel sm90` makes it) or the ten
fields of `--sm90-tiles` (block_n,wgs,stages,preg,creg,lazy,overlap,pingpong,persistent,poly),
or thirteen (then longest_first,tma_store,cross_tile);
with `--kernel sm80`, the eight fields of `--tiles`. `--bin NAME=PATH` runs variant NAME with
another fa4 binary (an A/B of two builds: `--bin new=.device/fa4-new plan@256=plan new@256=plan`).
Every variant runs the six shapes of its head dim (seqlen 1k/4k/16k × causal 0/1, bf16, 16k
tokens, hidden 2048); the list runs `--rounds` times in turn (A B C A B C), so a variant and its
baseline are measured at nearby moments, and the table gives each variant's median over rounds
in TFLOP/s and its ratio to the `plan` variant of the same head dim. No peers: this picks
between our own variants; bench/grid.py measures beside the peers. Writes sweep.json under $OUT.
`--warm N` first runs every variant once (one call a shape, untimed), N processes at a time, so
that NVRTC compiles the variants in parallel into the disk cache (FA4_CACHE_DIR) instead of one
after another inside the first timed round.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--fa4", default=".device/fa4")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--reps", type=int, default=20)
ap.add_argument("--seqlens", default="1024,4096,16384")
ap.add_argument("--kernel", default="sm90", choices=["sm80", "sm90"])
ap.add_argument("--bin", action="append", default=[], help="NAME=PATH: fa4 binary of variant NAME")
ap.add_argument("--warm", type=int, default=0, help="compile every variant first, N processes at a time")
ap.add_argument("variants", nargs="+", help="NAME@D=TILES (TILES: plan, ten or thirteen fields)")
a = ap.parse_args()

variants = []
for v in a.variants:
    head, tiles = v.split("=", 1)
    name, d = head.split("@")
    variants.append((name, int(d), tiles))
seqlens = [int(s) for s in a.seqlens.split(",")]
bins = dict(b.split("=", 1) for b in a.bin)
tiles_flag = "--sm90-tiles" if a.kernel == "sm90" else "--tiles"


def bench_cmd(name, d, tiles, reps):
    cmd = [bins.get(name, a.fa4), "bench", "--backend", "cuda", "--kernel", a.kernel, "--dtype", "bf16", "--json",
           "--reps", str(reps), "--grid"] + [f"{d},{s},{c}" for s in seqlens for c in (0, 1)]
    if tiles != "plan":
        cmd += [tiles_flag, tiles]
    return cmd


if a.warm > 0:
    import time
    t0 = time.time()
    pending = [bench_cmd(name, d, tiles, 1) + ["--warmup", "1", "--calls", "1"] for name, d, tiles in variants]
    running = []
    while pending or running:
        while pending and len(running) < a.warm:
            running.append(subprocess.Popen(pending.pop(0), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        running[0].wait()
        running = [p for p in running if p.poll() is None]
    print(f"warm: {len(variants)} variants compiled in {time.time() - t0:.0f} s", flush=True)

results = {}  # (name, d) -> {(seqlen, causal): [tflops per round]}
for rnd in range(a.rounds):
    for name, d, tiles in variants:
        cmd = bench_cmd(name, d, tiles, a.reps)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{name}@{d} round {rnd}: rc {res.returncode}: {res.stderr.strip()[-300:]}", flush=True)
            continue
        got = results.setdefault((name, d), {})
        runs = json.loads(res.stdout)
        for r in runs:
            got.setdefault((r["seqlen"], int(r["causal"])), []).append(r["tflops"])
        # As it goes, so that a run cut short still says what it measured.
        print(f"round {rnd} {name}@{d}: " + " ".join(f"{r['tflops']:.0f}" for r in runs), flush=True)

cols = [(s, c) for s in seqlens for c in (0, 1)]
print(f"{'variant':<16} {'d':>4} " + " ".join(f"{s // 1024}k{'c' if c else ' '}".rjust(7) for s, c in cols)
      + "   ratio to plan")
rows = []
for name, d, tiles in variants:
    got = results.get((name, d), {})
    med = {k: statistics.median(v) for k, v in got.items()}
    base = results.get(("plan", d), {})
    bmed = {k: statistics.median(v) for k, v in base.items()}
    line = f"{name:<16} {d:>4} " + " ".join(f"{med[k]:>7.0f}" if k in med else f"{'-':>7}" for k in cols)
    line += "  " + " ".join(f"{med[k] / bmed[k]:>5.2f}" if k in med and k in bmed else f"{'-':>5}" for k in cols)
    print(line)
    rows.append(dict(name=name, d=d, tiles=tiles,
                     tflops={f"{s},{c}": got.get((s, c), []) for s, c in cols}))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w"), indent=1)
sys.exit(0 if results else 1)
