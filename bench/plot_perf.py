"""One SVG per measured table of docs/perf.md: where fa4 leads its best peer and where it trails.

Reads docs/data/*.json (or the files given) and writes docs/img/<id>.svg (or under --out). Each
plot has two panels over the table's cases:
- top: fa4's speed relative to the best peer of the case (fa4 / best for a rate, best / fa4 for
  a time), as bars from a line at 1.0: green where fa4 is ahead, red where it is behind, grey
  where level. With spreads in the data the colours follow docs/perf.md's win/tie/loss rule (a
  tie within the larger of the two spreads); without them, the ratio alone (level within 0.5%).
- bottom: every library's value, grouped by case, fa4 first; a library without a value for a
  case (it does not run it) gets no bar and a "–" at the axis. Columns that are not peers
  (fa4's own extra columns, diagnostics: perf_table.py) are drawn in a light blue.

The schema, loading, checks and ratios are bench/perf_table.py's (shared with the markdown
tables); this file only draws. matplotlib (Agg, SVG with text as text, no embedded fonts) is
imported when drawing, so the data side imports without it.

    python3 bench/plot_perf.py                       every docs/data/*.json → docs/img/<id>.svg
    python3 bench/plot_perf.py docs/data/decode.json --out /tmp
    python3 bench/plot_perf.py --markdown FILE.json  the table as markdown instead (perf_table.py)
"""
import argparse, glob, os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_table import (OURS, SchemaError, best_peer, load, markdown, peers, ratio,  # noqa: E402
                        summary, validate, value, verdict)

__all__ = ["load", "validate", "best_peer", "ratio", "verdict", "summary", "colours", "draw", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "docs", "data")
IMG = os.path.join(HERE, "..", "docs", "img")
LEVEL = 0.005                       # |ratio − 1| below this counts as level where no spread is given
AHEAD, BEHIND, EVEN = "#2e7d32", "#c62828", "#9e9e9e"
OURS_COLOUR = "#1f4e9c"
OWN_COLUMN_COLOUR = "#8fb3e8"        # fa4's extra columns and diagnostics: drawn, never the best peer
PEER_COLOURS = ["#e08e45", "#8c8c8c", "#b07cc6", "#5fa8a0", "#c9b458"]


def colours(t):
    """Per row: (label, colour) of the top panel's bar, or None where there is no ratio. The label
    is the verdict ("win", "tie", "loss") where spreads are given, else "ahead", "level", "behind"."""
    out = []
    for r in t["rows"]:
        q = ratio(t, r)
        if q is None:
            out.append(None)
            continue
        v = verdict(t, r)
        if v is None:
            v = "level" if abs(q - 1) < LEVEL else ("ahead" if q > 1 else "behind")
        out.append((v, {"win": AHEAD, "ahead": AHEAD, "loss": BEHIND, "behind": BEHIND}.get(v, EVEN)))
    return out


def draw(t, path):
    """Writes the table's plot to `path`: SVG, or PNG where the name ends in .png (to look at)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "fa4-" + t["id"],
                         "font.size": 8, "axes.titlesize": 9, "font.family": "sans-serif",
                         "axes.spines.top": False, "axes.spines.right": False})
    rows, libs = t["rows"], t["libs"]
    n = len(rows)
    width = max(5.5, 0.42 * n + 1.8)
    fig, (top, bot) = plt.subplots(2, 1, figsize=(width, 5.4), sharex=True,
                                   gridspec_kw={"height_ratios": [1, 1.35], "hspace": 0.08})
    xs = list(range(n))

    # Top: fa4 against the best peer.
    qs = [ratio(t, r) for r in rows]
    cs = colours(t)
    for x, q, c in zip(xs, qs, cs):
        if q is None:
            top.text(x, 1.0, "–", ha="center", va="center", color=EVEN)
            continue
        top.bar(x, q - 1.0, bottom=1.0, width=0.7, color=c[1], linewidth=0)
        top.text(x, q + (0.004 if q >= 1 else -0.004), f"{q:.2f}", ha="center",
                 va="bottom" if q >= 1 else "top", fontsize=6.5)
    top.axhline(1.0, color="black", linewidth=0.8)
    have = [q for q in qs if q is not None]
    if have:
        lo, hi = min(have + [1.0]), max(have + [1.0])
        pad = max(0.04, 0.15 * (hi - lo))
        top.set_ylim(lo - pad, hi + pad)
    what = "fa4 / best peer" if t["higher_is_better"] else "best peer / fa4"
    top.set_ylabel(f"{what}\n(above 1: fa4 faster)")
    s = summary(t)
    note = (f"ahead on {s['ahead']}, behind on {s['behind']} of {s['n']}; geomean {s['geomean']:.2f}"
            if s["n"] else "no case with fa4 and a peer")
    top.set_title(f"{t['title']}\n{t['date']}"
                  + (f", {t['gpu']}" if t["gpu"] else "") + f" · {note}", loc="left")

    # Bottom: every library's value.
    k = len(libs)
    bw = 0.8 / k
    peer_colour = {p: PEER_COLOURS[i % len(PEER_COLOURS)] for i, p in enumerate(peers(t))}
    top_value = max((v for r in rows for v in r["values"].values() if v is not None), default=1)
    for j, lib in enumerate(libs):
        off = (j - (k - 1) / 2) * bw
        colour = OURS_COLOUR if lib == OURS else peer_colour.get(lib, OWN_COLUMN_COLOUR)
        vx, vy, missing = [], [], []
        for x, r in zip(xs, rows):
            v = value(r, lib)
            (missing.append(x + off) if v is None else (vx.append(x + off), vy.append(v)))
        bot.bar(vx, vy, width=bw * 0.92, color=colour, linewidth=0, label=t["lib_names"][lib])
        for x in missing:
            bot.text(x, 0.01 * top_value, "–", ha="center", va="bottom", color=colour, fontsize=7)
    bot.set_ylabel(t["unit"] + (" (higher is better)" if t["higher_is_better"] else " (lower is better)"))
    bot.legend(loc="upper left", bbox_to_anchor=(0, -0.28 if n > 8 else -0.18), ncol=min(k, 4),
               frameon=False, fontsize=7)
    bot.set_xticks(xs)
    bot.set_xticklabels([r["case"] for r in rows], rotation=40 if n > 6 else 0,
                        ha="right" if n > 6 else "center")
    bot.set_xlim(-0.6, n - 0.4)
    bot.grid(axis="y", linewidth=0.3, color="#dddddd")
    bot.set_axisbelow(True)

    if path.endswith(".png"):
        fig.savefig(path, format="png", bbox_inches="tight", dpi=110)
    else:
        fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="table files (default: docs/data/*.json)")
    ap.add_argument("--out", default=IMG, help="folder for the SVGs (default: docs/img)")
    ap.add_argument("--markdown", action="store_true", help="print the markdown tables instead")
    a = ap.parse_args(argv)
    files = a.files or sorted(glob.glob(os.path.join(DATA, "*.json")))
    if not files:
        print("no table files", file=sys.stderr)
        return 2
    try:
        tables = [load(f) for f in files]
    except SchemaError as e:
        print(e, file=sys.stderr)
        return 2
    if a.markdown:
        sys.stdout.write("\n".join(markdown(t) for t in tables))
        return 0
    os.makedirs(a.out, exist_ok=True)
    for t in tables:
        path = os.path.join(a.out, t["id"] + ".svg")
        draw(t, path)
        print(f"{path} ({os.path.getsize(path) // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
