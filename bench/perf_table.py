"""The measured tables of docs/perf.md as data: load and check a `docs/data/<id>.json`, compare fa4
with its best peer, and print the table as markdown, so that the docs and the data cannot drift.

Schema (one file per table; the measurement drivers write the same):

    {"id": "fwd_grid",                  file stem, and the name of its plot docs/img/<id>.svg
     "title": "...", "date": "YYYY-MM-DD",
     "gpu": "NVIDIA H200" | null, "driver": "580.159.04" | null,
     "versions": {"torch": "...", "cudnn": "...", "fa4": "<commit>", ...},
     "method": "one CUDA event pair around 10 back-to-back calls, median of 9 rounds, ...",
     "unit": "TFLOP/s", "higher_is_better": true,
     "libs": ["fa4", "cudnn", ...],     column order; "fa4" is ours, every other one a peer
     "lib_names": {"fa4": "fa4", "cudnn": "cuDNN 9.19", ...},
     "ratios": [{"name": "fa4 fp8 / fa4 bf16", "num": "fa4", "den": "fa4_bf16",
                 "at_most": 0.55}, ...],         optional goal columns (below)
     "rows": [{"case": "d64 1k", "values": {"fa4": 401.0, "cudnn": null, ...},
               "spread": {"fa4": 0.012, ...},            optional, relative to the median
               "rounds": {"fa4": [0.71, 0.70, ...], ...}}]}   optional, ms per call per round

A value is null where a library does not run a case (or was not measured there). Other fields
are carried along and not read.

A goal column (`ratios`) is one library's value over another's per row (for a time unit, the
ratio of their times), with at most one bound, `at_most` or `at_least`: the goal it is held to.
It follows the verdict in the markdown table, bold where the goal is met, and the caption gives
its range, geomean and the cases that meet the goal (bench/peers.py decode-fp8 writes two).

Not every column is a peer: fa4's own extra columns (a build or environment timed beside the
default, whose name in `lib_names` starts with "fa4") and diagnostics (`cudnn_expanded`, cuDNN
on K/V already repeated to the query heads) are printed and drawn but never the best peer.

fa4 against the best peer: the best peer of a row is the one with the highest value (the lowest,
where lower is better), and the ratio is fa4's speed over that peer's: fa4 / best for a rate,
best / fa4 for a time, so above 1.0 fa4 is faster. The verdict follows docs/perf.md's rule: a
win when the ratio is above 1 by more than the larger of the two spreads, a loss when below by
more than it, a tie otherwise; without both spreads there is no verdict.

    python3 bench/perf_table.py docs/data/fwd_hopper.json      the table, with its caption
    python3 bench/perf_table.py --table-only FILE.json          the table alone
    python3 bench/perf_table.py --check docs/perf.md            every generated block matches its data
    python3 bench/perf_table.py --update docs/perf.md           rewrite the generated blocks

A generated block in a markdown file sits between `<!-- table: ID -->` and `<!-- end table -->`
and is the output of `perf_table.py docs/data/ID.json` (the data folder is taken beside the
markdown file's: docs/data for docs/perf.md).
"""
import argparse, json, math, os, re, sys

KEYS = ("id", "title", "date", "gpu", "driver", "versions", "method", "unit", "higher_is_better",
        "libs", "lib_names", "rows")
OURS = "fa4"
DIAGNOSTICS = ("cudnn_expanded",)
VERSION_NAMES = {"cudnn": "cuDNN", "fa2": "FlashAttention-2", "fa4cute": "FlashAttention-4 (CuTe)",
                 "cudnn_frontend": "cuDNN frontend"}
BLOCK = re.compile(r"(<!-- table: ([A-Za-z0-9_.-]+) -->\n)(.*?)(<!-- end table -->)", re.S)


class SchemaError(ValueError):
    """A table file that does not follow the schema; the message names the file and the field."""


