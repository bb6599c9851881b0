"""Checks of bench/grid.py's arithmetic and parsing, without a GPU or PyTorch:
    python3 -m unittest discover -s bench -p 'test_*.py'
The expected values are worked out by hand here, not computed with grid.py's own helpers."""
import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402  (no torch at import: it is loaded only to time)


def st(*xs):
    return grid.stats(list(xs))


class Stats(unittest.TestCase):
    def test_quartiles_interpolate_as_fa4_does(self):
        s = st(5.0, 1.0, 3.0, 2.0, 4.0)
        self.assertEqual((s["min"], s["q1"], s["median"], s["q3"], s["max"]), (1.0, 2.0, 3.0, 4.0, 5.0))
        s = st(4.0, 1.0, 2.0, 3.0)
        self.assertEqual((s["q1"], s["median"], s["q3"]), (1.75, 2.5, 3.25))

    def test_input_sets_span_twice_the_cache(self):
        mib = 1 << 20
        self.assertEqual(grid.input_sets(256 * mib, 60 * mib), 1)
        self.assertEqual(grid.input_sets(20 * mib, 60 * mib), 6)
        self.assertEqual(grid.input_sets(1, 60 * mib), grid.MAX_INPUT_SETS)


class Verdict(unittest.TestCase):
    def test_win_tie_loss_against_the_larger_spread(self):
        tight = st(0.99, 1.0, 1.0, 1.0, 1.01)  # IQR 0
        # fa4 1.0 ms against a peer at 1.10 ms: 10% faster, spreads 0 -> win.
        self.assertEqual(grid.verdict(tight, st(1.09, 1.1, 1.1, 1.1, 1.11))[0], "win")
        self.assertEqual(grid.verdict(tight, st(0.89, 0.9, 0.9, 0.9, 0.91))[0], "loss")
        # The peer's IQR is 0.2 ms around 1.05 (19%), wider than the 5% gap -> tie.
        wide = st(0.9, 0.95, 1.05, 1.15, 1.2)
        v, spread = grid.verdict(tight, wide)
        self.assertEqual(v, "tie")
        self.assertAlmostEqual(spread, 0.2 / 1.05)

    def test_one_slow_round_does_not_widen_the_spread(self):
        ours = st(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5)
        self.assertEqual(grid.verdict(ours, st(*[1.1] * 9))[0], "win")


class Shapes(unittest.TestCase):
    def test_defaults_fill_batch_and_heads(self):
        self.assertEqual(grid.full((128, 4096, 1)), (128, 4096, 1, 4, 16, 16))
        self.assertEqual(grid.full((128, 4096, 1, 4, 32, 8)), (128, 4096, 1, 4, 32, 8))
        self.assertEqual(len(grid.GRID), 18)
        for d, s, c, b, h, kv in (grid.full(x) for x in grid.EXTRA):
            self.assertEqual(h % kv, 0)

    def test_bad_shape_exits(self):
        with self.assertRaises(SystemExit):
            grid.parse_shape("128,4096")


class Tables(unittest.TestCase):
    def row(self):
        # d128 1k: flops = 4 * 16 * 16 * 1024^2 * 128 = 137438953472.
        r = dict(d=128, seqlen=1024, batch=16, heads=16, kv_heads=16, causal=False, flops=137438953472.0,
                 variants=[])
        r["fa4"] = dict(rounds_ms=[0.27] * 9, per_call_ms=0.3, host_enqueue_ms=0.013)
        r["cudnn"] = dict(rounds_ms=[0.23] * 9, per_call_ms=0.3, host_enqueue_ms=0.06)
        r["fa4cute"] = dict(rounds_ms=[0.25] * 9, per_call_ms=0.3, host_enqueue_ms=0.2)
        return r

    def test_summarise_picks_the_fastest_peer(self):
        r = self.row()
        grid.summarise(r)
        self.assertEqual(r["best"], "cudnn")
        self.assertAlmostEqual(r["ratio"], 0.23 / 0.27)
        self.assertEqual(r["verdict"], "loss")
        self.assertAlmostEqual(r["fa4"]["tflops"], 137438953472.0 / 0.27 / 1e9)
        md = grid.markdown([r])
        self.assertIn("| 128 | 1024 × 16 | 16/16 | no | 509 | 598 | – | 550 | 598 (cuDNN) | 0.85 |", md)
        self.assertIn("grid: geomean ratio 0.852 over 1 shapes", md)

    def test_ncu_table_groups_kernels_between_markers(self):
        hdr = '"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n'
        fa4 = hdr + "".join(f'"{i}","fa4_fwd_sm90","{t}"\n' for i, t in
                            enumerate([900000, 100000, 110000, 120000, 130000, 140000, 150000]))
        # One shape, two peers, three calls each; cuDNN's first call launches two kernels.
        peers = "==PROF== Connected\n" + hdr
        seq = [("cudnn_fprop", 200000), ("memset", 5000), ("spin_kernel", 1000),
               ("cudnn_fprop", 210000), ("spin_kernel", 1000), ("cudnn_fprop", 220000), ("spin_kernel", 1000),
               ("flash_fwd_kernel", 400000), ("spin_kernel", 1000), ("flash_fwd_kernel", 410000),
               ("spin_kernel", 1000), ("flash_fwd_kernel", "1,420,000"), ("spin_kernel", 1000)]
        peers += "".join(f'"{i}","{n}","{t}"\n' for i, (n, t) in enumerate(seq))
        shape = [128, 1024, 0, 16, 16, 16]
        labels = [dict(lib=lib, shape=shape) for lib in ("cudnn", "fa2") for _ in range(3)]
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for name, text in (("fa4.csv", fa4), ("peers.csv", peers), ("labels.json", json.dumps(labels))):
                paths.append(os.path.join(tmp, name))
                grid.write(paths[-1], text)
            a = argparse.Namespace(ncu_table=paths, ncu_shapes=[tuple(shape)])
            os.environ["OUT"] = tmp
            with contextlib.redirect_stdout(io.StringIO()):
                grid.ncu_table(a)
            out = grid.read_json(os.path.join(tmp, "ncu.json"))["128,1024,0,16,16,16"]
        self.assertAlmostEqual(out["fa4"], 125.0)  # median of 100..150 µs, the 900 µs warm-up left out
        self.assertAlmostEqual(out["cudnn"], 210.0)  # calls of 205, 210, 220 µs
        self.assertAlmostEqual(out["fa2"], 410.0)


if __name__ == "__main__":
    unittest.main()
