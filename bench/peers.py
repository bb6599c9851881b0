#!/usr/bin/env python3
"""fa4 beside its peers: every library timed the same way, on the same tensors, in one process
on one stream (PyTorch's current stream).

Passes:
    fwd      the FlashAttention grid: bf16, 16k tokens (batch = 16384 / seqlen), hidden 2048
             (heads = 2048 / d), d 64/128/256, seqlen 1k/4k/16k, causal and not;
             --head-dims: d 32/40/80/96/112/160/192 and d_qk 192 / d_v 128 at batch 4 × 4096,
               heads = 2048 // d (table fwd_headdims);
             --gqa: 32 query / 8 KV heads, d128, causal, 2k/4k/8k (fwd_gqa);
             --varlen: ragged lengths drawn from --seed (mean 2k, 1..8k keys, 16k tokens in
               all), d 64/128/256, causal and not, through the varlen entry points, each row
               beside the same tokens as a fixed-length batch of the mean length (fwd_varlen;
               SDPA has no ragged form); --extras: all three; --no-grid: the extras only.
             Peers: SDPA with cuDNN forced (cudnn), SDPA with FlashAttention-2 forced (fa2),
             FlashAttention-3's Hopper forward (fa3, wheel fa3-fwd), FlashAttention-4 CuTe
             (fa4cute, wheel flash-attn-4).
    bwd      the grid's backward only: torch.autograd.grad(out, (q, k, v), dout) on a forward
             recorded once outside the timed region (retain_graph); fa4, cudnn, fa2, fa4cute;
             --head-dims: d 32/40/80/96/112/160/192 at batch 4 × 4096 (bwd_headdims);
             --gqa: the fwd pass's GQA shapes, causal and not (bwd_gqa; SDPA with
               enable_gqa=True, fa4 and fa4cute given K and V of 8 heads);
             --varlen: the fwd pass's ragged batch and fixed-length rows (bwd_varlen; fa4 and
               fa4cute); --extras: all three; --no-grid: the extras only.
    fp8      the grid's shapes with fp8 (e4m3) inputs (table fwd_fp8): Q, K, V quantized from
             standard normal draws per (batch, KV head) as docs/attention.md says, descales
             float32 (batch, heads_kv). fa4 (flash_attn_func with float8_e4m3fn inputs and
             q/k/v_descale; O bf16), FlashAttention-3's fp8 forward (fa3; the same call and
             descales; O bf16), cuDNN's fp8 SDPA through cudnn-frontend's graph API (cudnn_fp8;
             on Hopper O must be fp8 too, and its descales are one per tensor: the largest of the
             per-head ones; the graph is built once per shape, outside the timed region, and run
             with a workspace), and fa4's bf16 forward on the dequantized inputs (fa4_bf16, fa4's
             own column, never the best peer: the line prints fa4 fp8 / fa4 bf16). FLOPs as fwd.
    decode   bf16, 32 query / 8 KV heads, d128, one query row, (batch, keys) = (1, 32k),
             (8, 8k), (8, 32k), (32, 4k), (4, 128k), pages of --pages (16, 64, 256, 1): fa4
             through flash_attn_with_kvcache with a block table over a random page permutation,
             FlashAttention-4 CuTe through its paged varlen path (page_table), and on a
             contiguous cache SDPA cuDNN and FA2 (enable_gqa=True), FA3's
             flash_attn_with_kvcache, and cudnn_expanded: SDPA cuDNN on K/V already repeated to
             32 heads (a diagnostic, never the best peer). One table per page size; the
             contiguous peers are timed once per shape, in the same rounds as every page size.
    decode-fp8 the decode shapes and pages over an fp8 (e4m3) cache, in µs per call (the bytes
             differ between the caches, so a rate would mislead): fa4 (named "fa4 fp8") through
             flash_attn_with_kvcache over a paged float8_e4m3fn cache with k_scale and v_scale,
             float32 (heads_kv,) (vLLM's form: a stored value x stands for scale · x), quantized
             from standard normal bf16 draws with scale = amax / 448 per KV head; fa4_bf16 (fa4's
             own column, never the best peer) over the paged bf16 cache of the dequantized values,
             through the same block tables; SDPA cuDNN (enable_gqa=True) and FA3's
             flash_attn_with_kvcache on a contiguous bf16 cache, as the decode pass. Each row
             also prints the goals' ratios of times: fa4 fp8 / fa4 bf16 (at most 0.55) and cuDNN
             / fa4 fp8 (at least 1.8); the JSON names them under "ratios" (perf_table.py's
             columns). Tables decode_fp8_p16, _p64, _p256, _p1.
    ncu-table RAW.csv LABELS.json   kernel-only durations (below).
    lengths [--seed S]   the --varlen batch's lengths, comma-separated: `fa4 bench --backend
             cuda [--backward] --lengths "$(python3 bench/peers.py lengths)"` times the same
             packed batch in fa4's own driver.

Method, the same for every library:
- untimed warm-up calls first (--warmup, 3; JIT compiles, autotuning and graph builds land
  there; the first call's seconds are printed);
- a round is one CUDA event pair around --calls (10) back-to-back calls. Before the first
  event the GPU runs a sleep kernel (torch.cuda._sleep) long enough for the host to queue all
  the calls (1.25 × the library's host time per call × calls + 50 µs), so the round measures
  the GPU's time for the calls, not a host path slower than the kernels (in eager decode
  SDPA's host path, 50–80 µs per call, is longer than cuDNN's 40 µs kernel; bench/README.md).
  A round whose head start ended before the host had queued its last call is run again with
  twice the head start (the sleep's length comes from a clock calibration, which another
  clock during the rounds would cut short);
  The host time per call is measured too (a clock around the enqueueing) and printed; `h`
  marks a library whose host path is slower than its kernels. --no-head-start drops the
  sleep: the host path is then timed too, as in eager use;
- --rounds (9) rounds, round r starting at the r-th library (fa4, cudnn, … then cudnn, …,
  fa4), so that drift and the place in a round hit all alike (the place alone moved a figure by
  up to 11% on the H200, 2026-12-02, docs/perf.md);
- per library the median round; spread = IQR / median (also (max − min) / median, printed);
  verdict win / loss when fa4's median beats / trails the best peer's by more than the larger
  IQR spread of the two, else tie;
- inputs rotate among enough copies that the copies span more than 4 × L2 (50 MB on the
  H200), so that no call finds its inputs in L2 (decode especially; a 16k-token set already
  does);
- FLOPs: 2·sq·sk·(d + d_v) per head and sequence (4·b·h·sq·sk·d), halved for causal; varlen
  sums over its sequences and counts a causal mask's allowed pairs exactly; backward 2.5 ×
  the forward. Decode: bytes read, K and V of every cached key plus Q and O, in TB/s;
  decode-fp8: µs per call;
- before timing, fa4's output on each shape is compared with a float32 SDPA (math backend)
  reference on a slice (batch 0, up to 4 heads, 256 query rows; the backward: O, dQ, dK, dV
  over the whole sequence of KV head 0 and the query heads of its group, so that with GQA dK
  and dV sum query heads 0..3, the reference's through enable_gqa; fp8: the dequantized
  inputs, and FlashAttention-3's and cuDNN's outputs too; decode: sequence 0, every head;
  decode-fp8: the cache dequantized in float32, fa4 fp8's and fa4 bf16's outputs): one line,
  `max|Δ|` against `max|ref|`, a sanity check, not a test.

A library that raises on a shape gets null and a one-line note; the run goes on.

    python3 bench/peers.py fwd [--extras | --head-dims --gqa --varlen] [--no-grid]
    python3 bench/peers.py bwd [--extras | --head-dims --gqa --varlen] [--no-grid]
    python3 bench/peers.py fp8
    python3 bench/peers.py decode [--pages 16,64,256,1]
    python3 bench/peers.py decode-fp8 [--pages 16,64,256,1]
      common: [--only fa4,cudnn,...] [--quick] [--rounds 9] [--calls 10] [--warmup 3]
              [--seed 0] [--json DIR] [--budget SECONDS] [--no-head-start]
              [--fa4-env NAME=KEY=VALUE[,KEY=VALUE]] (one more fa4 column with that environment
              set around its calls, e.g. sm80=FA4_BWD_KERNEL=sm80; fa4 reads it per call)
              [--profile LABELS.json] (no rounds: 3 calls per library and shape inside
              cudaProfilerStart/Stop, each followed by a marker kernel, for Nsight Compute)

--json DIR writes one file per table, DIR/<id>.json (fwd_grid, fwd_headdims, fwd_gqa,
fwd_varlen, fwd_fp8, bwd_grid, bwd_headdims, bwd_gqa, bwd_varlen, decode_p16, decode_p64,
decode_p256, decode_p1, decode_fp8_p16, decode_fp8_p64, decode_fp8_p256, decode_fp8_p1), in the
schema bench/plot_perf.py reads (docs/data/<id>.json): id, title, date, gpu, driver, versions,
method, unit, higher_is_better, libs, lib_names, rows of {case, values, spread, rounds (ms per
call)};
decode-fp8's tables have unit "µs per call", higher_is_better false, and "ratios".

Expected on an H200 (9 rounds of 10 calls; estimated from the per-call times in docs/perf.md,
input generation and warm-ups): fwd grid about 1 min, with --extras about 2 more; bwd about
2 min, its --gqa about 1 more (six shapes, each twice the work of the d128 grid's at its
seqlen); decode with the four page sizes about 1.5 min; decode-fp8 about as long (ten columns
against twelve, plus the quantization and fa4's NVRTC compiles of the e4m3-cache decode kernels
on first use, cached on disk); fp8 about 2 min (18 shapes, four
columns, plus fa4's NVRTC compiles of the e4m3 kernels on first use, cached on disk, and
cuDNN's graph builds); plus FlashAttention-4 CuTe's JIT compiles
on first use (seconds per kernel; its disk cache is turned on,
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, default /tmp/fa4cute-cache, so a later pass on the same
machine reuses them). --quick: the d128 shapes, fewer extras, 5 rounds; well under a minute
each. Run lines for the GPU machine, with the wheels, are in bench/README.md.

Kernel-only durations (ncu; bench/profile.sh durations runs all of it):
    ncu --profile-from-start off --metrics gpu__time_duration.sum --cache-control all \\
        --clock-control none --export R python3 bench/peers.py fwd --quick --profile L.json
    ncu --import R.ncu-rep --csv --page raw --print-units base > R.csv
    python3 bench/peers.py ncu-table R.csv L.json   (per case and library: the median over the
        3 calls of the sum of the call's kernels, in µs; writes ncu.json under --json or $OUT)
"""
import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import random
import subprocess
import sys
import time
import warnings

