"""Where the time goes, one row per profiled launch, from Nsight Compute's raw CSV pages.

    python3 bench/profile_summary.py [--bench BENCH.json] [--merged OUT.csv] RAW.csv ...

Each RAW.csv is `ncu --import REPORT --csv --page raw --print-units base` (bench/profile.sh
writes them): a header row of metric names, a row of units, then one row per profiled launch.
A file named LABEL-dHEAD-sSEQLEN-cCAUSAL.csv (fa4-d128-s1024-c1.csv) is a shape of the
FlashAttention grid (16k tokens, hidden 2048) and also gets TFLOP/s from ncu's duration; with
--bench (the JSON of `fa4 bench --backend cuda --json` on the same shapes) the fa4 rows show the
event-timed median beside it. --merged writes every collected metric, one row per launch.

Percentages are of the peak sustained rate over the cycles the unit was active (ncu's
`pct_of_peak_sustained_active`), except SM, shared-memory, L2 and DRAM throughput, which are over
the kernel's elapsed cycles. A metric a report lacks prints as "-".
"""
import argparse, csv, json, os, re, sys

TOKENS, HIDDEN = 16384, 2048  # the FlashAttention grid (bench/peers.py, `fa4 bench` defaults)
SHAPE = re.compile(r"-d(\d+)-s(\d+)-c([01])$")

# Each quantity: the metric names that give it, best first (names differ between ncu versions
# and sections; these are the sm90 spellings of ncu 2025.x).
DURATION = ("gpu__time_duration.sum",)
TENSOR = (  # wgmma is counted on the tensor pipe (and, on sm90, under its hmma sub-pipe)
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
)
XU = (  # MUFU (ex2) and the other transcendentals
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active",
)
FMA = (
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
)
ISSUE = (
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__inst_issued.avg.pct_of_peak_sustained_active",
)
SM = ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)
REGS = ("launch__registers_per_thread",)
OCCUPANCY = ("sm__warps_active.avg.pct_of_peak_sustained_active",)
SMEM = ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",)
BANK_CONFLICTS = ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",)
L2 = ("lts__throughput.avg.pct_of_peak_sustained_elapsed",)
DRAM = (
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
)
DRAM_PARTS = (  # sm90 reports without the two above: read and write, added
    "dram__bytes_read.sum.pct_of_peak_sustained_elapsed",
    "dram__bytes_write.sum.pct_of_peak_sustained_elapsed",
)
GMMA_ISSUE = ("sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",)
TMA = ("sm__pipe_tma_cycles_active.avg.pct_of_peak_sustained_active",)
CPI = ("smsp__average_warp_latency_per_inst_issued.ratio",)  # warp cycles per issued instruction

# Warp-state families, best first: the WarpStateStats section's per-issue ratios, the latency
# ratios, the per-warp-active percentages, then PC-sampling counts. Within one family every
# reason has the same normalisation, so a reason's share is its value over the family's sum.
STALL_FAMILIES = (
    re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$"),
    re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)\.ratio$"),
    re.compile(r"^smsp__warp_issue_stalled_(\w+?)_per_warp_active\.pct$"),
    re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$"),
)
NOT_A_STALL = {"selected"}  # the cycle a warp issues: in the sum, never in the top three
SHORT = {
    "long_scoreboard": "long_sb",
    "short_scoreboard": "short_sb",
    "math_pipe_throttle": "math_thr",
    "mio_throttle": "mio_thr",
    "lg_throttle": "lg_thr",
    "tex_throttle": "tex_thr",
    "branch_resolving": "branch",
    "dispatch_stall": "dispatch",
    "no_instruction": "no_inst",
    "no_instructions": "no_inst",
    "not_selected": "not_sel",
    "warpgroup_arrive": "wg_arrive",
}
MICROSECONDS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                "second": 1e6, "s": 1e6, "": 1e-3}  # --print-units base gives nsecond


def number(text):
    """A metric value as ncu prints it ("1,234.5", "n/a", ""), or None."""
    try:
        return float(text.strip().replace(",", ""))
    except (AttributeError, ValueError):
        return None


class Launch:
    """One profiled launch: its label, ncu's columns (name → (value text, unit))."""

    def __init__(self, label, cols):
        self.label, self.cols = label, cols

    def text(self, name):
        return self.cols.get(name, ("", ""))[0]

    def get(self, names):
        for n in names:
            v = number(self.cols[n][0]) if n in self.cols else None
            if v is not None:
                return v
        return None

    def duration_us(self):
        for n in DURATION:
            if n in self.cols:
                v, unit = number(self.cols[n][0]), self.cols[n][1].strip()
                if v is not None and unit in MICROSECONDS:
                    return v * MICROSECONDS[unit]
        return None

    def dram(self):
        v = self.get(DRAM)
        if v is None:
            parts = [self.get((n,)) for n in DRAM_PARTS]
            v = sum(parts) if all(p is not None for p in parts) else None
        return v

    def stalls(self):
        """[(reason, share of all warp-state cycles)], largest first, from the best family."""
        for family in STALL_FAMILIES:
            found = {}
            for name, (value, _) in self.cols.items():
                m = family.match(name)
                v = number(value) if m else None
                if v is not None and not m.group(1).endswith("_not_issued"):
                    found[m.group(1)] = v
            total = sum(found.values())
            if len(found) >= 3 and total > 0:
                ranked = sorted(((v / total, r) for r, v in found.items() if r not in NOT_A_STALL), reverse=True)
                return [(r, s) for s, r in ranked]
        return []

    def shape(self):
        m = SHAPE.search(self.label.split("#")[0])
        return tuple(int(x) for x in m.groups()) if m else None