def _is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate(t, where="table"):
    """Checks `t` against the schema and returns it; raises SchemaError naming what is wrong."""
    def bad(msg):
        raise SchemaError(f"{where}: {msg}")
    if not isinstance(t, dict):
        bad("expected a JSON object")
    missing = [k for k in KEYS if k not in t]
    if missing:
        bad(f"missing {', '.join(missing)}")
    for k in ("id", "title", "date", "method", "unit"):
        if not isinstance(t[k], str) or not t[k]:
            bad(f"`{k}` must be a non-empty string")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", t["id"]):
        bad(f"`id` {t['id']!r} must be a plain file stem")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", t["date"]):
        bad(f"`date` {t['date']!r} must be YYYY-MM-DD")
    for k in ("gpu", "driver"):
        if t[k] is not None and not isinstance(t[k], str):
            bad(f"`{k}` must be a string or null")
    if not isinstance(t["versions"], dict) or not all(
            v is None or isinstance(v, str) or _is_num(v) for v in t["versions"].values()):
        bad("`versions` must map names to strings (or null)")
    if not isinstance(t["higher_is_better"], bool):
        bad("`higher_is_better` must be true or false")
    libs = t["libs"]
    if not isinstance(libs, list) or not all(isinstance(x, str) and x for x in libs):
        bad("`libs` must be a list of names")
    if len(set(libs)) != len(libs):
        bad("`libs` names a library twice")
    if OURS not in libs:
        bad(f"`libs` must include {OURS!r}")
    if len(libs) < 2:
        bad("`libs` needs at least one library beside fa4")
    names = t["lib_names"]
    if not isinstance(names, dict) or set(names) != set(libs):
        bad("`lib_names` must name exactly the libraries of `libs`")
    if not all(isinstance(v, str) and v for v in names.values()):
        bad("`lib_names` values must be non-empty strings")
    if "ratios" in t and not isinstance(t["ratios"], list):
        bad("`ratios` must be a list")
    for i, g in enumerate(t.get("ratios", [])):
        at = f"ratios[{i}]"
        if not isinstance(g, dict) or not isinstance(g.get("name"), str) or not g["name"]:
            bad(f"{at}: needs a `name` string")
        for k in ("num", "den"):
            if g.get(k) not in libs:
                bad(f"{at}.{k} must name a library of `libs`, not {g.get(k)!r}")
        if g["num"] == g["den"]:
            bad(f"{at}: `num` and `den` are the same library")
        bounds = [k for k in ("at_most", "at_least") if k in g]
        if len(bounds) > 1:
            bad(f"{at}: give `at_most` or `at_least`, not both")
        if bounds and not (_is_num(g[bounds[0]]) and g[bounds[0]] > 0):
            bad(f"{at}.{bounds[0]} must be a positive number")
    if not isinstance(t["rows"], list) or not t["rows"]:
        bad("`rows` must be a non-empty list")
    seen = set()
    for i, r in enumerate(t["rows"]):
        at = f"rows[{i}]"
        if not isinstance(r, dict) or not isinstance(r.get("case"), str) or not r["case"]:
            bad(f"{at}: needs a `case` string")
        if r["case"] in seen:
            bad(f"{at}: case {r['case']!r} appears twice")
        seen.add(r["case"])
        if "rounds" in r and r["rounds"] is not None:
            if not isinstance(r["rounds"], dict) or set(r["rounds"]) - set(libs):
                bad(f"{at}.rounds must map libraries of `libs` to lists")
            for lib, xs in r["rounds"].items():
                if xs is not None and (not isinstance(xs, list) or not all(_is_num(x) for x in xs)):
                    bad(f"{at}.rounds.{lib} must be a list of numbers or null")
        for field in ("values", "spread"):
            if field not in r:
                if field == "values":
                    bad(f"{at}: needs `values`")
                continue
            m = r[field]
            if not isinstance(m, dict):
                bad(f"{at}.{field} must be an object")
            unknown = set(m) - set(libs)
            if unknown:
                bad(f"{at}.{field}: {sorted(unknown)[0]!r} is not in `libs`")
            for lib, v in m.items():
                if v is not None and not _is_num(v):
                    bad(f"{at}.{field}.{lib} must be a finite number or null, not {v!r}")
                if v is not None and (v < 0 or (field == "values" and v == 0)):
                    bad(f"{at}.{field}.{lib} must be positive, not {v!r}")
    return t


def load(path):
    """Reads and validates one table file; its `id` must be the file's stem."""
    with open(path, encoding="utf-8") as f:
        try:
            t = json.load(f)
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: not JSON ({e})") from None
    validate(t, path)
    stem = os.path.splitext(os.path.basename(path))[0]
    if t["id"] != stem:
        raise SchemaError(f"{path}: `id` is {t['id']!r}, the file stem {stem!r}")
    return t


def is_peer(t, lib):
    """A column the best peer is chosen from: not fa4, not one of fa4's own extra columns (its
    name starts with "fa4"), not a diagnostic."""
    if lib == OURS or lib in DIAGNOSTICS:
        return False
    name = t["lib_names"].get(lib, lib)
    return not re.match(r"fa4\b", name)


def peers(t):
    return [x for x in t["libs"] if is_peer(t, x)]