TOKENS, HIDDEN = 16384, 2048
GRID_DIMS = (64, 128, 256)
GRID_SEQLENS = (1024, 4096, 16384)
HEADDIMS = (32, 40, 80, 96, 112, 160, 192)
DV_CASES = ((192, 128),)  # (d_qk, d_v): DeepSeek's shape, which FA3 and FA4-CuTe run
HEADDIM_BATCH, HEADDIM_SEQLEN = 4, 4096
GQA_HEADS, GQA_D, GQA_SEQLENS = (32, 8), 128, (2048, 4096, 8192)
VARLEN_MEAN, VARLEN_MIN, VARLEN_MAX = 2048, 1, 8192
DECODE_HEADS, DECODE_D = (32, 8), 128
DECODE_SHAPES = ((1, 32768), (8, 8192), (8, 32768), (32, 4096), (4, 131072))
DECODE_PAGES = (16, 64, 256, 1)
BWD_FACTOR = 2.5  # backward FLOPs per forward FLOP (FlashAttention's convention)
L2_BYTES = 50 << 20  # the H200's, when the device does not say
ROTATE_L2 = 4  # input copies span more than this many L2s
MAX_COPIES = 64
CHECK_ROWS, CHECK_HEADS = 256, 4
MARK_CYCLES = 1000  # the marker kernel between profiled calls (torch.cuda._sleep: spin_kernel)
HEAD_START_US = 50.0  # head-start sleep on top of the queued calls' host time
PEERS = ("cudnn", "fa2", "fa3", "fa4cute", "cudnn_fp8")
OWN_COLUMNS = ("fa4_bf16",)  # fa4's own columns beside its main one, never the best peer
DIAGNOSTICS = ("cudnn_expanded",)  # columns that are never the best peer
LIB_ORDER = ("fa4",) + PEERS + OWN_COLUMNS + DIAGNOSTICS
PASS_LIBS = {
    "fwd": ("fa4", "cudnn", "fa2", "fa3", "fa4cute"),
    "bwd": ("fa4", "cudnn", "fa2", "fa4cute"),
    "fp8": ("fa4", "fa3", "cudnn_fp8", "fa4_bf16"),
    "decode": ("fa4", "cudnn", "fa2", "fa3", "fa4cute", "cudnn_expanded"),
    "decode-fp8": ("fa4", "cudnn", "fa3", "fa4_bf16"),
}
E4M3_MAX = 448.0  # the largest finite e4m3 value
OWN_TARGET = 1.8  # fa4's fp8 forward over its bf16 one: the speed-up the fp8 kernel aims at
# The fp8 cache's goals in decode, as times per call: fa4 over the e4m3 cache in at most 0.55 ×
# its time over the bf16 cache (the bytes halve), and cuDNN on the bf16 cache at least 1.8 × fa4's
# fp8 time. (name, numerator column, denominator column, bound, True: at most / False: at least)
DECODE_FP8_GOALS = (("fa4 fp8 / fa4 bf16", "fa4", "fa4_bf16", 0.55, True),
                    ("cuDNN bf16 / fa4 fp8", "cudnn", "fa4", 1.8, False))
VARLEN_LIBS = ("fa4", "fa3", "fa4cute")  # SDPA has no ragged form


# ---- problems ------------------------------------------------------------------------------


def kilo(n):
    """1024 → "1k", 131072 → "128k", 2000 → "2000"."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


class Case:
    """One attention problem. `seqs` holds (seqlen_q, seqlen_k) per sequence (a fixed-length
    batch repeats one pair); `varlen` packs them (cu_seqlens); `dv` is d_v (None: d)."""

    def __init__(self, label, d, heads_q, heads_kv, seqs, causal=False, dv=None, varlen=False):
        self.label, self.d, self.heads_q, self.heads_kv = label, d, heads_q, heads_kv
        self.seqs, self.causal, self.varlen = list(seqs), causal, varlen
        self.dv = d if dv is None else dv

    @property
    def batch(self):
        return len(self.seqs)

    @property
    def seqlen_q(self):
        return max(q for q, _ in self.seqs)

    @property
    def seqlen_k(self):
        return max(k for _, k in self.seqs)

    def flops(self):
        return attn_flops(self.seqs, self.heads_q, self.d, self.dv, self.causal, exact_causal=self.varlen)

    def set_bytes(self):
        """Bytes of one input set (Q, K, V) and the output, bf16."""
        tq = sum(q for q, _ in self.seqs)
        tk = sum(k for _, k in self.seqs)
        return 2 * (tq * self.heads_q * (self.d + self.dv) + tk * self.heads_kv * (self.d + self.dv))

    def fp8_set_bytes(self):
        """Bytes of one fp8 input set (Q, K, V, one byte an element) and a 16-bit output."""
        tq = sum(q for q, _ in self.seqs)
        tk = sum(k for _, k in self.seqs)
        return tq * self.heads_q * (self.d + 2 * self.dv) + tk * self.heads_kv * (self.d + self.dv)


class DecodeCase:
    """One decode shape: `batch` sequences of `keys` cached keys, one query row each."""

    def __init__(self, batch, keys, heads=DECODE_HEADS, d=DECODE_D):
        self.batch, self.keys = batch, keys
        self.heads_q, self.heads_kv = heads
        self.d = d
        self.label = f"({batch}, {kilo(keys)})"  # as docs/data/decode_p16.json

    def bytes(self):
        return decode_bytes([self.keys] * self.batch, self.heads_q, self.heads_kv, self.d)

    def kv_bytes(self, elem=2):
        """Bytes of the cached K and V: `elem` bytes an element (1: an fp8 cache)."""
        return decode_bytes([self.keys] * self.batch, self.heads_q, self.heads_kv, self.d, seqlen_q=0, elem=elem)


def causal_pairs(sq, sk):
    """Score elements a causal mask aligned at the bottom right allows: row i (of sq) sees the
    keys j ≤ i + sk − sq."""
    off = sk - sq
    if off >= 0:
        return sq * off + sq * (sq + 1) // 2
    return sk * (sk + 1) // 2


def attn_flops(seqs, heads, d, dv=None, causal=False, exact_causal=False):
    """The one FLOP count: 2·sq·sk·(d + d_v) per head and sequence (4·b·h·sq·sk·d for a fixed
    batch with d_v = d), halved for causal (FlashAttention's convention, fa4's
    Problem::flops), or with `exact_causal` (varlen) the mask's allowed pairs counted."""
    dv = d if dv is None else dv
    pairs = 0.0
    for sq, sk in seqs:
        if not causal:
            pairs += sq * sk
        elif exact_causal:
            pairs += causal_pairs(sq, sk)
        else:
            pairs += sq * sk / 2
    return 2.0 * (d + dv) * heads * pairs


def decode_bytes(seqlens_k, heads_q, heads_kv, d, dv=None, seqlen_q=1, elem=2):
    """Bytes a decode call reads and writes: K and V of every cached key (of every KV head),
    Q and O of every query row."""
    dv = d if dv is None else dv
    kv = sum(seqlens_k) * heads_kv * (d + dv)
    qo = len(seqlens_k) * seqlen_q * heads_q * (d + dv)
    return float((kv + qo) * elem)


def _truncated_exp_scale(mean, width):
    """The scale θ of an exponential truncated to [0, width] whose mean is `mean` (bisection on
    θ − width / (e^{width/θ} − 1), which grows from 0 to width / 2)."""
    if not 0 < mean < width / 2:
        raise ValueError(f"mean {mean} must lie in (0, {width / 2})")
    lo, hi = 1e-9 * width, 1e6 * width
    for _ in range(200):
        th = math.sqrt(lo * hi)
        m = th - width / math.expm1(width / th) if width / th < 700 else th
        lo, hi = (th, hi) if m < mean else (lo, th)
    return math.sqrt(lo * hi)


def varlen_lengths(seed, total=TOKENS, mean=VARLEN_MEAN, lo=VARLEN_MIN, hi=VARLEN_MAX):
    """Ragged sequence lengths summing to `total`: draws from an exponential truncated to
    [lo, hi] with mean `mean`, the last one cut to what is left (so at least `lo` only when
    what is left is). Deterministic in `seed`."""
    rng = random.Random(seed)
    width = hi - lo
    th = _truncated_exp_scale(mean - lo, width)
    out, left = [], total
    while left > 0:
        x = lo - th * math.log1p(-rng.random() * -math.expm1(-width / th))
        n = min(max(lo, min(hi, int(round(x)))), left)
        out.append(n)
        left -= n
    return out