def read_raw(path):
    """The launches in one raw-page CSV (lines before ncu's header row, ==PROF== and the
    application's output, are skipped). Labelled by the file's stem, #i when there are several."""
    with open(path, newline="", errors="replace") as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        return []
    rows = [r for r in csv.reader(l for l in lines[start:] if not l.startswith("==")) if r]
    header, units = rows[0], [""] * len(rows[0])
    if len(rows) > 1 and rows[1][0] == "":  # the units row: its ID cell is empty
        units = rows[1]
    rest = [r for r in rows[1:] if number(r[0]) is not None]  # a launch's row starts with its ID
    stem = os.path.splitext(os.path.basename(path))[0]
    launches = []
    for i, row in enumerate(rest):
        cols = {h: (row[j] if j < len(row) else "", units[j] if j < len(units) else "") for j, h in enumerate(header)}
        launches.append(Launch(stem if len(rest) == 1 else f"{stem}#{i}", cols))
    return launches


def flops(d, s, causal):
    """4·b·h·s²·d on the grid (b = tokens / s, h = hidden / d), halved for causal."""
    b, h = TOKENS // s, HIDDEN // d
    return 4 * b * h * s * s * d / (2 if causal else 1)


def bench_times(path):
    """{(d, seqlen, causal): event-timed median µs} from `fa4 bench --json`, or {}."""
    try:
        with open(path) as f:
            return {(r["d"], r["seqlen"], int(r["causal"])): r["median_ms"] * 1e3 for r in json.load(f)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"(no event timings: {path}: {e})", file=sys.stderr)
        return {}


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def count(v):
    if v is None:
        return "-"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.1f}{suffix}"
    return f"{v:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="*", help="raw-page CSVs, one or more launches each")
    ap.add_argument("--bench", help="`fa4 bench --backend cuda --json` output on the same shapes")
    ap.add_argument("--merged", help="write every metric of every launch to this CSV")
    a = ap.parse_args()

    launches = []
    for p in a.csv:
        try:
            got = read_raw(p)
        except OSError as e:
            print(f"{p}: {e}", file=sys.stderr)
            continue
        if not got:
            print(f"{p}: no ncu raw-page header, left out", file=sys.stderr)
        launches += got
    if not launches:
        print("no profiled launches to summarise")
        return
    events = bench_times(a.bench) if a.bench else {}

    first = launches[0]
    gpu = first.text("device__attribute_display_name") or f"device {first.text('Device') or '?'}"
    print(f"{gpu} (CC {first.text('CC') or '?'}), {len(launches)} profiled launches")
    w = max(22, max(len(l.label) for l in launches))
    print(f"{'launch':<{w}} {'µs':>8} {'TFLOP/s':>7} {'tensor%':>7} {'xu%':>5} {'fma%':>5} {'issue%':>6} {'sm%':>5}"
          "  top stalls (share of warp cycles)")
    for l in launches:
        us, shape = l.duration_us(), l.shape()
        tf = flops(*shape) / (us * 1e-6) / 1e12 if us and shape else None
        st = " · ".join(f"{SHORT.get(r, r)} {s * 100:.0f}%" for r, s in l.stalls()[:3]) or "-"
        print(f"{l.label:<{w}} {fmt(us):>8} {fmt(tf, '.0f'):>7} {fmt(l.get(TENSOR)):>7} {fmt(l.get(XU)):>5} "
              f"{fmt(l.get(FMA)):>5} {fmt(l.get(ISSUE)):>6} {fmt(l.get(SM)):>5}  {st}")

    print()
    print(f"{'launch':<{w}} {'event µs':>8} {'regs':>4} {'occ%':>5} {'smem%':>5} {'bank-cf':>7} {'L2%':>5} "
          f"{'DRAM%':>5} {'gmma%':>5} {'tma%':>5} {'CPI':>5}  grid × block  kernel")
    for l in launches:
        shape = l.shape()
        ev = events.get(shape) if shape and l.label.startswith("fa4-") else None
        kernel = l.text("Kernel Name")
        kernel = kernel if len(kernel) <= 48 else kernel[:45] + "..."
        print(f"{l.label:<{w}} {fmt(ev):>8} {fmt(l.get(REGS), '.0f'):>4} {fmt(l.get(OCCUPANCY)):>5} "
              f"{fmt(l.get(SMEM)):>5} {count(l.get(BANK_CONFLICTS)):>7} {fmt(l.get(L2)):>5} {fmt(l.dram()):>5} "
              f"{fmt(l.get(GMMA_ISSUE)):>5} {fmt(l.get(TMA)):>5} {fmt(l.get(CPI)):>5}  "
              f"{l.text('Grid Size') or '-'} × {l.text('Block Size') or '-'}  {kernel or '-'}")
    print("\nµs: ncu's gpu__time_duration of the one profiled launch (clocks not locked; caches flushed "
          "before it); event µs: median of `fa4 bench` outside the profiler.\ntensor/xu/fma/gmma/tma/issue: "
          "% of peak over active cycles; sm/smem/L2/DRAM: % of peak over elapsed cycles; bank-cf: shared-memory "
          "bank conflicts (LSU path; wgmma operand reads are not counted there); CPI: warp cycles per issued "
          "instruction; stall shares: of all warp-state cycles, issuing included.")

    if a.merged:
        names = list(dict.fromkeys(n for l in launches for n in l.cols))
        with open(a.merged, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["launch"] + names)
            out.writerow(["(unit)"] + [next((l.cols[n][1] for l in launches if n in l.cols), "") for n in names])
            for l in launches:
                out.writerow([l.label] + [l.text(n) for n in names])


if __name__ == "__main__":
    main()