def value(row, lib):
    return row["values"].get(lib)


def spread(row, lib):
    return (row.get("spread") or {}).get(lib)


def best_peer(t, row):
    """(library, value) of the row's best peer, or None where no peer has a value."""
    have = [(value(row, p), i, p) for i, p in enumerate(peers(t)) if value(row, p) is not None]
    if not have:
        return None
    if t["higher_is_better"]:
        v, _, p = max(have, key=lambda x: (x[0], -x[1]))
    else:
        v, _, p = min(have, key=lambda x: (x[0], x[1]))
    return p, v


def ratio(t, row):
    """fa4's speed over the best peer's (above 1: fa4 faster), or None without both values."""
    ours, best = value(row, OURS), best_peer(t, row)
    if ours is None or best is None:
        return None
    return ours / best[1] if t["higher_is_better"] else best[1] / ours


def verdict(t, row):
    """"win", "tie" or "loss" by docs/perf.md's rule, or None without fa4's and the best peer's
    spreads (or without a ratio)."""
    q, best = ratio(t, row), best_peer(t, row)
    if q is None:
        return None
    s_ours, s_best = spread(row, OURS), spread(row, best[0])
    if s_ours is None or s_best is None:
        return None
    margin = max(s_ours, s_best)
    if q > 1 + margin:
        return "win"
    if q < 1 - margin:
        return "loss"
    return "tie"


def summary(t):
    """Counts and range of the ratios: {"n", "ahead", "behind", "level", "min", "max", "geomean"}."""
    qs = [q for q in (ratio(t, r) for r in t["rows"]) if q is not None]
    out = {"n": len(qs), "ahead": sum(q >= 1.005 for q in qs), "behind": sum(q < 0.995 for q in qs)}
    out["level"] = out["n"] - out["ahead"] - out["behind"]
    if qs:
        out.update(min=min(qs), max=max(qs), geomean=math.exp(sum(map(math.log, qs)) / len(qs)))
    return out


def goal_ratio(row, g):
    """A goal column's value in a row: num's value over den's, or None without both."""
    a, b = value(row, g["num"]), value(row, g["den"])
    return None if a is None or b is None else a / b


def goal_met(g, q):
    """Whether ratio `q` meets the goal column's bound (True where it has none)."""
    if "at_most" in g:
        return q <= g["at_most"]
    return q >= g["at_least"] if "at_least" in g else True


def goal_text(g):
    """"≤ 0.55", "≥ 1.8" or "" (no bound)."""
    return f"≤ {g['at_most']:g}" if "at_most" in g else f"≥ {g['at_least']:g}" if "at_least" in g else ""


def decimals(t):
    """Decimals to print the table's values with: as many as its most precise value has (≤ 3)."""
    d = 0
    for r in t["rows"]:
        for v in r["values"].values():
            if v is not None:
                frac = f"{float(v):.6f}".rstrip("0").split(".")[1]
                d = max(d, min(len(frac), 3))
    return d


def _fmt(v, d):
    return "–" if v is None else f"{v:.{d}f}"


def markdown(t, caption=True):
    """The table as markdown: one row per case, a column per library, the best peer and fa4's ratio
    to it (and the verdict where spreads are given), then the goal columns, with a caption naming
    date, GPU, versions and method."""
    d, libs, names = decimals(t), t["libs"], t["lib_names"]
    with_spread = any("spread" in r for r in t["rows"])
    with_verdict = any(verdict(t, r) is not None for r in t["rows"])
    goals = t.get("ratios", [])
    q_head = "fa4 / best peer" if t["higher_is_better"] else "best peer / fa4"
    head = (["case"] + [names[x] for x in libs] + ["best peer", q_head] + (["verdict"] if with_verdict else [])
            + [g["name"] + (f" (goal {goal_text(g)})" if goal_text(g) else "") for g in goals])
    lines = ["| " + " | ".join(head) + " |",
             "|---|" + "---:|" * len(libs) + "---|---:|" + ("---|" if with_verdict else "") + "---:|" * len(goals)]
    for r in t["rows"]:
        cells = [r["case"]]
        for x in libs:
            c = _fmt(value(r, x), d)
            s = spread(r, x)
            if with_spread and s is not None and value(r, x) is not None:
                c += f" ({100 * s:.1f}%)"
            cells.append(c)
        best, q = best_peer(t, r), ratio(t, r)
        cells.append(names[best[0]] if best else "–")
        cells.append("–" if q is None else (f"**{q:.2f}**" if q >= 1.005 else f"{q:.2f}"))
        if with_verdict:
            cells.append(verdict(t, r) or "–")
        for g in goals:
            gq = goal_ratio(r, g)
            bold = gq is not None and goal_text(g) and goal_met(g, gq)
            cells.append("–" if gq is None else (f"**{gq:.2f}**" if bold else f"{gq:.2f}"))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    if not caption:
        return table
    return caption_text(t) + "\n\n" + table