def fwd_cases(quick):
    dims = (128,) if quick else GRID_DIMS
    return [Case(f"d{d} {kilo(s)}{' causal' if c else ''}", d, HIDDEN // d, HIDDEN // d,
                 [(s, s)] * (TOKENS // s), c)
            for d in dims for s in GRID_SEQLENS for c in (False, True)]


def headdim_cases(quick, dv_cases=True):
    dims = (80, 192) if quick else HEADDIMS
    s, b = HEADDIM_SEQLEN, HEADDIM_BATCH
    out = [Case(f"d{d} {kilo(s)}{' causal' if c else ''}", d, HIDDEN // d, HIDDEN // d, [(s, s)] * b, c)
           for d in dims for c in (False, True)]
    out += [Case(f"d{d}/{dv} {kilo(s)}{' causal' if c else ''}", d, HIDDEN // d, HIDDEN // d, [(s, s)] * b, c, dv=dv)
            for d, dv in (DV_CASES if dv_cases else ()) for c in (False, True)]
    return out


def gqa_cases(quick, causals=(True,)):
    """32 query / 8 KV heads, d128, 16k tokens per seqlen and mask (the forward's table is causal
    only, the backward's both)."""
    hq, hkv = GQA_HEADS
    seqlens = (4096,) if quick else GQA_SEQLENS
    return [Case(f"{hq}/{hkv} {kilo(s)}{' causal' if c else ''}", GQA_D, hq, hkv, [(s, s)] * (TOKENS // s), c)
            for s in seqlens for c in causals]


def varlen_cases(seed, quick):
    """The ragged batch beside the same tokens at fixed length, forward and backward: per head
    dim (64, 128 and the grid's 256) and mask, the ragged batch, then as many sequences of its
    mean length (issues 31 and 32 judge the one against the other)."""
    lengths = varlen_lengths(seed)
    dims = (128,) if quick else GRID_DIMS
    causals = (True,) if quick else (False, True)
    mean = TOKENS // len(lengths)
    out = []
    for d in dims:
        for c in causals:
            tag = f"d{d}{' causal' if c else ''}"
            h = HIDDEN // d
            out.append(Case(f"varlen {tag}", d, h, h, [(n, n) for n in lengths], c, varlen=True))
            out.append(Case(f"fixed {len(lengths)}x{mean} {tag}", d, h, h, [(mean, mean)] * len(lengths), c))
    return out


def decode_cases(quick):
    shapes = ((1, 32768), (8, 32768)) if quick else DECODE_SHAPES
    return [DecodeCase(b, k) for b, k in shapes]


def copies_for(set_bytes, l2_bytes=L2_BYTES):
    """Input copies to rotate so that together they span more than ROTATE_L2 × L2."""
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_L2 * l2_bytes / set_bytes) if set_bytes else 1))


# ---- statistics ----------------------------------------------------------------------------


def stats(xs):
    """median, quartiles (linear interpolation, as fa4's Spread), min, max."""
    s = sorted(xs)

    def at(f):
        x = f * (len(s) - 1)
        lo, hi = math.floor(x), math.ceil(x)
        return s[lo] + (s[hi] - s[lo]) * (x - lo)
    return dict(median=at(0.5), q1=at(0.25), q3=at(0.75), min=s[0], max=s[-1], n=len(s))


def significant(x, digits=4):
    """`x` rounded to `digits` significant digits (a tiny rate stays positive)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def iqr_spread(st):
    return (st["q3"] - st["q1"]) / st["median"]


def range_spread(st):
    return (st["max"] - st["min"]) / st["median"]


def verdict(ours, best):
    """("win" | "tie" | "loss", spread): fa4's median time (`stats` of ms) against the best
    peer's, beyond the larger IQR spread of the two or not."""
    spread = max(iqr_spread(ours), iqr_spread(best))
    rel = best["median"] / ours["median"] - 1  # > 0: fa4 faster
    return ("win" if rel > spread else "loss" if rel < -spread else "tie"), spread


def round_order(names, r):
    """The libraries' order in round r: the list rotated to start at its (r mod len)-th entry,
    so that each takes each place equally often."""
    if not names:
        return []
    first = r % len(names)
    return list(names[first:]) + list(names[:first])


def one_line(ex):
    text = str(ex).strip().splitlines()
    return f"{type(ex).__name__}: {text[0][:160] if text else ''}"


def run_rounds(names, rounds, one_round, note=print):
    """Rounds of every library in rotated order. `one_round(name)` returns (ms per call, host
    µs per call); a library that raises is dropped from then on, with a note.
    Returns {name: [(ms, host_us), ...]} for the libraries that finished."""
    got = {n: [] for n in names}
    failed = set()
    for r in range(rounds):
        for n in round_order([x for x in names if x not in failed], r):
            try:
                got[n].append(one_round(n))
            except Exception as ex:  # a library's failure is its own, not the run's
                failed.add(n)
                note(f"  {n}: dropped in round {r + 1}: {one_line(ex)}")
    return {n: v for n, v in got.items() if n not in failed and v}


class Ratio:
    """A goal column: per row, column `num`'s value over column `den`'s (for a time unit, their
    times), held to `bound`: at most it (`at_most`) or at least. Written to the table's JSON as
    {name, num, den, at_most | at_least}, which perf_table.py renders as a column."""

    def __init__(self, name, num, den, bound, at_most):
        self.name, self.num, self.den, self.bound, self.at_most = name, num, den, bound, at_most

    def met(self, q):
        return q <= self.bound if self.at_most else q >= self.bound

    def label(self):
        """The console's header: "fa4/fa4_bf16 ≤0.55"."""
        return f"{self.num}/{self.den} {'≤' if self.at_most else '≥'}{self.bound:g}"

    def json(self):
        return {"name": self.name, "num": self.num, "den": self.den,
                ("at_most" if self.at_most else "at_least"): self.bound}


class Table:
    """One output table: the libraries' columns and one row per case. `own` names a column of
    fa4's own (fa4_bf16) whose time each row divides by fa4's: fa4's speed-up over itself.
    `ratios` (Ratio) are goal columns; `names` overrides the run's names of some columns (fa4 is
    "fa4 fp8" in decode-fp8); `higher_is_better` is False for a time unit."""

    def __init__(self, tid, title, unit, libs, own=None, ratios=(), names=None, higher_is_better=True):
        self.id, self.title, self.unit, self.libs = tid, title, unit, list(libs)
        self.own = own
        self.ratios, self.names, self.higher_is_better = list(ratios), dict(names or {}), higher_is_better
        self.rows = []

    def add(self, label, results, metric):
        """A row from {lib: [(ms, host_us)]} (libraries of this table only); `metric(ms)` is
        the value per call time (TFLOP/s or TB/s). Returns the row with its summary
        (best peer, ratio, verdict) under "_summary" (not written to JSON)."""
        row = {"case": label, "values": {}, "spread": {}, "rounds": {}}
        st = {}
        for lib in self.libs:
            rs = results.get(lib)
            if not rs:
                row["values"][lib] = row["spread"][lib] = row["rounds"][lib] = None
                continue
            ms = [x[0] for x in rs]
            v = metric(stats(ms)["median"])
            if not (v > 0 and math.isfinite(v)):  # a zero-FLOP case, a failed timer: no value
                row["values"][lib] = row["spread"][lib] = row["rounds"][lib] = None
                continue
            st[lib] = stats(ms)
            row["values"][lib] = significant(v)
            row["spread"][lib] = significant(iqr_spread(st[lib]), 3)
            row["rounds"][lib] = [significant(x, 6) for x in ms]
        summary = {"stats": st, "host_us": {lib: stats([x[1] for x in results[lib]])["median"]
                                            for lib in st}}
        peers = [p for p in st if p in PEERS]  # never fa4's own columns nor a diagnostic
        if peers:
            best = min(peers, key=lambda p: st[p]["median"])
            summary["best"] = best
            if "fa4" in st:
                summary["ratio"] = st[best]["median"] / st["fa4"]["median"]
                summary["verdict"], summary["spread"] = verdict(st["fa4"], st[best])
        if self.own in st and "fa4" in st:
            summary["own"] = st[self.own]["median"] / st["fa4"]["median"]
        summary["ratios"] = {r.name: metric(st[r.num]["median"]) / metric(st[r.den]["median"])
                             for r in self.ratios if r.num in st and r.den in st}
        row["_summary"] = summary
        self.rows.append(row)
        return row

    def header(self):
        own = f" {'fa4/' + self.own:>13}" if self.own else ""
        own += "".join(f" {r.label():>20}" for r in self.ratios)
        return (f"{'case':<22}" + "".join(f"{lib:>16}" for lib in self.libs)
                + f"  {'best':>9} {'fa4/best':>8} verdict{own}  host µs/call")

    def line(self, row):
        s = row["_summary"]
        cells = []
        for lib in self.libs:
            v = row["values"][lib]
            if v is None:
                cells.append(f"{'-':>16}")
                continue
            st = s["stats"][lib]
            host = "h" if s["host_us"][lib] > 1e3 * st["median"] else " "
            cells.append(f"{v:>8.1f}{host}±{100 * row['spread'][lib]:4.1f}%".rjust(16))
        best = s.get("best", "-")
        ratio = f"{s['ratio']:.3f}" if "ratio" in s else "-"
        hosts = " ".join(f"{lib} {s['host_us'][lib]:.0f}" for lib in self.libs if lib in s["host_us"])
        own = ""
        if self.own:
            own = f" {s['own']:>12.2f}x" if "own" in s else f" {'-':>13}"
        for r in self.ratios:
            q = s["ratios"].get(r.name)
            own += f" {'-':>20}" if q is None else f" {q:>18.3f} {'✓' if r.met(q) else '✗'}"
        return (f"{row['case']:<22}" + "".join(cells)
                + f"  {best:>9} {ratio:>8} {s.get('verdict', '-'):<7}{own}  {hosts}")

    def json(self, meta):
        """The table in plot_perf.py's schema; `meta`: date, gpu, driver, versions, method,
        lib_names."""
        names = {**meta["lib_names"], **self.names}
        out = {
            "id": self.id, "title": self.title, "date": meta["date"], "gpu": meta["gpu"],
            "driver": meta["driver"], "versions": meta["versions"], "method": meta["method"],
            "unit": self.unit, "higher_is_better": self.higher_is_better, "libs": self.libs,
            "lib_names": {lib: names.get(lib, lib) for lib in self.libs},
        }
        if "head_start_reruns" in meta:
            # Of the whole run (every table of one run shares one head start).
            out["head_start_reruns"] = meta["head_start_reruns"]
        if self.ratios:
            out["ratios"] = [r.json() for r in self.ratios]
        out["rows"] = [{k: r[k] for k in ("case", "values", "spread", "rounds")} for r in self.rows]
        return out


def write_tables(tables, directory, meta):
    os.makedirs(directory, exist_ok=True)
    paths = []
    for t in tables:
        if not t.rows:
            continue
        path = os.path.join(directory, f"{t.id}.json")
        with open(path, "w") as f:
            json.dump(t.json(meta), f, indent=1, ensure_ascii=False)
            f.write("\n")
        paths.append(path)
    return paths


def method_line(a):
    sleep = ("after a GPU sleep that lets the host queue them (a round whose sleep ran out first is run "
             "again with it doubled; GPU time; host time per call printed apart)" if a.head_start
             else "(host path included: no head start)")
    if a.pass_ == "fp8":
        what = ("bench/peers.py fp8: one process, one stream; e4m3 inputs quantized per (batch, KV head) from "
                "standard normal draws; fa4 and FlashAttention-3 with those descales and bf16 O, cuDNN through "
                "cudnn-frontend's graph API (built once per shape) with per-tensor descales and fp8 O, fa4 bf16 on "
                "the dequantized values")
    elif a.pass_ == "decode-fp8":
        what = ("bench/peers.py decode-fp8: one process, one stream; fa4 over a paged e4m3 cache quantized from "
                "standard normal bf16 draws with one scale per KV head (amax / 448), fa4 bf16 over the paged bf16 "
                "cache of the dequantized values, cuDNN through PyTorch SDPA (enable_gqa) and FlashAttention-3 on "
                "a contiguous bf16 cache")
    else:
        what = "bench/peers.py: one process, one stream, cuDNN and FlashAttention-2 through PyTorch SDPA"
    return (f"{what}; {a.warmup} warm-up calls; a round = one CUDA event pair around "
            f"{a.calls} back-to-back calls {sleep}; {a.rounds} rounds, round r starting at library r; "
            f"median round; spread = IQR/median; inputs rotated over more than {ROTATE_L2}x L2")


def parse_env_columns(specs):
    """--fa4-env values NAME=KEY=VALUE[,KEY=VALUE] as [(name, {key: value})]; a ValueError
    naming the bad value."""
    out = []
    for spec in specs:
        name, eq, rest = spec.partition("=")
        env = {}
        for kv in rest.split(",") if rest else []:
            key, eq2, val = kv.partition("=")
            if not eq2 or not key:
                raise ValueError(f"--fa4-env {spec!r}: expected NAME=KEY=VALUE[,KEY=VALUE], got {kv!r}")
            env[key] = val
        if not eq or not name or not env:
            raise ValueError(f"--fa4-env {spec!r}: expected NAME=KEY=VALUE[,KEY=VALUE]")
        if name in LIB_ORDER or "@" in name:
            raise ValueError(f"--fa4-env {spec!r}: {name!r} is taken")
        out.append((name, env))
    return out


@contextlib.contextmanager
def environment(env):
    """`env` set in os.environ (and so in the C environment fa4 reads) while inside."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- kernel-only durations (ncu) -----------------------------------------------------------


def read_ncu_csv(path):
    """(kernel name, duration ns) in launch order from `ncu --csv --page raw --print-units base`."""
    rows, hdr = [], None
    with open(path, errors="replace") as f:
        lines = [line for line in f if not line.startswith("==")]
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


def ncu_durations(kernels, labels):
    """{case: {lib: median µs per call}} from the profiled kernels and the labels of the calls:
    a call's kernels are those before its marker (spin_kernel) since the previous one."""
    groups, cur = [], []
    for name, ns in kernels:
        if "spin_kernel" in name:
            groups.append(cur)
            cur = []
        else:
            cur.append(ns)
    if len(groups) != len(labels):
        print(f"ncu-table: {len(groups)} marked calls for {len(labels)} labels", file=sys.stderr)
    per = {}
    for lab, g in zip(labels, groups):
        per.setdefault(lab["case"], {}).setdefault(lab["lib"], []).append(sum(g) / 1e3)
    return {case: {lib: stats(v)["median"] for lib, v in libs.items()} for case, libs in per.items()}


def ncu_table(a):
    with open(a.labels) as f:
        labels = json.load(f)
    out = ncu_durations(read_ncu_csv(a.raw), labels)
    libs = [lib for lib in dict.fromkeys(lab["lib"] for lab in labels)]
    print(f"{'case':<22}" + "".join(f"{lib:>14}" for lib in libs) + "   kernel-only µs per call (ncu)")
    for case, v in out.items():
        print(f"{case:<22}" + "".join(f"{v[lib]:>14.1f}" if lib in v else f"{'-':>14}" for lib in libs))
    d = a.json or os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "ncu.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)


# ---- the GPU side --------------------------------------------------------------------------


class Gpu:
    """The timing, on PyTorch's current stream (`torch` is passed in so that tests can stand
    in for it)."""

    def __init__(self, torch, calls, head_start=True):
        self.torch, self.calls, self.head_start = torch, calls, head_start
        self.cycles_per_us = None
        # Grows (×2) each time a head start ended before the host had queued the round's calls
        # (a calibration taken at another clock, a host path slower than measured).
        self.head_start_scale = 1.0
        self.reruns = 0  # rounds run again for a short head start, printed and in the JSON

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def calibrate(self):
        """Cycles of torch.cuda._sleep per µs, for the head start."""
        t = self.torch
        e0, e1 = self.event(), self.event()
        t.cuda.synchronize()
        e0.record()
        t.cuda._sleep(1_000_000)
        e1.record()
        t.cuda.synchronize()
        self.cycles_per_us = 1_000_000 / max(1e-3, e0.elapsed_time(e1) * 1e3)

    def round(self, call, host_us, tries=4):
        """One round: (GPU ms per call, host µs per call). `host_us` is the library's host time
        per call so far, for the head start. When the head start has already ended as the host
        queues the last call (the first event has completed), the GPU may have waited on the host
        inside the round: the round is run again with twice the head start, up to `tries` times
        (the last one is kept)."""
        t = self.torch
        for attempt in range(tries):
            t.cuda.synchronize()
            if self.head_start:
                if self.cycles_per_us is None:
                    self.calibrate()
                us = self.head_start_scale * (1.25 * self.calls * host_us + HEAD_START_US)
                t.cuda._sleep(int(self.cycles_per_us * us))
            e0, e1 = self.event(), self.event()
            e0.record()
            h0 = time.perf_counter()
            for _ in range(self.calls):
                call()
            host = (time.perf_counter() - h0) * 1e6 / self.calls
            short = self.head_start and e0.query()
            e1.record()
            t.cuda.synchronize()
            if not short or attempt == tries - 1:
                return e0.elapsed_time(e1) / self.calls, host
            self.head_start_scale *= 2
            self.reruns += 1
            host_us = max(host_us, host)

    def warm(self, call, n):
        """`n` untimed calls after the first; (first call's seconds, host µs per call)."""
        t = self.torch
        t.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        t.cuda.synchronize()
        first = time.perf_counter() - t0
        h0 = time.perf_counter()
        for _ in range(n):
            call()
        host = (time.perf_counter() - h0) * 1e6 / max(1, n)
        t.cuda.synchronize()
        return first, host


class Lib:
    """A column: a context entered around every call (a forced SDPA backend, an environment)
    and the call itself, made per case."""

    def __init__(self, name, ctx, call):
        self.name, self.ctx, self.call = name, ctx, call
        self.host_us = 0.0


class Mods:
    """PyTorch and the libraries that imported, with their versions."""

    def __init__(self, only, env_columns, libs=None):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        self.torch, self.F, self.SDPBackend, self.sdpa_kernel = torch, F, SDPBackend, sdpa_kernel
        self.only = only
        self.libs = libs  # the pass's libraries: only these are imported (None: all)
        self.env_columns = env_columns
        self.notes = []
        self.fa4 = self.fa3 = self.fa4cute = self.cudnn_fe = None
        self._cudnn_handle = None
        self.versions = {"torch": torch.__version__, "cudnn": self.cudnn_version(), "fa4": None,
                         "flash_attn_4": None, "fa3": None}
        if self.wanted("cudnn_fp8"):
            self.versions["cudnn_frontend"] = None
            try:
                import cudnn
                self.cudnn_fe = cudnn
                backend = cudnn.backend_version_string() if hasattr(cudnn, "backend_version_string") else None
                self.versions["cudnn_frontend"] = cudnn.__version__ + (f" (cuDNN {backend})" if backend else "")
            except Exception as ex:
                self.notes.append(f"cuDNN's frontend (cudnn, wheel nvidia-cudnn-frontend) not importable: "
                                  f"{one_line(ex)}")
        if self.wanted("fa4") or self.wanted("fa4_bf16") or env_columns:
            try:
                import fa4
                self.fa4 = fa4
                info = fa4.build_info() if hasattr(fa4, "build_info") else {}
                commit = info.get("commit") if isinstance(info, dict) else None
                self.versions["fa4"] = fa4.__version__ + (f" ({commit})" if commit else "")
            except Exception as ex:
                self.notes.append(f"fa4 not importable: {one_line(ex)}")
        if self.wanted("fa3"):
            try:
                import fa3_fwd_config
                sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
                import fa3_fwd_interface as fa3
                self.fa3 = fa3
                self.versions["fa3"] = dist_version("fa3-fwd")
            except Exception as ex:
                self.notes.append(f"FlashAttention-3 (fa3_fwd) not importable: {one_line(ex)}")
        if self.wanted("fa4cute"):
            os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
            os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/tmp/fa4cute-cache")
            try:
                from flash_attn.cute import interface as fa4cute
                self.fa4cute = fa4cute
                self.versions["flash_attn_4"] = dist_version("flash-attn-4")
            except Exception as ex:
                self.notes.append(f"FlashAttention-4 CuTe (flash_attn.cute) not importable: {one_line(ex)}")

    def wanted(self, name):
        return (self.libs is None or name in self.libs) and (self.only is None or name in self.only)

    def cudnn_handle(self):
        """One cuDNN handle for the run, on PyTorch's current stream."""
        if self._cudnn_handle is None:
            h = self.cudnn_fe.create_handle()
            self.cudnn_fe.set_stream(h, self.torch.cuda.current_stream().cuda_stream)
            self._cudnn_handle = h
        return self._cudnn_handle

    def cudnn_version(self):
        v = self.torch.backends.cudnn.version()
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v else None

    def lib_names(self):
        cud = self.versions["cudnn"] or "?"
        fe = self.versions.get("cudnn_frontend") or ""
        fe_backend = fe.partition("(cuDNN ")[2].rstrip(")") or cud
        # As docs/data names them; the versions are in `versions`, SDPA in the method line.
        return {
            "fa4": "fa4",
            "cudnn": "cuDNN " + ".".join(cud.split(".")[:2]),
            "fa2": "FlashAttention-2",
            "fa3": "FlashAttention-3",
            "fa4cute": "FlashAttention-4 (CuTe)",
            "cudnn_fp8": "cuDNN " + ".".join(fe_backend.split(".")[:2]) + " (fp8 O)",
            "fa4_bf16": "fa4 bf16",
            "cudnn_expanded": "cuDNN, K/V repeated to the query heads",
            **{name: f"fa4 with {','.join(f'{k}={v}' for k, v in env.items())}" for name, env in self.env_columns},
        }

    def available(self, names):
        """The names of `names` this run can time."""
        have = {"fa4": self.fa4 is not None, "cudnn": True, "fa2": True, "fa3": self.fa3 is not None,
                "fa4cute": self.fa4cute is not None, "cudnn_expanded": True,
                "cudnn_fp8": self.cudnn_fe is not None, "fa4_bf16": self.fa4 is not None}
        out = [n for n in names if have.get(n) and self.wanted(n)]
        if self.fa4 is not None:
            out += [name for name, _ in self.env_columns]
        return out

    def ctx(self, name):
        """The context around a library's calls."""
        if name in ("cudnn", "cudnn_expanded"):
            return lambda: self.sdpa_kernel([self.SDPBackend.CUDNN_ATTENTION])
        if name == "fa2":
            return lambda: self.sdpa_kernel([self.SDPBackend.FLASH_ATTENTION])
        env = dict(self.env_columns).get(name)
        if env:
            return lambda: environment(env)
        return contextlib.nullcontext

    def family(self, name):
        """fa4's environment columns call fa4."""
        return "fa4" if name in dict(self.env_columns) else name


def dist_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def first(r):
    """The output of a call that may return (out, lse, ...)."""
    return r[0] if isinstance(r, (tuple, list)) else r


def fwd_fn(m, lib, case):
    """f(set) → out (batch, seqlen, heads, d_v) or (total, heads, d_v): one forward of `lib` on
    an input set (dict q, k, v[, cu, max])."""
    c, gqa = case.causal, case.heads_q != case.heads_kv
    F = m.F
    if case.varlen:
        if lib == "fa4":
            return lambda s: first(m.fa4.flash_attn_varlen_func(s["q"], s["k"], s["v"], s["cu_host"], s["cu_host"],
                                                                s["max"], s["max"], causal=c))
        if lib == "fa3":
            return lambda s: first(m.fa3.flash_attn_varlen_func(s["q"], s["k"], s["v"], s["cu"], s["cu"], s["max"], s["max"],
                                                                causal=c))
        if lib == "fa4cute":
            return lambda s: first(m.fa4cute.flash_attn_varlen_func(
                s["q"], s["k"], s["v"], cu_seqlens_q=s["cu"], cu_seqlens_k=s["cu"], max_seqlen_q=s["max"],
                max_seqlen_k=s["max"], causal=c))
        raise ValueError(f"{lib} has no varlen form")
    if lib == "fa4":
        return lambda s: first(m.fa4.flash_attn_func(s["q"], s["k"], s["v"], causal=c))
    if lib in ("cudnn", "fa2"):
        # SDPA's layout is (batch, heads, seqlen, d): views of the same tensors. Its is_causal is
        # top-left aligned, which is the same mask here (seqlen_q = seqlen_k).
        return lambda s: F.scaled_dot_product_attention(s["q"].transpose(1, 2), s["k"].transpose(1, 2),
                                                        s["v"].transpose(1, 2), is_causal=c,
                                                        enable_gqa=gqa).transpose(1, 2)
    if lib == "fa3":
        return lambda s: first(m.fa3.flash_attn_func(s["q"], s["k"], s["v"], causal=c))
    if lib == "fa4cute":
        return lambda s: first(m.fa4cute.flash_attn_func(s["q"], s["k"], s["v"], causal=c))
    raise ValueError(f"no forward for {lib}")


def make_sets(m, case, n, grad):
    """`n` input sets (q, k, v; with `grad` also dout) of random bf16 values."""
    t = m.torch
    kw = dict(device="cuda", dtype=t.bfloat16)
    sets = []
    for _ in range(n):
        if case.varlen:
            total = sum(q for q, _ in case.seqs)
            s = dict(q=t.randn(total, case.heads_q, case.d, **kw), k=t.randn(total, case.heads_kv, case.d, **kw),
                     v=t.randn(total, case.heads_kv, case.dv, **kw))
            cu = [0]
            for q, _ in case.seqs:
                cu.append(cu[-1] + q)
            s["cu"] = t.tensor(cu, device="cuda", dtype=t.int32)
            # fa4 validates offsets on the host: its documented form, CPU tensors, costs no
            # synchronisation (CUDA ones are copied back every call).
            s["cu_host"] = s["cu"].cpu()
            s["max"] = case.seqlen_q
        else:
            b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
            s = dict(q=t.randn(b, sq, case.heads_q, case.d, **kw), k=t.randn(b, sk, case.heads_kv, case.d, **kw),
                     v=t.randn(b, sk, case.heads_kv, case.dv, **kw))
        if grad:
            for x in ("q", "k", "v"):
                s[x].requires_grad_()
            s["do"] = t.randn(*s["q"].shape[:-1], case.dv, **kw)
        sets.append(s)
    return sets


def rotating(sets, f):
    """A call of `f` on the next set each time."""
    i = [0]

    def call():
        s = sets[i[0] % len(sets)]
        i[0] += 1
        return f(s)
    return call


def reference(m, q, k, v, causal, sq, sk):
    """float32 SDPA (math backend) of one slice: q (H, R, d) of rows ending at sq (causal) or
    starting at 0, k/v (H_kv, sk, d) with H_kv dividing H (fewer: enable_gqa, query head h reads
    KV head h // (H / H_kv), and the gradients of K and V sum over the group); a causal mask
    aligned at the bottom right."""
    t = m.torch
    mask = None
    if causal:
        rows = t.arange(sq - q.shape[1], sq, device="cuda")
        mask = t.arange(sk, device="cuda")[None, :] <= (rows[:, None] + sk - sq)
    with m.sdpa_kernel([m.SDPBackend.MATH]):
        return m.F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                enable_gqa=q.shape[0] != k.shape[0])


def check_line(name, pairs):
    """`pairs`: [(what, got, ref)] → one line of max|Δ| against max|ref|."""
    parts = []
    worst = 0.0
    for what, got, ref in pairs:
        err = (got.float() - ref.float()).abs().max().item()
        mag = ref.float().abs().max().item()
        worst = max(worst, err / max(mag, 1e-6))
        parts.append(f"{what} max|Δ| {err:.2e} (max|ref| {mag:.2e})")
    flag = "  <-- LARGE" if worst > 1 / 32 else ""
    return f"  check {name}: " + ", ".join(parts) + flag


def check_fwd(m, case, s, out):
    """fa4's forward on set `s` against the float32 reference, on batch 0 (varlen: sequence 0),
    up to CHECK_HEADS heads, CHECK_ROWS query rows (causal: the last ones)."""
    hs = list(range(min(CHECK_HEADS, case.heads_q)))
    kvh = [h // (case.heads_q // case.heads_kv) for h in hs]
    sq, sk = case.seqs[0]
    r = min(CHECK_ROWS, sq)
    r0 = sq - r if case.causal else 0
    if case.varlen:
        q, k, v, o = (x[:n] for x, n in ((s["q"], sq), (s["k"], sk), (s["v"], sk), (out, sq)))
    else:
        q, k, v, o = s["q"][0], s["k"][0], s["v"][0], out[0]
    ref = reference(m, q[r0:r0 + r, hs].transpose(0, 1), k[:, kvh].transpose(0, 1), v[:, kvh].transpose(0, 1),
                    case.causal, sq, sk)
    return check_line("fa4 O", [("O", o[r0:r0 + r, hs].transpose(0, 1), ref)])


def check_bwd(m, case, s, out, grads):
    """fa4's gradients against float32 autograd through the reference, batch 0 (varlen:
    sequence 0), KV head 0 and the query heads of its group (0 .. heads_q / heads_kv − 1; head 0
    alone without GQA), so that dK and dV are the sums over the group on both sides."""
    t = m.torch
    sq, sk = case.seqs[0]
    group = case.heads_q // case.heads_kv
    heads = {"q": group, "k": 1, "v": 1, "do": group}
    if case.varlen:
        # Packed (total, heads, d): sequence 0's rows, as a batch of one.
        rows = {"q": sq, "k": sk, "v": sk, "do": sq}
        view = lambda x, name: x[:rows[name]].unsqueeze(0)
    else:
        view = lambda x, name: x
    # (heads, seqlen, d) of batch 0: the group's query heads (q, do, O, dQ) or KV head 0 (k, v, dK, dV).
    pick = lambda x, name: view(x, name)[0, :, :heads[name]].transpose(0, 1)
    q, k, v = (pick(s[x], x).detach().float().contiguous().requires_grad_() for x in ("q", "k", "v"))
    ref = reference(m, q, k, v, case.causal, sq, sk)
    rq, rk, rv = t.autograd.grad(ref, (q, k, v), pick(s["do"], "do").float())
    return check_line("fa4 bwd", [("O", pick(out, "do"), ref), ("dQ", pick(grads[0], "q"), rq),
                                  ("dK", pick(grads[1], "k"), rk), ("dV", pick(grads[2], "v"), rv)])


# ---- fp8 ------------------------------------------------------------------------------------


def quantize_e4m3(t, x, heads_kv):
    """docs/attention.md's quantization of x (batch, seqlen, heads, d) on the GPU: per (batch, KV
    head) the largest magnitude (for Q, over the query heads of the group) gives the descale
    amax / 448 (1 when 0), and x / descale rounds to e4m3 (to nearest even; clamped to +-448
    first, so that no value depends on what torch's cast does past the range). Returns
    (float8_e4m3fn x, float32 descales (batch, heads_kv))."""
    b, s, h, d = x.shape
    g = h // heads_kv
    amax = x.abs().reshape(b, s, heads_kv, g, d).amax(dim=(1, 3, 4)).float()
    descale = t.where(amax > 0, amax / E4M3_MAX, t.ones_like(amax))
    per_head = descale.repeat_interleave(g, dim=1)[:, None, :, None]
    x8 = (x.float() / per_head).clamp(-E4M3_MAX, E4M3_MAX).to(t.float8_e4m3fn)
    return x8.contiguous(), descale.contiguous()


def dequantize_e4m3(x8, descale, dtype):
    """x8 (batch, seqlen, heads, d) times its (batch, KV head) descales, in `dtype`."""
    g = x8.shape[2] // descale.shape[1]
    return (x8.float() * descale.repeat_interleave(g, dim=1)[:, None, :, None]).to(dtype)


def make_fp8_sets(m, case, n):
    """`n` fp8 input sets of a fixed-length case: q, k, v (float8_e4m3fn) quantized from standard
    normal draws, their descales q_descale, k_descale, v_descale (float32 (batch, heads_kv)), and
    cuDNN's per-tensor descales (the largest of each, (1, 1, 1, 1))."""
    t = m.torch
    b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
    sets = []
    for _ in range(n):
        s = {}
        for name, rows, heads, dim in (("q", sq, case.heads_q, case.d), ("k", sk, case.heads_kv, case.d),
                                       ("v", sk, case.heads_kv, case.dv)):
            s[name], s[name + "_descale"] = quantize_e4m3(t, t.randn(b, rows, heads, dim, device="cuda"),
                                                          case.heads_kv)
            s[name + "_descale_t"] = s[name + "_descale"].max().reshape(1, 1, 1, 1)
        sets.append(s)
    return sets


def dequantized_sets(m, sets):
    """The fp8 sets' values in bf16 (fa4's bf16 column: the same problems in 16-bit inputs)."""
    bf = m.torch.bfloat16
    return [{x: dequantize_e4m3(s[x], s[x + "_descale"], bf) for x in ("q", "k", "v")} for s in sets]


def fp8_fn(m, lib, case):
    """f(set) → out (batch, seqlen, heads, d_v): one fp8 forward of fa4 or FlashAttention-3 with
    the per-(batch, KV head) descales (out bf16)."""
    c = case.causal
    if lib == "fa4":
        mod = m.fa4
    elif lib == "fa3":
        mod = m.fa3
    else:
        raise ValueError(f"no fp8 forward for {lib}")
    return lambda s: first(mod.flash_attn_func(s["q"], s["k"], s["v"], causal=c, q_descale=s["q_descale"],
                                               k_descale=s["k_descale"], v_descale=s["v_descale"]))


def bshd(b, s, h, d):
    """cuDNN's (dim, stride) of a contiguous (batch, seqlen, heads, d) tensor: dims in its
    (batch, heads, seqlen, d) order."""
    return [b, h, s, d], [s * h * d, d, h * d, 1]


def cudnn_fp8_graph(cudnn, case, handle, amax_s_output=False):
    """cuDNN's fp8 SDPA forward of a fixed-length case, built (validated, planned) once: Q, K, V
    e4m3 in fa4's (batch, seqlen, heads, d) layout, per-tensor descales and scales ((1, 1, 1, 1)
    float32), O e4m3 (Hopper's fp8 SDPA writes fp8 O), no softmax stats; the causal mask as the
    diagonal aligned top left with right bound 0 (= bottom right here: seqlen_q = seqlen_k).
    cudnn-frontend asks that amax_s stay virtual (the scale of P then comes from its documented
    bound, 448); `amax_s_output` declares it an output, for a backend that wants it.
    Returns (graph, {name: tensor}) with the tensors a variant pack binds."""
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
    ts = {}
    for name, rows, heads, dim in (("q", sq, case.heads_q, case.d), ("k", sk, case.heads_kv, case.d),
                                   ("v", sk, case.heads_kv, case.dv)):
        dims, strides = bshd(b, rows, heads, dim)
        ts[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=e4m3)
    for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        ts[name] = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, right_bound=0) if case.causal else {}
    o, _, amax_s, amax_o = g.sdpa_fp8(
        q=ts["q"], k=ts["k"], v=ts["v"], descale_q=ts["descale_q"], descale_k=ts["descale_k"],
        descale_v=ts["descale_v"], descale_s=ts["descale_s"], scale_s=ts["scale_s"], scale_o=ts["scale_o"],
        generate_stats=False, attn_scale=1.0 / math.sqrt(case.d), name="sdpa_fp8", **mask)
    dims, strides = bshd(b, sq, case.heads_q, case.dv)
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    amaxes = [("amax_o", amax_o)] + ([("amax_s", amax_s)] if amax_s_output else [])
    for name, a in amaxes:
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        ts[name] = a
    ts["o"] = o
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, ts


class CudnnFp8:
    """A callable over variant packs: cuDNN's fp8 forward of one case (cudnn_fp8_graph), its
    workspace, and per input set a pack with its own fp8 output. P is scaled by 448 into e4m3
    (descale_s its inverse), O by 1 / v's descale (so O's e4m3 values span V's)."""

    def __init__(self, m, case):
        t, cudnn = m.torch, m.cudnn_fe
        self.t, self.case, self.handle = t, case, m.cudnn_handle()
        try:
            self.graph, self.ts = cudnn_fp8_graph(cudnn, case, self.handle)
        except Exception as first:
            try:
                self.graph, self.ts = cudnn_fp8_graph(cudnn, case, self.handle, amax_s_output=True)
            except Exception as second:
                raise RuntimeError(f"{one_line(first)}; with amax_s an output: {one_line(second)}") from second
        engine = getattr(self.graph, "selected_engine", None)
        self.engine = getattr(engine, "name", None) or "the cuDNN backend"
        size = self.graph.get_workspace_size()
        self.workspace = t.empty(max(1, size), dtype=t.uint8, device="cuda")

    def pack(self, s):
        t, c, ts = self.t, self.case, self.ts
        one = lambda x: t.full((1, 1, 1, 1), x, dtype=t.float32, device="cuda")
        p = {ts["q"]: s["q"], ts["k"]: s["k"], ts["v"]: s["v"],
             ts["descale_q"]: s["q_descale_t"], ts["descale_k"]: s["k_descale_t"], ts["descale_v"]: s["v_descale_t"],
             ts["descale_s"]: one(1.0 / E4M3_MAX), ts["scale_s"]: one(E4M3_MAX), ts["scale_o"]: 1.0 / s["v_descale_t"],
             ts["o"]: t.empty(c.batch, c.seqlen_q, c.heads_q, c.dv, dtype=t.float8_e4m3fn, device="cuda")}
        for name in ("amax_o", "amax_s"):
            if name in ts:
                p[ts[name]] = one(0.0)
        return p

    def output(self, p):
        """A pack's O in float32: the e4m3 values over scale_o."""
        return p[self.ts["o"]].float() / p[self.ts["scale_o"]].reshape(())

    def __call__(self, p):
        self.graph.execute(p, self.workspace, handle=self.handle)
        return p[self.ts["o"]]


def check_fp8(m, case, s, out, name, per_tensor=False):
    """An fp8 forward's O (float, batch 0, up to CHECK_HEADS heads, CHECK_ROWS query rows) against
    the float32 reference of the dequantized inputs: per-(batch, KV head) descales, or with
    `per_tensor` the per-tensor ones cuDNN was given."""
    hs = list(range(min(CHECK_HEADS, case.heads_q)))
    kvh = [h // (case.heads_q // case.heads_kv) for h in hs]
    sq, sk = case.seqs[0]
    r = min(CHECK_ROWS, sq)
    r0 = sq - r if case.causal else 0

    def deq(x, rows):
        sl = s[x][0, rows].float()[:, kvh if x != "q" else hs]  # (rows, H, d); fp8 sliced, then widened
        if per_tensor:
            return (sl * s[x + "_descale_t"].reshape(())).transpose(0, 1)
        return (sl * s[x + "_descale"][0, kvh][None, :, None]).transpose(0, 1)
    ref = reference(m, deq("q", slice(r0, r0 + r)), deq("k", slice(None)), deq("v", slice(None)), case.causal, sq, sk)
    return check_line(name, [("O", out[0, r0:r0 + r, hs].transpose(0, 1), ref)])


# ---- decode ---------------------------------------------------------------------------------


def contiguous_decode_fn(m, name, q, seqlens):
    """f((k, v)) → out: a peer's decode of q (batch, 1, heads_q, d) on a contiguous bf16 cache,
    k and v (batch, heads_kv, keys, d) (SDPA's layout; FlashAttention-3 reads them as (batch,
    keys, heads_kv, d) views)."""
    qt = q.transpose(1, 2)  # (b, heads, 1, d) for SDPA
    if name in ("cudnn", "fa2"):
        return lambda kv: m.F.scaled_dot_product_attention(qt, kv[0], kv[1], enable_gqa=True)
    if name == "cudnn_expanded":
        return lambda kv: m.F.scaled_dot_product_attention(qt, kv[0], kv[1])
    if name == "fa3":
        return lambda kv: first(m.fa3.flash_attn_with_kvcache(
            q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), cache_seqlens=seqlens, num_splits=0))
    raise ValueError(f"no contiguous decode for {name}")


def fp8_cache(t, rows, heads_kv, d):
    """One K or V of a paged fp8 cache: `rows` rows (heads_kv, d) of standard normal bf16 draws
    quantized with one scale per KV head, amax / 448 (quantize_e4m3's rule; vLLM's k_scale: a
    stored value x stands for scale · x). Returns (float8_e4m3fn (rows, heads_kv, d), float32
    scales (heads_kv,))."""
    x8, scale = quantize_e4m3(t, t.randn(1, rows, heads_kv, d, device="cuda", dtype=t.bfloat16), heads_kv)
    return x8.view(rows, heads_kv, d), scale.reshape(heads_kv)


def dequantized_cache(x8, scale, dtype):
    """fp8_cache's values (rows, heads_kv, d) in `dtype`: the stored values times their scales."""
    return dequantize_e4m3(x8.unsqueeze(0), scale.unsqueeze(0), dtype).squeeze(0)


def gathered_fp8(t, x8, pages, page):
    """One sequence's keys (keys, heads_kv, d) of a paged fp8 cache (rows, heads_kv, d), through
    its row of the block table `pages` (int64), as float8_e4m3fn. Gathered as bytes: no index
    kernel for float8 types is assumed."""
    h, d = x8.shape[-2:]
    return x8.view(t.uint8).view(-1, page, h, d)[pages].reshape(-1, h, d).view(t.float8_e4m3fn)


class DeadContext(Exception):
    """The CUDA context took a sticky error (an illegal address, a trap): the run stops, and
    the tables so far are still written."""


class Runner:
    """Runs the cases of a pass: inputs, warm-up, check, rounds, one row per case."""

    def __init__(self, a, m):
        self.a, self.m = a, m
        self.gpu = Gpu(m.torch, a.calls, a.head_start)
        props = m.torch.cuda.get_device_properties(0)
        self.l2 = getattr(props, "L2_cache_size", 0) or L2_BYTES
        self.t0 = time.time()
        self.labels = []  # --profile

    def over_budget(self):
        return self.a.budget is not None and time.time() - self.t0 > self.a.budget

    def prepare(self, libs, make_call, case_label):
        """{name: Lib} of the libraries whose call could be made and warmed up."""
        live = {}
        for name in libs:
            ctx = self.m.ctx(name.partition("@")[0])  # decode's columns are NAME@PAGE
            try:
                with ctx(), warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    call = make_call(name)
                    first_s, host = self.gpu.warm(call, self.a.warmup)
                for w in list(dict.fromkeys(str(w.message).splitlines()[0][:140] for w in seen))[:2]:
                    print(f"  {name}: warning: {w}", flush=True)
                lib = Lib(name, ctx, call)
                lib.host_us = host
                live[name] = lib
                if first_s > 2:
                    print(f"  {name}: first call {first_s:.1f} s", flush=True)
            except Exception as ex:
                print(f"  {name}: {case_label}: {one_line(ex)}", flush=True)
                self.recover()
        return live

    def recover(self):
        t = self.m.torch
        try:
            t.cuda.synchronize()
            t.cuda.empty_cache()
        except Exception as ex:  # a sticky CUDA error: nothing after it can run
            raise DeadContext(one_line(ex)) from ex

    def time(self, live, label):
        """Rounds (or, with --profile, the marked calls) of the live libraries."""
        if self.a.profile:
            self.profile(live, label)
            return {n: [(float("nan"), 0.0)] for n in live}

        def one(name):
            lib = live[name]
            with lib.ctx(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ms, host = self.gpu.round(lib.call, lib.host_us)
            lib.host_us = max(lib.host_us, host)
            return ms, host
        return run_rounds(list(live), self.a.rounds, one, note=lambda s: print(s, flush=True))

    def profile(self, live, label):
        t = self.m.torch
        for name, lib in live.items():
            with lib.ctx(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t.cuda.synchronize()
                t.cuda.cudart().cudaProfilerStart()
                for _ in range(3):
                    lib.call()
                    t.cuda._sleep(MARK_CYCLES)
                    self.labels.append({"case": label, "lib": name})
                t.cuda.synchronize()
                t.cuda.cudart().cudaProfilerStop()

    def progress(self, i, n, label):
        print(f"[{i}/{n}] {label}  ({time.time() - self.t0:.0f} s)", flush=True)

    # -- forward and backward --

    def fixed(self, table, cases, backward):
        m = self.m
        libs = m.available(table.libs)
        print(f"\n== {table.title}\n{table.header()}", flush=True)
        for i, case in enumerate(cases, 1):
            if self.over_budget():
                print(f"budget of {self.a.budget} s spent: {len(cases) - i + 1} cases left out", flush=True)
                break
            self.progress(i, len(cases), case.label)
            n = copies_for(case.set_bytes(), self.l2)
            try:
                m.torch.manual_seed(self.a.seed)
                sets = make_sets(m, case, n, backward)
            except Exception as ex:
                print(f"  inputs: {one_line(ex)}", flush=True)
                self.recover()
                continue
            flops = case.flops() * (BWD_FACTOR if backward else 1.0)
            graphs = {}

            def make_call(name):
                f = fwd_fn(m, m.family(name), case)
                if not backward:
                    return rotating(sets, f)
                outs = [f(s) for s in sets]  # the forward, recorded once per set
                graphs[name] = outs
                j = [0]

                def call():
                    k = j[0] % len(sets)
                    j[0] += 1
                    s = sets[k]
                    return m.torch.autograd.grad(outs[k], (s["q"], s["k"], s["v"]), s["do"], retain_graph=True)
                return call
            live = self.prepare(libs, make_call, case.label)
            if "fa4" in live:
                try:
                    s0 = sets[0]
                    if backward:
                        o = graphs["fa4"][0]
                        grads = m.torch.autograd.grad(o, (s0["q"], s0["k"], s0["v"]), s0["do"], retain_graph=True)
                        print(check_bwd(m, case, s0, o, grads), flush=True)
                    else:
                        print(check_fwd(m, case, s0, fwd_fn(m, "fa4", case)(s0)), flush=True)
                except Exception as ex:
                    print(f"  check fa4: {one_line(ex)}", flush=True)
                    self.recover()
            results = self.time(live, case.label)
            if not self.a.profile:
                row = table.add(case.label, results, lambda ms: flops / (ms * 1e-3) / 1e12)
                print(table.line(row), flush=True)
            del sets, graphs, live
            self.recover()

    # -- fp8 --

    def fp8(self, table, cases):
        """fp8 inputs: fa4 and FlashAttention-3 with per-(batch, KV head) descales, cuDNN with
        per-tensor ones on the same bytes, fa4's bf16 forward on the dequantized values."""
        m = self.m
        libs = m.available(table.libs)
        print(f"\n== {table.title}\n{table.header()}", flush=True)
        for i, case in enumerate(cases, 1):
            if self.over_budget():
                print(f"budget of {self.a.budget} s spent: {len(cases) - i + 1} cases left out", flush=True)
                break
            self.progress(i, len(cases), case.label)
            try:
                m.torch.manual_seed(self.a.seed)
                sets = make_fp8_sets(m, case, copies_for(case.fp8_set_bytes(), self.l2))
                wide = dequantized_sets(m, sets[:copies_for(case.set_bytes(), self.l2)]) if "fa4_bf16" in libs else []
            except Exception as ex:
                print(f"  inputs: {one_line(ex)}", flush=True)
                self.recover()
                continue
            flops = case.flops()
            cudnn_ = {}

            def make_call(name):
                if name == "fa4_bf16":
                    return rotating(wide, fwd_fn(m, "fa4", case))
                if name == "cudnn_fp8":
                    g = CudnnFp8(m, case)
                    packs = [g.pack(s) for s in sets]
                    cudnn_.update(graph=g, packs=packs)
                    print(f"  cudnn_fp8: {g.engine}, workspace {g.workspace.numel() / 2**20:.1f} MiB", flush=True)
                    return rotating(packs, g)
                return rotating(sets, fp8_fn(m, m.family(name), case))
            live = self.prepare(libs, make_call, case.label)
            for name in [x for x in ("fa4", "fa3", "cudnn_fp8") if x in live]:
                try:
                    if name == "cudnn_fp8":
                        g, p = cudnn_["graph"], cudnn_["packs"][0]
                        g(p)
                        line = check_fp8(m, case, sets[0], g.output(p), "cudnn_fp8 O (per-tensor descales)", True)
                    else:
                        line = check_fp8(m, case, sets[0], fp8_fn(m, name, case)(sets[0]), f"{name} fp8 O")
                    print(line, flush=True)
                except Exception as ex:
                    print(f"  check {name}: {one_line(ex)}", flush=True)
                    self.recover()
            results = self.time(live, case.label)
            if not self.a.profile:
                row = table.add(case.label, results, lambda ms: flops / (ms * 1e-3) / 1e12)
                print(table.line(row), flush=True)
            del sets, wide, cudnn_, live
            self.recover()

    # -- decode --

    def decode(self, tables, cases):
        """`tables`: {page: Table}; every page size's fa4 and fa4cute columns and the contiguous
        peers in the same rounds per shape."""
        m, t = self.m, self.m.torch
        pages = list(tables)
        names = m.available(PASS_LIBS["decode"])
        per_page = [n for n in names if m.family(n) in ("fa4", "fa4cute")]
        shared = [n for n in names if n not in per_page]
        cols = [f"{n}@{p}" for p in pages for n in per_page] + shared
        print(f"\n== decode, pages {', '.join(map(str, pages))}: bf16, {DECODE_HEADS[0]}/{DECODE_HEADS[1]} heads, "
              f"d{DECODE_D}, one query row; TB/s of K, V, Q and O\n{'page':<5}{tables[pages[0]].header()}", flush=True)
        hq, hkv, d = DECODE_HEADS[0], DECODE_HEADS[1], DECODE_D
        kw = dict(device="cuda", dtype=t.bfloat16)
        for i, case in enumerate(cases, 1):
            if self.over_budget():
                print(f"budget of {self.a.budget} s spent: {len(cases) - i + 1} shapes left out", flush=True)
                break
            self.progress(i, len(cases), case.label)
            b, sk = case.batch, case.keys
            n = copies_for(case.kv_bytes(), self.l2)
            try:
                t.manual_seed(self.a.seed)
                q = t.randn(b, 1, hq, d, **kw)
                pools = [(t.randn(b * sk, hkv, d, **kw), t.randn(b * sk, hkv, d, **kw)) for _ in range(n)]
                tables_ = {p: t.randperm(b * sk // p, device="cuda").to(t.int32).view(b, sk // p) for p in pages}
                seqlens = t.full((b,), sk, device="cuda", dtype=t.int32)
                cont = [(t.randn(b, hkv, sk, d, **kw), t.randn(b, hkv, sk, d, **kw)) for _ in range(n)] \
                    if any(x in shared for x in ("cudnn", "fa2", "fa3", "cudnn_expanded")) else []
                g = hq // hkv
                expanded = [(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) for k, v in cont] \
                    if "cudnn_expanded" in shared else []
            except Exception as ex:
                print(f"  inputs: {one_line(ex)}", flush=True)
                self.recover()
                continue

            def make_call(col):
                name, _, page = col.partition("@")
                fam = m.family(name)
                if fam == "fa4":
                    # fa4 validates the table on the host: given on the CPU (its documented form) it
                    # costs no synchronisation; a CUDA table would be copied back every call.
                    p = int(page)
                    table_h, seqlens_h = tables_[p].cpu(), seqlens.cpu()
                    return rotating(pools, lambda kv: m.fa4.flash_attn_with_kvcache(
                        q, kv[0].view(-1, p, hkv, d), kv[1].view(-1, p, hkv, d), cache_seqlens=seqlens_h,
                        block_table=table_h))
                if fam == "fa4cute":
                    p = int(page)
                    return rotating(pools, lambda kv: first(m.fa4cute.flash_attn_varlen_func(
                        q, kv[0].view(-1, p, hkv, d), kv[1].view(-1, p, hkv, d), seqused_k=seqlens,
                        page_table=tables_[p])))
                return rotating(expanded if name == "cudnn_expanded" else cont,
                                contiguous_decode_fn(m, name, q, seqlens))
            live = self.prepare(cols, make_call, case.label)
            self.gqa_memory(live, case)
            for col in [c for c in live if c.startswith("fa4@")]:
                p = int(col.partition("@")[2])
                try:
                    out = make_call(col)()
                    kl = pools[0][0].view(-1, p, hkv, d)[tables_[p][0].long()].reshape(sk, hkv, d)
                    vl = pools[0][1].view(-1, p, hkv, d)[tables_[p][0].long()].reshape(sk, hkv, d)
                    ref = reference(m, q[0].transpose(0, 1), kl.transpose(0, 1).repeat_interleave(g, 0),
                                    vl.transpose(0, 1).repeat_interleave(g, 0), False, 1, sk)
                    print(check_line(f"fa4 page {p}", [("O", out[0].transpose(0, 1), ref)]), flush=True)
                except Exception as ex:
                    print(f"  check {col}: {one_line(ex)}", flush=True)
                    self.recover()
            results = self.time(live, case.label)
            self.page_rows(tables, case.label, results, lambda ms: case.bytes() / (ms * 1e-3) / 1e12)
            del pools, cont, expanded, live, tables_
            self.recover()

    def page_rows(self, tables, label, results, metric):
        """One row per page size's table from the rounds of columns NAME@PAGE (that page's) and
        NAME (shared by every page size), printed (not with --profile)."""
        if self.a.profile:
            return
        for p, table in tables.items():
            res = {lib: results[f"{lib}@{p}"] if f"{lib}@{p}" in results else results.get(lib)
                   for lib in table.libs}
            row = table.add(label, {k: v for k, v in res.items() if v}, metric)
            print(f"{p:<5}{table.line(row)}", flush=True)

    def decode_fp8(self, tables, cases):
        """`tables`: {page: Table}; per shape, every page size's fa4 column over a paged e4m3
        cache and fa4_bf16 over the paged bf16 cache of its dequantized values (the same block
        tables), and the contiguous bf16 peers, in the same rounds. Values in µs per call."""
        m, t = self.m, self.m.torch
        pages = list(tables)
        names = m.available(PASS_LIBS["decode-fp8"])
        per_page = [n for n in names if m.family(n) in ("fa4", "fa4_bf16")]
        shared = [n for n in names if n not in per_page]
        cols = [f"{n}@{p}" for p in pages for n in per_page] + shared
        hq, hkv, d = DECODE_HEADS[0], DECODE_HEADS[1], DECODE_D
        print(f"\n== decode-fp8, pages {', '.join(map(str, pages))}: bf16 queries, {hq}/{hkv} heads, d{d}, one "
              f"query row; fa4 over an e4m3 cache (a scale per KV head), fa4_bf16 over its dequantized values in "
              f"bf16, peers over a contiguous bf16 cache; µs per call (lower is better)\n"
              f"{'page':<5}{tables[pages[0]].header()}", flush=True)
        g = hq // hkv
        kw = dict(device="cuda", dtype=t.bfloat16)
        for i, case in enumerate(cases, 1):
            if self.over_budget():
                print(f"budget of {self.a.budget} s spent: {len(cases) - i + 1} shapes left out", flush=True)
                break
            self.progress(i, len(cases), case.label)
            b, sk = case.batch, case.keys
            # The fp8 cache is half the bytes: more copies of it span the same L2s.
            n8, n16 = copies_for(case.kv_bytes(elem=1), self.l2), copies_for(case.kv_bytes(), self.l2)
            try:
                t.manual_seed(self.a.seed)
                q = t.randn(b, 1, hq, d, **kw)
                pools = []  # per copy (k8, v8, k_scale, v_scale): K and V of b · sk rows, their scales
                for _ in range(n8):
                    (k8, ks), (v8, vs) = fp8_cache(t, b * sk, hkv, d), fp8_cache(t, b * sk, hkv, d)
                    pools.append((k8, v8, ks, vs))
                wide = [(dequantized_cache(k8, ks, t.bfloat16), dequantized_cache(v8, vs, t.bfloat16))
                        for k8, v8, ks, vs in pools[:n16]] if "fa4_bf16" in per_page else []
                tables_ = {p: t.randperm(b * sk // p, device="cuda").to(t.int32).view(b, sk // p) for p in pages}
                seqlens = t.full((b,), sk, device="cuda", dtype=t.int32)
                cont = [(t.randn(b, hkv, sk, d, **kw), t.randn(b, hkv, sk, d, **kw)) for _ in range(n16)] \
                    if shared else []
            except Exception as ex:
                print(f"  inputs: {one_line(ex)}", flush=True)
                self.recover()
                continue

            def make_call(col):
                name, _, page = col.partition("@")
                fam = m.family(name)
                if fam in ("fa4", "fa4_bf16"):
                    # The block table and lengths on the CPU, as in the decode pass (no synchronisation).
                    p = int(page)
                    table_h, seqlens_h = tables_[p].cpu(), seqlens.cpu()
                    if fam == "fa4_bf16":
                        return rotating(wide, lambda kv: m.fa4.flash_attn_with_kvcache(
                            q, kv[0].view(-1, p, hkv, d), kv[1].view(-1, p, hkv, d), cache_seqlens=seqlens_h,
                            block_table=table_h))
                    return rotating(pools, lambda kv: m.fa4.flash_attn_with_kvcache(
                        q, kv[0].view(-1, p, hkv, d), kv[1].view(-1, p, hkv, d), cache_seqlens=seqlens_h,
                        block_table=table_h, k_scale=kv[2], v_scale=kv[3]))
                return rotating(cont, contiguous_decode_fn(m, name, q, seqlens))
            live = self.prepare(cols, make_call, case.label)
            self.gqa_memory(live, case)
            for p in pages:
                checked = [(what, col) for what, col in (("fa4 fp8 O", f"fa4@{p}"), ("fa4 bf16 O", f"fa4_bf16@{p}"))
                           if col in live]
                if not checked:
                    continue
                try:
                    # Sequence 0's keys through the table, dequantized in float32: the reference of both.
                    k8, v8, ks, vs = pools[0]
                    rows = tables_[p][0].long()
                    kf, vf = (gathered_fp8(t, x8, rows, p).float() * sc[None, :, None]
                              for x8, sc in ((k8, ks), (v8, vs)))
                    ref = reference(m, q[0].transpose(0, 1), kf.transpose(0, 1).repeat_interleave(g, 0),
                                    vf.transpose(0, 1).repeat_interleave(g, 0), False, 1, sk)
                    pairs = [(what, make_call(col)()[0].transpose(0, 1), ref) for what, col in checked]
                    print(check_line(f"page {p}, against the dequantized cache", pairs), flush=True)
                except Exception as ex:
                    print(f"  check page {p}: {one_line(ex)}", flush=True)
                    self.recover()
            results = self.time(live, case.label)
            self.page_rows(tables, case.label, results, lambda ms: ms * 1e3)
            del pools, wide, cont, live, tables_
            self.recover()

    def gqa_memory(self, live, case):
        """Whether SDPA's enable_gqa copies K and V to the query heads: the peak memory one call
        allocates, against the K and V it reads."""
        t = self.m.torch
        for name in ("cudnn", "fa2"):
            if name not in live:
                continue
            lib = live[name]
            with lib.ctx():
                t.cuda.synchronize()
                t.cuda.reset_peak_memory_stats()
                base = t.cuda.memory_allocated()
                lib.call()
                t.cuda.synchronize()
                extra = t.cuda.max_memory_allocated() - base
            kv = case.kv_bytes()
            verdict_ = "K/V repeated" if extra >= 0.9 * kv else "K/V not repeated"
            print(f"  {name} enable_gqa: {extra / 1e6:.1f} MB allocated by one call, K+V {kv / 1e6:.1f} MB: {verdict_}",
                  flush=True)


def driver_version():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except Exception:
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="pass_", required=True, metavar="fwd|bwd|fp8|decode|decode-fp8|ncu-table")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--only", help="comma-separated libraries: " + ",".join(LIB_ORDER))
    common.add_argument("--quick", action="store_true", help="fewer shapes, 5 rounds")
    common.add_argument("--rounds", type=int, default=None, help="rounds per library (9; --quick 5)")
    common.add_argument("--calls", type=int, default=10, help="back-to-back calls per round")
    common.add_argument("--warmup", type=int, default=3, help="untimed calls after the first")
    common.add_argument("--seed", type=int, default=0, help="inputs and varlen lengths")
    common.add_argument("--json", metavar="DIR", help="write DIR/<table id>.json")
    common.add_argument("--budget", type=float, default=None, metavar="S",
                        help="start no new shape after S seconds (what ran is still written)")
    common.add_argument("--no-head-start", dest="head_start", action="store_false",
                        help="no GPU sleep before a round: its host path is timed too")
    common.add_argument("--fa4-env", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                        help="one more fa4 column, with this environment around its calls")
    common.add_argument("--profile", metavar="LABELS.json",
                        help="no rounds: 3 marked calls per library and shape inside cudaProfilerStart/Stop")
    f = sub.add_parser("fwd", parents=[common], help="forward grid and extras")
    f.add_argument("--head-dims", action="store_true", help="d 32/80/96/112/160/192 and 192/128 at 4×4096")
    f.add_argument("--gqa", action="store_true", help="32/8 heads d128 causal 2k/4k/8k")
    f.add_argument("--varlen", action="store_true", help="ragged lengths (mean 2k, 1..8k) from --seed")
    f.add_argument("--extras", action="store_true", help="--head-dims --gqa --varlen")
    f.add_argument("--no-grid", dest="grid", action="store_false", help="the extras only")
    b = sub.add_parser("bwd", parents=[common], help="backward grid and extras")
    b.add_argument("--head-dims", action="store_true", help="d 32/80/96/112/160/192 at 4×4096")
    b.add_argument("--dv", action="store_true", help="d_v < d_qk (192/128) at 4×4096, causal and not (table bwd_dv)")
    b.add_argument("--gqa", action="store_true", help="32/8 heads d128 2k/4k/8k, causal and not")
    b.add_argument("--varlen", action="store_true",
                   help="ragged lengths (mean 2k, 1..8k) from --seed, beside the same tokens at fixed length")
    b.add_argument("--extras", action="store_true", help="--head-dims --dv --gqa --varlen")
    b.add_argument("--no-grid", dest="grid", action="store_false", help="the extras only")
    sub.add_parser("fp8", parents=[common], help="the forward grid with fp8 (e4m3) inputs")
    for name, what in (("decode", "paged decode"),
                       ("decode-fp8", "paged decode over an fp8 (e4m3) cache, µs per call")):
        dp = sub.add_parser(name, parents=[common], help=what)
        dp.add_argument("--pages", default=",".join(map(str, DECODE_PAGES)), help="page sizes")
    ln = sub.add_parser("lengths", help="print the varlen batch's lengths (for fa4 bench --lengths)")
    ln.add_argument("--seed", type=int, default=0)
    nt = sub.add_parser("ncu-table", help="kernel-only durations from a profiled --profile run")
    nt.add_argument("raw", metavar="RAW.csv")
    nt.add_argument("labels", metavar="LABELS.json")
    nt.add_argument("--json", metavar="DIR")
    a = ap.parse_args(argv)
    if a.pass_ in ("ncu-table", "lengths"):
        return a
    if a.rounds is None:
        a.rounds = 5 if a.quick else 9
    if a.rounds < 1 or a.calls < 1 or a.warmup < 0:
        ap.error("--rounds and --calls must be ≥ 1, --warmup ≥ 0")
    if a.only is not None:
        a.only = [x.strip() for x in a.only.split(",") if x.strip()]
        bad = [x for x in a.only if x not in LIB_ORDER]
        if bad:
            ap.error(f"--only: unknown {', '.join(bad)} (known: {', '.join(LIB_ORDER)})")
    try:
        a.env_columns = parse_env_columns(a.fa4_env)
    except ValueError as ex:
        ap.error(str(ex))
    if a.pass_ in ("decode", "decode-fp8"):
        try:
            a.pages = [int(x) for x in a.pages.split(",")]
        except ValueError:
            ap.error(f"--pages {a.pages!r}: expected comma-separated integers")
        for p in a.pages:
            if p < 1 or any(k % p for _, k in DECODE_SHAPES):
                ap.error(f"--pages: {p} must divide every shape's key count")
    if a.pass_ in ("fwd", "bwd") and a.extras:
        a.head_dims = a.gqa = a.varlen = True
        if a.pass_ == "bwd":
            a.dv = True
    return a


def tables_for(a, env_names):
    """[(Table, cases, kind)] of a pass."""
    libs = lambda p: list(PASS_LIBS[p]) + env_names
    out = []
    if a.pass_ == "fwd":
        if a.grid:
            out.append((Table("fwd_grid", "Forward, bf16, 16k tokens, hidden 2048", "TFLOP/s", libs("fwd")),
                        fwd_cases(a.quick), "fwd"))
        if a.head_dims:
            out.append((Table("fwd_headdims", f"Forward, bf16, other head dims, batch {HEADDIM_BATCH} × {HEADDIM_SEQLEN}, "
                              "heads 2048 // d", "TFLOP/s", libs("fwd")), headdim_cases(a.quick), "fwd"))
        if a.gqa:
            out.append((Table("fwd_gqa", "Forward, bf16, GQA 32/8 heads, d128, causal, 16k tokens", "TFLOP/s", libs("fwd")),
                        gqa_cases(a.quick), "fwd"))
        if a.varlen:
            vl = [n for n in libs("fwd") if n in VARLEN_LIBS or n in env_names]
            lengths = varlen_lengths(a.seed)
            out.append((Table("fwd_varlen", f"Forward, bf16, varlen: {len(lengths)} sequences of 1..8k tokens "
                              f"(mean {TOKENS // len(lengths)}, seed {a.seed}) and the same tokens at fixed length, "
                              "hidden 2048", "TFLOP/s", vl),
                        varlen_cases(a.seed, a.quick), "fwd"))
    elif a.pass_ == "fp8":
        out.append((Table("fwd_fp8", "Forward, fp8 e4m3 inputs, 16k tokens, hidden 2048 (fa4 and FlashAttention-3: "
                          "per-(batch, KV head) descales, bf16 O; cuDNN: per-tensor descales, fp8 O; fa4 bf16: the "
                          "dequantized inputs)", "TFLOP/s", libs("fp8"), own="fa4_bf16"),
                    fwd_cases(a.quick), "fp8"))
    elif a.pass_ == "bwd":
        if a.grid:
            out.append((Table("bwd_grid", "Backward, bf16, 16k tokens, hidden 2048 (FLOPs 2.5 × forward)", "TFLOP/s",
                              libs("bwd")), fwd_cases(a.quick), "bwd"))
        if a.head_dims:
            out.append((Table("bwd_headdims", f"Backward, bf16, other head dims, batch {HEADDIM_BATCH} × "
                              f"{HEADDIM_SEQLEN}, heads 2048 // d (FLOPs 2.5 × forward)", "TFLOP/s", libs("bwd")),
                        headdim_cases(a.quick, dv_cases=False), "bwd"))
        if a.dv:
            out.append((Table("bwd_dv", f"Backward, bf16, d_v < d_qk, batch {HEADDIM_BATCH} × {HEADDIM_SEQLEN}, heads "
                              "2048 // d_qk (FLOPs 2.5 × forward)", "TFLOP/s", libs("bwd")),
                        [c for c in headdim_cases(a.quick) if c.dv != c.d], "bwd"))
        if a.gqa:
            out.append((Table("bwd_gqa", "Backward, bf16, GQA 32/8 heads, d128, 16k tokens (FLOPs 2.5 × forward)",
                              "TFLOP/s", libs("bwd")), gqa_cases(a.quick, causals=(False, True)), "bwd"))
        if a.varlen:
            vl = [n for n in libs("bwd") if n in VARLEN_LIBS or n in env_names]
            lengths = varlen_lengths(a.seed)
            out.append((Table("bwd_varlen", f"Backward, bf16, varlen: {len(lengths)} sequences of 1..8k tokens "
                              f"(mean {TOKENS // len(lengths)}, seed {a.seed}) and the same tokens at fixed length, "
                              "hidden 2048 (FLOPs 2.5 × forward)", "TFLOP/s", vl),
                        varlen_cases(a.seed, a.quick), "bwd"))
    return out


def decode_tables(a, env_names):
    """{page: Table} of the decode and decode-fp8 passes, one table per page size."""
    libs = list(PASS_LIBS[a.pass_]) + env_names
    keys = lambda p: f"{p} key" + ("s" if p > 1 else "")
    if a.pass_ == "decode":
        return {p: Table(f"decode_p{p}", f"Decode, bf16, 32/8 heads, d128, one query row, pages of {keys(p)} "
                         "(peers on a contiguous cache)", "TB/s", libs)
                for p in a.pages}
    # Times, not TB/s: the fp8 cache is half the bytes of the others.
    return {p: Table(f"decode_fp8_p{p}", f"Decode over an fp8 e4m3 cache, bf16 queries, 32/8 heads, d128, one query "
                     f"row, pages of {keys(p)} (fa4 fp8: the e4m3 cache, a scale per KV head; fa4 bf16: its "
                     "dequantized values in bf16; peers on a contiguous bf16 cache)", "µs per call", libs,
                     ratios=[Ratio(*g) for g in DECODE_FP8_GOALS], names={"fa4": "fa4 fp8"},
                     higher_is_better=False)
            for p in a.pages}


def main(argv=None):
    a = parse_args(argv)
    if a.pass_ == "ncu-table":
        return ncu_table(a)
    if a.pass_ == "lengths":
        print(",".join(map(str, varlen_lengths(a.seed))))
        return
    m = Mods(a.only, a.env_columns, PASS_LIBS[a.pass_])
    t = m.torch
    for n in m.notes:
        print(n, flush=True)
    env_names = [name for name, _ in a.env_columns]
    ver = {"fa4": m.versions["fa4"], "fa3": m.versions["fa3"], "fa4cute": m.versions["flash_attn_4"],
           "cudnn_fp8": m.versions.get("cudnn_frontend")}
    print(f"{t.cuda.get_device_name()}, torch {t.__version__}, cuDNN {m.versions['cudnn']}; libraries: "
          + ", ".join(f"{n} {ver[n]}" if ver.get(n) else n for n in m.available(LIB_ORDER)), flush=True)
    print(f"method: {method_line(a)}; h = host path slower than the GPU time", flush=True)
    warnings.filterwarnings("ignore", message=".*SDPA.*")
    r = Runner(a, m)
    tables = []
    try:
        if a.pass_ in ("decode", "decode-fp8"):
            by_page = decode_tables(a, env_names)
            tables = list(by_page.values())
            (r.decode if a.pass_ == "decode" else r.decode_fp8)(by_page, decode_cases(a.quick))
        else:
            for table, cases, kind in tables_for(a, env_names):
                tables.append(table)
                if kind == "fp8":
                    r.fp8(table, cases)
                else:
                    r.fixed(table, cases, kind == "bwd")
    except DeadContext as ex:
        print(f"CUDA context unusable, stopping: {ex}", flush=True)
    if a.profile:
        with open(a.profile, "w") as f:
            json.dump(r.labels, f)
        print(f"{len(r.labels)} profiled calls labelled in {a.profile}")
        return
    for table in tables:
        summarise(table)
    print(f"head start: {r.gpu.reruns} rounds run again for a short head start (scale now "
          f"{r.gpu.head_start_scale:g})", flush=True)
    if a.json:
        meta = dict(date=datetime.date.today().isoformat(), gpu=t.cuda.get_device_name(), driver=driver_version(),
                    versions=m.versions, method=method_line(a), lib_names=m.lib_names(),
                    head_start_reruns=r.gpu.reruns)
        for p in write_tables(tables, a.json, meta):
            print(f"wrote {p}", flush=True)
    print(f"done in {time.time() - r.t0:.0f} s", flush=True)


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarise(table):
    """The table's geomean of fa4 / best peer and its verdict counts, one line; with an own
    column, a second line: fa4's speed-up over it; per goal column (Ratio), a line: its geomean
    and the cases that meet the goal."""
    ratios = [r["_summary"]["ratio"] for r in table.rows if "ratio" in r["_summary"]]
    if ratios:
        v = [r["_summary"].get("verdict") for r in table.rows]
        print(f"{table.id}: fa4 / best peer geomean {geomean(ratios):.3f} over {len(ratios)} cases (min "
              f"{min(ratios):.2f}, max {max(ratios):.2f}); {v.count('win')} win, {v.count('tie')} tie, "
              f"{v.count('loss')} loss", flush=True)
    own = [r["_summary"]["own"] for r in table.rows if "own" in r["_summary"]]
    if own:
        print(f"{table.id}: fa4 / {table.own} geomean {geomean(own):.3f}x over {len(own)} cases (min {min(own):.2f}, "
              f"max {max(own):.2f}); at least {OWN_TARGET}x on {sum(x >= OWN_TARGET for x in own)}", flush=True)
    for g in table.ratios:
        qs = [r["_summary"]["ratios"][g.name] for r in table.rows if g.name in r["_summary"]["ratios"]]
        if qs:
            print(f"{table.id}: {g.name} geomean {geomean(qs):.3f} over {len(qs)} cases (min {min(qs):.3f}, max "
                  f"{max(qs):.3f}); {'at most' if g.at_most else 'at least'} {g.bound:g} on "
                  f"{sum(g.met(q) for q in qs)}", flush=True)


if __name__ == "__main__":
    main()
