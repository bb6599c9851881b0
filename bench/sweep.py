#!/usr/bin/env python3
"""Kernel variants against the planner, interleaved, on the FlashAttention grid.

Run on the GPU machine from the repository root with the fa4 binary built on the host:
    python3 bench/sweep.py --fa4 .device/fa4 --rounds 2 NAME@D=TILES ...
TILES is `plan` (the planner's choice per shape, as `fa4 bench --kernel sm90` makes it) or the ten
fields of `--sm90-tiles` (block_n,wgs,stages,preg,creg,lazy,overlap,pingpong,persistent,poly);
with `--kernel sm80`, the eight fields of `--tiles`. `--bin NAME=PATH` runs variant NAME with
another fa4 binary (an A/B of two builds: `--bin new=.device/fa4-new plan@256=plan new@256=plan`).
Every variant runs the six shapes of its head dim (seqlen 1k/4k/16k × causal 0/1, bf16, 16k
tokens, hidden 2048); the list runs `--rounds` times in turn (A B C A B C), so a variant and its
baseline are measured at nearby moments, and the table gives each variant's median over rounds
in TFLOP/s and its ratio to the `plan` variant of the same head dim. No peers: this picks
between our own variants; bench/grid.py measures beside the peers. Writes sweep.json under $OUT.
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
ap.add_argument("variants", nargs="+", help="NAME@D=TILES (TILES: plan or ten fields)")
a = ap.parse_args()

variants = []
for v in a.variants:
    head, tiles = v.split("=", 1)
    name, d = head.split("@")
    variants.append((name, int(d), tiles))
seqlens = [int(s) for s in a.seqlens.split(",")]
bins = dict(b.split("=", 1) for b in a.bin)
tiles_flag = "--sm90-tiles" if a.kernel == "sm90" else "--tiles"
results = {}  # (name, d) -> {(seqlen, causal): [tflops per round]}
for rnd in range(a.rounds):
    for name, d, tiles in variants:
        cmd = [bins.get(name, a.fa4), "bench", "--backend", "cuda", "--kernel", a.kernel, "--dtype", "bf16", "--json",
               "--reps", str(a.reps), "--grid"] + [f"{d},{s},{c}" for s in seqlens for c in (0, 1)]
        if tiles != "plan":
            cmd += [tiles_flag, tiles]
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
