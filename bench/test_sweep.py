"""Checks of bench/sweep.py without a GPU: its parsing, and the backward A/B's rotated rounds
against stand-in bwd_bench processes (a Python script speaking its protocol):
    python3 -m unittest discover -s bench -p 'test_*.py'"""
import argparse
import contextlib
import io
import json
import os
import stat
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402

# Answers `shape …` with `ready FLOPS` and `round N` with a time that depends on its
# environment (FAKE_MS) and on the deterministic flag, logging each request to FAKE_LOG.
FAKE = textwrap.dedent("""\
    #!{python}
    import os, sys
    ms = float(os.environ.get("FAKE_MS", "2.0"))
    log = open(os.environ["FAKE_LOG"], "a")
    det = 0
    for line in sys.stdin:
        w = line.split()
        log.write(os.environ.get("FAKE_NAME", "fa4") + " " + line)
        log.flush()
        if w[0] == "shape":
            det = int(w[6])
            print("ready", 1e12, flush=True)
        else:
            print(ms * (2 if det else 1), flush=True)
""")


class Parsing(unittest.TestCase):
    def test_variants_bins_envs_shapes(self):
        self.assertEqual(sweep.parse_variant("tma@128=128,2,2,40,232,0,1,0,1,0,0,1,0"),
                         ("tma", 128, "128,2,2,40,232,0,1,0,1,0,0,1,0"))
        self.assertEqual(sweep.parse_bins(["old=/x/bwd_bench", "b=c=d"]), [("old", "/x/bwd_bench"), ("b", "c=d")])
        self.assertEqual(sweep.parse_env("sm80=FA4_BWD_KERNEL=sm80 B=x=y"),
                         ("sm80", {"FA4_BWD_KERNEL": "sm80", "B": "x=y"}))
        self.assertEqual(sweep.parse_shape("128,4096,1"), (128, 4096, 1, 4, 16))
        for f, bad in ((sweep.parse_variant, "plan=plan"), (sweep.parse_variant, "a@x=plan"),
                       (sweep.parse_env, "sm80"), (sweep.parse_env, "x=FA4"), (sweep.parse_shape, "128,4096"),
                       (sweep.parse_shape, "96,4096,0"), (sweep.parse_shape, "128,4096,2")):
            with self.assertRaises(ValueError) as e:
                f(bad)
            self.assertIn(repr(bad), str(e.exception))
        for bad in ["foo", "=path", "name="]:
            with self.assertRaises(ValueError):
                sweep.parse_bins([bad])

    def test_varlen_lengths_reach_fa4_bench(self):
        a = argparse.Namespace(fa4="/x/fa4", kernel="sm90", seqlens=[2048], lengths="300,1,517")
        cmd = sweep.bench_cmd(a, {}, "dyn", 128, "128,2,2,40,232,0,1,0,1,0,0,0,0,1", 5)
        self.assertEqual(cmd[cmd.index("--grid") + 1:cmd.index("--grid") + 3], ["128,2048,0", "128,2048,1"])
        self.assertEqual(cmd[cmd.index("--lengths") + 1], "300,1,517")
        self.assertEqual(cmd[-2:], ["--sm90-tiles", "128,2,2,40,232,0,1,0,1,0,0,0,0,1"])
        a.lengths = None
        self.assertNotIn("--lengths", sweep.bench_cmd(a, {}, "plan", 128, "plan", 5))

    def test_the_command_line_exits_2_naming_the_flag(self):
        for argv, msg in ((["--backward"], "--bwd-bench"), (["--backward", "--bwd-bench", "x", "--bin", "foo"],
                                                             "--bin 'foo': expected NAME=PATH"), ([], "variants"),
                          (["--lengths", "3,x", "a@64=plan"], "--lengths '3,x'")):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
                sweep.main(argv)
            self.assertEqual(e.exception.code, 2)
            self.assertIn(msg, err.getvalue())


class Backward(unittest.TestCase):
    def test_columns_take_turns_and_their_times_come_back(self):
        with tempfile.TemporaryDirectory() as d:
            fake = os.path.join(d, "bwd_bench")
            with open(fake, "w") as f:
                f.write(FAKE.format(python=sys.executable))
            os.chmod(fake, os.stat(fake).st_mode | stat.S_IXUSR)
            log = os.path.join(d, "log")
            os.environ.update(FAKE_LOG=log, OUT=d)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = sweep.main(["--backward", "--bwd-bench", fake, "--rounds", "3", "--calls", "4",
                                 "--shapes", "128,4096,0", "--env", "slow=FAKE_MS=4 FAKE_NAME=slow", "--det"])
            self.assertEqual(rc, 0)
            with open(os.path.join(d, "sweep-bwd.json")) as f:
                rows = json.load(f)
            with open(log) as f:
                requests = [line.split() for line in f]
        self.assertEqual(len(rows), 1)
        r = rows[0]
        self.assertEqual(r["rounds_ms"], {"fa4": [2.0] * 3, "slow": [4.0] * 3, "det": [4.0] * 3})
        self.assertAlmostEqual(r["tflops"]["fa4"], 1e12 / 2e-3 / 1e12)
        # Each process got its shape (the deterministic one with its flag), then three rounds
        # of 4 calls; `slow` (the second column) went first in round 2.
        self.assertIn(["fa4", "shape", "128", "4096", "0", "4", "16", "1"], requests)
        self.assertEqual(sum(1 for w in requests if w[1:] == ["round", "4"]), 9)
        first_of_round_2 = [w[0] for w in requests if w[1] == "round"][3]
        self.assertEqual(first_of_round_2, "slow")
        self.assertIn("slow 0.500", out.getvalue())


if __name__ == "__main__":
    unittest.main()