def caption_text(t):
    """One paragraph: the title, date, GPU and driver, versions, method and unit, fa4 against the
    best peer and each goal column's range."""
    where = ", ".join(x for x in (t["gpu"], t["driver"] and f"driver {t['driver']}") if x)
    vers = ", ".join(f"{VERSION_NAMES.get(k, k)} {v}" for k, v in t["versions"].items() if v)
    s = summary(t)
    parts = [f"**{t['title']}.** {t['date']}" + (f", {where}" if where else "") + "."]
    if vers:
        parts.append(f"Versions: {vers}.")
    parts.append(f"Method: {t['method']}.")
    better = "higher is better" if t["higher_is_better"] else "lower is better"
    gaps = any(v is None for r in t["rows"] for v in (value(r, x) for x in t["libs"]))
    parts.append(f"Values in {t['unit']} ({better}"
                 + ("; – where a library was not run on a case" if gaps else "") + ").")
    if s["n"]:
        parts.append(f"fa4 against the best peer: {s['min']:.2f}–{s['max']:.2f}, geomean "
                     f"{s['geomean']:.2f}; ahead on {s['ahead']} of {s['n']} cases, behind on "
                     f"{s['behind']} (bold: ahead).")
    for g in t.get("ratios", []):
        qs = [q for q in (goal_ratio(r, g) for r in t["rows"]) if q is not None]
        if not qs:
            continue
        text = (f"{g['name']}: {min(qs):.2f}–{max(qs):.2f}, geomean "
                f"{math.exp(sum(map(math.log, qs)) / len(qs)):.2f}")
        if goal_text(g):
            text += f"; goal {goal_text(g)} met on {sum(goal_met(g, q) for q in qs)} of {len(qs)} (bold: met)"
        parts.append(text + ".")
    return _wrap(" ".join(parts))


def _wrap(text, width=100):
    out, line = [], ""
    for w in text.split(" "):
        if line and len(line) + 1 + len(w) > width:
            out.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    out.append(line)
    return "\n".join(out)


def blocks(md_text, data_dir):
    """(id, text in the file, text generated from the data) for each generated block."""
    out = []
    for m in BLOCK.finditer(md_text):
        ident = m.group(2)
        t = load(os.path.join(data_dir, ident + ".json"))
        out.append((ident, m.group(3), markdown(t)))
    return out


def check(md_path):
    """The ids whose generated block in `md_path` differs from its data (empty: all match)."""
    with open(md_path, encoding="utf-8") as f:
        text = f.read()
    data = os.path.join(os.path.dirname(os.path.abspath(md_path)), "data")
    return [i for i, have, want in blocks(text, data) if have != want]


def update(md_path):
    """Rewrites every generated block of `md_path` from its data; returns the ids changed."""
    with open(md_path, encoding="utf-8") as f:
        text = f.read()
    data = os.path.join(os.path.dirname(os.path.abspath(md_path)), "data")
    changed = []

    def sub(m):
        want = markdown(load(os.path.join(data, m.group(2) + ".json")))
        if want != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + want + m.group(4)
    new = BLOCK.sub(sub, text)
    if new != text:
        with open(md_path, "w", encoding="utf-8") as f:
            f.write(new)
    return changed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="docs/data/<id>.json files to print")
    ap.add_argument("--table-only", action="store_true", help="no caption")
    ap.add_argument("--check", metavar="MD", help="exit 1 when a generated block of MD differs from its data")
    ap.add_argument("--update", metavar="MD", help="rewrite MD's generated blocks from their data")
    a = ap.parse_args(argv)
    try:
        if a.check:
            bad = check(a.check)
            for i in bad:
                print(f"{a.check}: the table `{i}` differs from docs/data/{i}.json "
                      f"(python3 bench/perf_table.py --update {a.check})", file=sys.stderr)
            return 1 if bad else 0
        if a.update:
            for i in update(a.update):
                print(f"{a.update}: rewrote `{i}`")
            return 0
        if not a.files:
            ap.error("give table files, --check MD or --update MD")
        for i, path in enumerate(a.files):
            if i:
                print()
            sys.stdout.write(markdown(load(path), caption=not a.table_only))
    except SchemaError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
