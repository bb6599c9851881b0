"""Checks of bench/bwd_grid.py's round order and --bin parsing, without a GPU or PyTorch:
    python3 -m unittest discover -s bench -p 'test_*.py'"""
import contextlib
import io
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_grid  # noqa: E402  (torch is imported only inside main)


class RoundOrder(unittest.TestCase):
    def test_each_library_takes_each_place_once_per_cycle(self):
        names = ["fa4", "old", "cudnn", "fa2"]
        orders = [bwd_grid.round_order(names, r) for r in range(4)]
        self.assertEqual(orders[0], ["fa4", "old", "cudnn", "fa2"])
        self.assertEqual(orders[1], ["old", "cudnn", "fa2", "fa4"])
        self.assertEqual(orders[3], ["fa2", "fa4", "old", "cudnn"])
        for place in range(4):
            self.assertEqual(sorted(o[place] for o in orders), sorted(names))
        self.assertEqual(bwd_grid.round_order(names, 5), orders[1])


class FakeTorch:
    """Just what timed_round touches: events whose elapsed time is fixed at 12 ms."""
    class cuda:
        syncs = 0

        @staticmethod
        def synchronize():
            FakeTorch.cuda.syncs += 1

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                pass

            def elapsed_time(self, other):
                return 12.0


class TimedRound(unittest.TestCase):
    def test_warms_up_then_times_calls_back_to_back(self):
        calls = []
        rnd = bwd_grid.timed_round(FakeTorch, lambda: calls.append(1), 4)
        self.assertEqual(len(calls), 3)  # warm-up only, before any round
        self.assertEqual(rnd(), 3.0)     # 12 ms over 4 calls
        self.assertEqual(len(calls), 7)


class Bins(unittest.TestCase):
    def test_name_and_path(self):
        self.assertEqual(bwd_grid.parse_bins(["old=/x/bwd_bench", "b=c=d"]), [("old", "/x/bwd_bench"), ("b", "c=d")])

    def test_a_value_without_name_or_path_is_a_one_line_error(self):
        for bad in ["foo", "=path", "name="]:
            with self.assertRaises(ValueError) as e:
                bwd_grid.parse_bins([bad])
            self.assertIn(repr(bad), str(e.exception))

    def test_alt_env_pairs(self):
        self.assertEqual(bwd_grid.parse_env("A=1 B=x=y C="), {"A": "1", "B": "x=y", "C": ""})
        for bad in ["FA4_BWD_KERNEL", "=sm80", "", "A=1 B"]:
            with self.assertRaises(ValueError) as e:
                bwd_grid.parse_env(bad)
            self.assertIn("--alt-env", str(e.exception))

    def test_the_command_line_exits_2_naming_the_flag(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
            sys.argv = ["bwd_grid.py", "--fa4", "x", "--bin", "foo"]
            bwd_grid.main()
        self.assertEqual(e.exception.code, 2)
        self.assertIn("--bin 'foo': expected NAME=PATH", err.getvalue())


if __name__ == "__main__":
    unittest.main()
