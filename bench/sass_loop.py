#!/usr/bin/env python3
"""The instruction mix of a kernel's main loop, from `cuobjdump -sass` output: fa4's Hopper
forward beside another library's (FlashAttention-3's cubins are in its wheel's `_C.abi3.so`).

    python3 bench/sass_loop.py DUMP.sass [--function NAME] [--cold LO-HI ...]

The main loop is the shortest loop (a backward branch and its target) that holds an `HGMMA`, in
the function named (default: the first function with any): the key-block loop, inside the tile
loop. It is printed block by block (a block ends at a branch or where one lands), then in total
by opcode, without the blocks named cold (`--cold 5000-5da0`: hex addresses, e.g. a masking
block the steady state jumps over). Counts are static: one pass through each block, as the
steady state takes it.
Needs no GPU; `cuobjdump` and `nvdisasm` come with PyPI's `nvidia-cuda-cuobjdump`.
"""
import argparse
import collections
import re
import sys

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")


def functions(text):
    """{name: [(address, instruction)]} in the dump's order."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = _INSTR.search(line)
        if m and name is not None:
            out[name].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(instr):
    """The opcode without guard predicate and modifiers: `@!P0 BRA 0x10` → `BRA`."""
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def main_loop(instrs):
    """(first, last) addresses of the shortest loop holding an HGMMA, or None."""
    addrs = [a for a, _ in instrs]
    best = None
    for a, t in instrs:
        m = _TARGET.search(t)
        if not m or opcode(t) != "BRA":
            continue
        target = int(m.group(1), 16)
        if target > a or target not in addrs:
            continue
        if not any(target <= b <= a and opcode(x) == "HGMMA" for b, x in instrs):
            continue
        if best is None or a - target < best[0]:
            best = (a - target, (target, a))
    return best[1] if best else None


def blocks(instrs, lo, hi):
    """The loop's basic blocks: [(first, last, [instructions])]."""
    body = [(a, t) for a, t in instrs if lo <= a <= hi]
    starts = {lo}
    for a, t in body:
        m = _TARGET.search(t)
        if m and opcode(t) == "BRA":
            starts.add(a + 16)
            target = int(m.group(1), 16)
            if lo <= target <= hi:
                starts.add(target)
    out, cur = [], []
    for a, t in body:
        if a in starts and cur:
            out.append((cur[0][0], cur[-1][0], [x for _, x in cur]))
            cur = []
        cur.append((a, t))
    if cur:
        out.append((cur[0][0], cur[-1][0], [x for _, x in cur]))
    return out


def parse_range(text):
    lo, _, hi = text.partition("-")
    try:
        return int(lo, 16), int(hi, 16)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cold {text!r}: expected LO-HI in hex")


def report(instrs, cold):
    loop = main_loop(instrs)
    if loop is None:
        return "no loop with HGMMA in this function"
    lo, hi = loop
    lines = [f"main loop {lo:#x}-{hi:#x}"]
    total = collections.Counter()
    for first, last, body in blocks(instrs, lo, hi):
        c = collections.Counter(opcode(t) for t in body)
        is_cold = any(a <= first and last <= b for a, b in cold)
        if not is_cold:
            total.update(c)
        mix = ", ".join(f"{k} {v}" for k, v in c.most_common(6))
        lines.append(f"  {first:#7x}-{last:#7x} {len(body):5d}{' cold' if is_cold else '     '}  {mix}")
    lines.append(f"steady state: {sum(total.values())} instructions, "
                 + ", ".join(f"{k} {v}" for k, v in total.most_common()))
    return "\n".join(lines)


def run(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dump", help="cuobjdump -sass output")
    ap.add_argument("--function", help="function name (default: the first with HGMMA)")
    ap.add_argument("--cold", action="append", default=[], type=parse_range, metavar="LO-HI",
                    help="hex address range of a block the steady state skips")
    a = ap.parse_args(argv)
    try:
        text = open(a.dump).read()
    except OSError as e:
        ap.exit(2, f"sass_loop: {a.dump}: {e.strerror}\n")
    funcs = functions(text)
    if a.function:
        if a.function not in funcs:
            ap.exit(2, f"sass_loop: --function {a.function}: not in {a.dump}\n")
        name = a.function
    else:
        name = next((n for n, ins in funcs.items() if any(opcode(t) == "HGMMA" for _, t in ins)), None)
        if name is None:
            ap.exit(2, f"sass_loop: {a.dump}: no function with HGMMA\n")
    print(name[:100])
    print(report(funcs[name], a.cold))
    return 0


if __name__ == "__main__":
    sys.exit(run())
