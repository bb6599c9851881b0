"""Checks of bench/peers.py without a GPU or PyTorch (a stand-in plays torch.cuda where the
timing needs it):
    python3 -m unittest discover -s bench -p 'test_*.py'
Expected values are worked out by hand here, not with peers.py's own helpers."""
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (torch is imported only to time)
import perf_table  # noqa: E402  (the schema's reader, bench/plot_perf.py's too)


class NoTorch(unittest.TestCase):
    def test_importing_peers_imports_no_torch(self):
        self.assertNotIn("torch", sys.modules)


class RoundOrder(unittest.TestCase):
    def test_each_library_takes_each_place_once_per_cycle(self):
        names = ["fa4", "cudnn", "fa2", "fa4cute"]
        orders = [peers.round_order(names, r) for r in range(4)]
        self.assertEqual(orders[0], ["fa4", "cudnn", "fa2", "fa4cute"])
        self.assertEqual(orders[1], ["cudnn", "fa2", "fa4cute", "fa4"])
        self.assertEqual(orders[3], ["fa4cute", "fa4", "cudnn", "fa2"])
        for place in range(4):
            self.assertEqual(sorted(o[place] for o in orders), sorted(names))
        self.assertEqual(peers.round_order(names, 5), orders[1])
        self.assertEqual(peers.round_order([], 3), [])

    def test_rounds_run_rotated_and_a_failing_library_is_dropped(self):
        seen, notes = [], []

        def one(name):
            seen.append(name)
            if name == "fa2" and len([x for x in seen if x == "fa2"]) == 2:
                raise RuntimeError("no kernel\nsecond line")
            return (1.0, 5.0)
        got = peers.run_rounds(["fa4", "cudnn", "fa2"], 3, one, note=notes.append)
        # Round 1 starts at fa4, round 2 at cudnn (fa2 fails there), round 3 at fa4 again among
        # the two left (3rd entry of a list of 2: index 2 mod 2 = 0).
        self.assertEqual(seen, ["fa4", "cudnn", "fa2", "cudnn", "fa2", "fa4", "fa4", "cudnn"])
        self.assertEqual(sorted(got), ["cudnn", "fa4"])
        self.assertEqual(len(got["fa4"]), 3)
        self.assertEqual(notes, ["  fa2: dropped in round 2: RuntimeError: no kernel"])


def st(*xs):
    return peers.stats(list(xs))


class Stats(unittest.TestCase):
    def test_quartiles_interpolate(self):
        s = st(5.0, 1.0, 3.0, 2.0, 4.0)
        self.assertEqual((s["min"], s["q1"], s["median"], s["q3"], s["max"]), (1.0, 2.0, 3.0, 4.0, 5.0))
        s = st(4.0, 1.0, 2.0, 3.0)
        self.assertEqual((s["q1"], s["median"], s["q3"]), (1.75, 2.5, 3.25))
        self.assertAlmostEqual(peers.iqr_spread(s), 1.5 / 2.5)
        self.assertAlmostEqual(peers.range_spread(s), 3.0 / 2.5)

    def test_verdict_against_the_larger_spread(self):
        tight = st(0.99, 1.0, 1.0, 1.0, 1.01)  # IQR 0
        self.assertEqual(peers.verdict(tight, st(1.09, 1.1, 1.1, 1.1, 1.11))[0], "win")
        self.assertEqual(peers.verdict(tight, st(0.89, 0.9, 0.9, 0.9, 0.91))[0], "loss")
        wide = st(0.9, 0.95, 1.05, 1.15, 1.2)  # IQR 0.2 around 1.05: wider than the 5% gap
        v, spread = peers.verdict(tight, wide)
        self.assertEqual(v, "tie")
        self.assertAlmostEqual(spread, 0.2 / 1.05)

    def test_one_slow_round_does_not_widen_the_spread(self):
        ours = st(*([1.0] * 8 + [1.5]))
        self.assertEqual(peers.verdict(ours, st(*[1.1] * 9))[0], "win")


class Counts(unittest.TestCase):
    def test_fixed_batch_flops(self):
        # d128 1k: 4 · 16 · 16 · 1024² · 128 = 137438953472.
        c = peers.fwd_cases(False)[6]
        self.assertEqual((c.label, c.batch, c.heads_q, c.d), ("d128 1k", 16, 16, 128))
        self.assertEqual(c.flops(), 137438953472.0)
        self.assertEqual(peers.fwd_cases(False)[7].flops(), 137438953472.0 / 2)  # causal: halved
        self.assertEqual(len(peers.fwd_cases(False)), 18)

    def test_d_v_and_gqa(self):
        # 2·sq·sk·(d + dv) per head: 2 · 10 · 4 · 4096² · (192 + 128).
        c = [x for x in peers.headdim_cases(False) if x.label == "d192/128 4k"][0]
        self.assertEqual(c.flops(), 2.0 * 10 * 4 * 4096 ** 2 * 320)
        g = peers.gqa_cases(False)[0]
        self.assertEqual((g.heads_q, g.heads_kv, g.batch, g.causal), (32, 8, 8, True))
        self.assertEqual(g.flops(), 4.0 * 8 * 32 * 2048 ** 2 * 128 / 2)

    def test_backward_gqa_cases_time_both_masks(self):
        # The forward's table is causal only; the backward's has both masks per seqlen.
        self.assertEqual([c.label for c in peers.gqa_cases(False)],
                         ["32/8 2k causal", "32/8 4k causal", "32/8 8k causal"])
        cs = peers.gqa_cases(False, causals=(False, True))
        self.assertEqual([c.label for c in cs], ["32/8 2k", "32/8 2k causal", "32/8 4k", "32/8 4k causal",
                                                 "32/8 8k", "32/8 8k causal"])
        self.assertEqual([(c.batch, c.seqlen_q, c.heads_q, c.heads_kv, c.d, c.causal) for c in cs[4:]],
                         [(2, 8192, 32, 8, 128, False), (2, 8192, 32, 8, 128, True)])
        # FLOPs count the query heads: 4 · 2 · 32 · 8192² · 128 = 2199023255552, backward 2.5 × that.
        self.assertEqual(cs[4].flops(), 2199023255552.0)
        self.assertEqual(cs[5].flops(), 2199023255552.0 / 2)
        self.assertEqual(cs[4].flops() * peers.BWD_FACTOR, 5497558138880.0)
        self.assertEqual([c.label for c in peers.gqa_cases(True, causals=(False, True))], ["32/8 4k", "32/8 4k causal"])

    def test_causal_pairs_match_counting(self):
        for sq in range(1, 7):
            for sk in range(1, 7):
                n = sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)
                self.assertEqual(peers.causal_pairs(sq, sk), n, (sq, sk))

    def test_varlen_counts_the_pairs_exactly(self):
        # Sequences of 3 and 1 tokens, causal: 6 + 1 pairs; 2 heads, d 4: 2 · 8 · 2 · 7.
        self.assertEqual(peers.attn_flops([(3, 3), (1, 1)], 2, 4, causal=True, exact_causal=True), 224.0)
        self.assertEqual(peers.attn_flops([(3, 3), (1, 1)], 2, 4, causal=True), 2 * 8 * 2 * 5.0)
        self.assertEqual(peers.attn_flops([(3, 3), (1, 1)], 2, 4), 2 * 8 * 2 * 10.0)

    def test_decode_bytes(self):
        # (1, 32k): K and V 32768 · 8 · 256 · 2 B, Q and O 32 · 256 · 2 B.
        c = peers.DecodeCase(1, 32768)
        self.assertEqual(c.bytes(), 32768 * 8 * 256 * 2 + 32 * 256 * 2)
        self.assertEqual(c.kv_bytes(), 32768 * 8 * 256 * 2)
        self.assertEqual(c.label, "(1, 32k)")
        self.assertEqual(peers.decode_bytes([10, 20], 4, 2, 8, seqlen_q=2), (30 * 2 * 16 + 2 * 2 * 4 * 16) * 2)

    def test_copies_span_four_l2s(self):
        mib = 1 << 20
        self.assertEqual(peers.copies_for(256 * mib, 50 * mib), 1)
        self.assertEqual(peers.copies_for(128 * mib, 50 * mib), 2)
        self.assertEqual(peers.copies_for(30 * mib, 50 * mib), 7)
        self.assertEqual(peers.copies_for(1, 50 * mib), peers.MAX_COPIES)
        # The decode shape (1, 32k) reads 134 MB: two copies.
        self.assertEqual(peers.copies_for(peers.DecodeCase(1, 32768).kv_bytes(), 50 * mib), 2)


class Varlen(unittest.TestCase):
    def test_lengths_sum_to_the_tokens_within_bounds(self):
        for seed in range(20):
            n = peers.varlen_lengths(seed)
            self.assertEqual(sum(n), 16384)
            self.assertTrue(all(1 <= x <= 8192 for x in n), n)
        self.assertEqual(peers.varlen_lengths(3), peers.varlen_lengths(3))
        self.assertNotEqual(peers.varlen_lengths(3), peers.varlen_lengths(4))

    def test_mean_is_about_2k(self):
        n = peers.varlen_lengths(1, total=4_000_000)[:-1]  # the last is cut to what is left
        self.assertAlmostEqual(sum(n) / len(n), 2048, delta=2048 * 0.03)
        self.assertGreater(max(n), 7000)
        self.assertLess(min(n), 100)

    def test_lengths_pass_prints_the_varlen_batch(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            peers.main(["lengths", "--seed", "3"])
        self.assertEqual(out.getvalue().strip(), ",".join(map(str, peers.varlen_lengths(3))))

    def test_varlen_rows_pair_with_the_same_tokens_at_fixed_length(self):
        cs = peers.varlen_cases(0, False)
        self.assertEqual(len(cs), 12)
        n = len(peers.varlen_lengths(0))
        for ragged, fixed in zip(cs[::2], cs[1::2]):
            self.assertTrue(ragged.varlen and not fixed.varlen)
            self.assertEqual(sum(q for q, _ in ragged.seqs), 16384)
            self.assertEqual((ragged.d, ragged.causal, ragged.heads_q), (fixed.d, fixed.causal, fixed.heads_q))
            self.assertEqual(fixed.batch, n)
            self.assertEqual(fixed.seqlen_q, 16384 // n)
            self.assertLessEqual(abs(sum(q for q, _ in fixed.seqs) - 16384), n)


class FakeTorch:
    """Just what Gpu touches: events with a fixed elapsed time, synchronize, _sleep."""

    class cuda:
        log = []
        done = []  # what successive Event.query calls answer (then False)

        @staticmethod
        def synchronize():
            FakeTorch.cuda.log.append("sync")

        @staticmethod
        def _sleep(cycles):
            FakeTorch.cuda.log.append(("sleep", cycles))

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                FakeTorch.cuda.log.append("record")

            def elapsed_time(self, other):
                return 12.0

            def query(self):
                FakeTorch.cuda.log.append("query")
                return FakeTorch.cuda.done.pop(0) if FakeTorch.cuda.done else False


class Timing(unittest.TestCase):
    def setUp(self):
        FakeTorch.cuda.log = []
        FakeTorch.cuda.done = []

    def test_a_round_is_one_event_pair_around_the_calls_after_a_head_start(self):
        calls = []
        gpu = peers.Gpu(FakeTorch, 4)
        gpu.cycles_per_us = 2000.0
        ms, host = gpu.round(lambda: calls.append(1), host_us=100.0)
        self.assertEqual(ms, 3.0)  # 12 ms over 4 calls
        self.assertEqual(len(calls), 4)
        self.assertGreaterEqual(host, 0.0)
        # synchronize, the sleep (1.25 · 4 calls · 100 µs + 50 µs at 2000 cycles/µs), events
        # around the calls, synchronize.
        self.assertEqual(FakeTorch.cuda.log, ["sync", ("sleep", 1_100_000), "record", "query", "record", "sync"])

    def test_a_head_start_that_ended_too_soon_is_doubled_and_the_round_run_again(self):
        calls = []
        gpu = peers.Gpu(FakeTorch, 4)
        gpu.cycles_per_us = 2000.0
        FakeTorch.cuda.done = [True, True]
        gpu.round(lambda: calls.append(1), host_us=100.0)
        self.assertEqual(len(calls), 12)  # two short rounds, then one that held
        sleeps = [x[1] for x in FakeTorch.cuda.log if isinstance(x, tuple)]
        self.assertEqual(sleeps[0], 1_100_000)
        self.assertEqual(sleeps[1] / sleeps[0], 2.0)
        self.assertEqual(gpu.head_start_scale, 4.0)
        self.assertEqual(gpu.reruns, 2)
        # Never more than `tries` rounds, the last one kept.
        FakeTorch.cuda.done = [True] * 9
        calls.clear()
        gpu.round(lambda: calls.append(1), host_us=100.0, tries=2)
        self.assertEqual(len(calls), 8)

    def test_no_head_start_no_sleep(self):
        gpu = peers.Gpu(FakeTorch, 2, head_start=False)
        gpu.round(lambda: None, host_us=100.0)
        self.assertEqual(FakeTorch.cuda.log, ["sync", "record", "record", "sync"])

    def test_calibration_reads_the_sleep(self):
        gpu = peers.Gpu(FakeTorch, 2)
        gpu.calibrate()  # 1e6 cycles took 12 ms
        self.assertAlmostEqual(gpu.cycles_per_us, 1e6 / 12e3)

    def test_warm_up_counts(self):
        calls = []
        first, host = peers.Gpu(FakeTorch, 10).warm(lambda: calls.append(1), 3)
        self.assertEqual(len(calls), 4)
        self.assertGreaterEqual(first, 0.0)


class Tables(unittest.TestCase):
    def table(self):
        t = peers.Table("fwd_grid", "Forward", "TFLOP/s", ["fa4", "cudnn", "fa2", "fa3", "fa4cute"])
        res = {"fa4": [(0.27, 12.0)] * 9, "cudnn": [(0.23, 60.0)] * 9, "fa4cute": [(0.25, 400.0)] * 9}
        flops = 137438953472.0
        row = t.add("d128 1k", res, lambda ms: flops / (ms * 1e-3) / 1e12)
        return t, row

    def test_row_values_spread_rounds_and_summary(self):
        t, row = self.table()
        self.assertEqual(row["values"]["fa4"], 509.0)  # 137438953472 / 0.27 ms = 509.03 TFLOP/s
        self.assertIsNone(row["values"]["fa2"])
        self.assertIsNone(row["rounds"]["fa3"])
        self.assertEqual(row["spread"]["cudnn"], 0.0)
        self.assertEqual(row["rounds"]["fa4"], [0.27] * 9)
        s = row["_summary"]
        self.assertEqual(s["best"], "cudnn")
        self.assertAlmostEqual(s["ratio"], 0.23 / 0.27)
        self.assertEqual(s["verdict"], "loss")
        line = t.line(row)
        self.assertIn("cudnn", line)
        self.assertIn(" 0.852 loss", line)
        # fa4cute's host path (400 µs) is slower than its 250 µs calls: marked h.
        self.assertIn("549.8h±", line)

    def test_values_keep_four_digits_and_never_round_to_zero(self):
        self.assertEqual(peers.significant(509.03), 509.0)
        self.assertEqual(peers.significant(3.3217), 3.322)
        self.assertEqual(peers.significant(0.000123456), 0.0001235)
        t = peers.Table("decode_p1", "Decode", "TB/s", ["fa4", "cudnn"])
        row = t.add("(1, 32k)", {"fa4": [(1.0, 1.0)], "cudnn": [(2.0, 1.0)]}, lambda ms: 0.0 if ms < 1.5 else 1e-7)
        self.assertIsNone(row["values"]["fa4"])  # a zero value is no value
        self.assertEqual(row["values"]["cudnn"], 1e-7)

    def test_a_diagnostic_column_is_never_the_best_peer(self):
        t = peers.Table("decode_p16", "Decode", "TB/s", ["fa4", "cudnn", "cudnn_expanded"])
        row = t.add("(1, 32k)", {"fa4": [(0.05, 9.0)], "cudnn": [(0.04, 60.0)], "cudnn_expanded": [(0.01, 60.0)]},
                    lambda ms: 1.0 / ms)
        self.assertEqual(row["_summary"]["best"], "cudnn")

    def test_json_schema(self):
        t, _ = self.table()
        meta = dict(date="2026-12-03", gpu="NVIDIA H200", driver="580.159.04",
                    versions={"torch": "2.11.0", "cudnn": "9.19.0", "fa4": "0.1.0 (abc1234)", "flash_attn_4": "4.0.0b36",
                              "fa3": None},
                    method="one line", lib_names={"fa4": "fa4", "cudnn": "cuDNN 9.19"})
        with tempfile.TemporaryDirectory() as d:
            paths = peers.write_tables([t, peers.Table("fwd_gqa", "empty", "TFLOP/s", ["fa4"])], d, meta)
            self.assertEqual([os.path.basename(p) for p in paths], ["fwd_grid.json"])  # no rows, no file
            with open(paths[0]) as f:
                j = json.load(f)
        self.assertEqual(list(j), ["id", "title", "date", "gpu", "driver", "versions", "method", "unit",
                                   "higher_is_better", "libs", "lib_names", "rows"])
        self.assertEqual((j["id"], j["unit"], j["higher_is_better"]), ("fwd_grid", "TFLOP/s", True))
        self.assertEqual(j["libs"], ["fa4", "cudnn", "fa2", "fa3", "fa4cute"])
        self.assertEqual(j["lib_names"]["cudnn"], "cuDNN 9.19")
        self.assertEqual(j["lib_names"]["fa2"], "fa2")  # a name the run did not give
        self.assertEqual(set(j["versions"]), {"torch", "cudnn", "fa4", "flash_attn_4", "fa3"})
        row = j["rows"][0]
        self.assertEqual(list(row), ["case", "values", "spread", "rounds"])
        self.assertEqual(row["case"], "d128 1k")
        self.assertIsNone(row["values"]["fa3"])
        self.assertEqual(set(row["values"]), set(j["libs"]))
        self.assertEqual(len(row["rounds"]["cudnn"]), 9)
        perf_table.validate(j, "fwd_grid.json")  # the reader's own check

    def test_env_columns_are_named_as_fa4s_own(self):
        # perf_table.py never takes a column whose name starts with "fa4" as the best peer.
        names = peers.Mods.lib_names(FakeMods())
        self.assertTrue(names["alt"].startswith("fa4 "))
        self.assertFalse(perf_table.is_peer({"lib_names": names}, "alt"))
        self.assertFalse(perf_table.is_peer({"lib_names": names}, "cudnn_expanded"))
        self.assertTrue(perf_table.is_peer({"lib_names": names}, "fa4cute"))


class FakeMods:
    """What Mods.lib_names reads."""
    versions = {"torch": "2.11.0", "cudnn": "9.19.0", "fa4": "0.1.0", "flash_attn_4": "4.0.0b36", "fa3": "0.0.3",
                "cudnn_frontend": "1.32.0 (cuDNN 9.19.0)"}
    env_columns = [("alt", {"FA4_BWD_KERNEL": "sm80"})]


class Cli(unittest.TestCase):
    def test_env_columns(self):
        self.assertEqual(peers.parse_env_columns(["sm80=FA4_BWD_KERNEL=sm80", "b=A=1,B=x=y"]),
                         [("sm80", {"FA4_BWD_KERNEL": "sm80"}), ("b", {"A": "1", "B": "x=y"})])
        for bad in ["foo", "x=", "x=A", "=A=1", "fa4=A=1", "a@b=A=1"]:
            with self.assertRaises(ValueError) as e:
                peers.parse_env_columns([bad])
            self.assertIn("--fa4-env", str(e.exception))

    def test_environment_is_restored(self):
        os.environ.pop("FA4_TEST_X", None)
        with peers.environment({"FA4_TEST_X": "1"}):
            self.assertEqual(os.environ["FA4_TEST_X"], "1")
        self.assertNotIn("FA4_TEST_X", os.environ)

    def test_defaults_and_errors(self):
        a = peers.parse_args(["fwd", "--extras"])
        self.assertEqual((a.rounds, a.calls, a.head_dims, a.gqa, a.varlen, a.grid), (9, 10, True, True, True, True))
        self.assertEqual(peers.parse_args(["bwd", "--quick"]).rounds, 5)
        a = peers.parse_args(["bwd", "--extras"])
        self.assertEqual((a.head_dims, a.gqa, a.varlen, a.grid), (True, True, True, True))
        self.assertEqual(peers.parse_args(["decode", "--pages", "16,1"]).pages, [16, 1])
        for argv, msg in ((["fwd", "--only", "fa4,cudnnn"], "unknown cudnnn"),
                          (["decode", "--pages", "48"], "--pages: 48"),
                          (["bwd", "--fa4-env", "x"], "--fa4-env 'x'")):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
                peers.parse_args(argv)
            self.assertEqual(e.exception.code, 2)
            self.assertIn(msg, err.getvalue())

    def test_tables_of_a_pass(self):
        a = peers.parse_args(["fwd", "--extras", "--no-grid", "--fa4-env", "alt=FA4_X=1"])
        ts = peers.tables_for(a, ["alt"])
        self.assertEqual([t.id for t, _, _ in ts], ["fwd_headdims", "fwd_gqa", "fwd_varlen"])
        self.assertEqual(ts[2][0].libs, ["fa4", "fa3", "fa4cute", "alt"])  # no SDPA for varlen
        self.assertEqual(len(ts[0][1]), 16)
        a = peers.parse_args(["bwd"])
        self.assertEqual(peers.tables_for(a, [])[0][0].libs, ["fa4", "cudnn", "fa2", "fa4cute"])
        a = peers.parse_args(["bwd", "--varlen", "--no-grid"])
        ts = peers.tables_for(a, [])
        self.assertEqual([t.id for t, _, _ in ts], ["bwd_varlen"])
        self.assertEqual(ts[0][0].libs, ["fa4", "fa4cute"])
        a = peers.parse_args(["bwd", "--extras", "--no-grid", "--quick"])
        ts = peers.tables_for(a, [])
        self.assertEqual([(t.id, kind) for t, _, kind in ts],
                         [("bwd_headdims", "bwd"), ("bwd_dv", "bwd"), ("bwd_gqa", "bwd"), ("bwd_varlen", "bwd")])
        self.assertEqual([(c.label, c.d, c.dv) for c in ts[1][1]],
                         [("d192/128 4k", 192, 128), ("d192/128 4k causal", 192, 128)])
        self.assertTrue(all(c.dv == c.d for c in ts[0][1]))  # bwd_headdims: d_v = d
        self.assertEqual(ts[2][0].libs, ["fa4", "cudnn", "fa2", "fa4cute"])  # SDPA with enable_gqa
        self.assertEqual([c.label for c in ts[2][1]], ["32/8 4k", "32/8 4k causal"])
        a = peers.parse_args(["bwd", "--gqa"])
        self.assertEqual([t.id for t, _, _ in peers.tables_for(a, [])], ["bwd_grid", "bwd_gqa"])


class FakeTensor:
    """A graph tensor that records what is set on it."""

    def __init__(self, name, **attrs):
        self.name, self.attrs = name, dict(attrs)

    def _set(self, key, value):
        self.attrs[key] = value
        return self

    def set_output(self, x):
        return self._set("output", x)

    def set_dim(self, x):
        return self._set("dim", list(x))

    def set_stride(self, x):
        return self._set("stride", list(x))

    def set_data_type(self, x):
        return self._set("data_type", x)


class FakeGraph:
    def __init__(self, log, kwargs):
        self.log, self.kwargs, self.tensors, self.sdpa = log, kwargs, {}, None

    def tensor(self, name, dim, stride, data_type):
        self.tensors[name] = FakeTensor(name, dim=list(dim), stride=list(stride), data_type=data_type)
        return self.tensors[name]

    def sdpa_fp8(self, **kw):
        self.sdpa = kw
        return [FakeTensor(n) for n in ("O", "Stats", "Amax_S", "Amax_O")]

    def __getattr__(self, step):  # validate, build_operation_graph, ...: logged in order
        return lambda *a: self.log.append((step, a))


class FakeCudnn:
    """What peers.cudnn_fp8_graph reads of cudnn-frontend's module."""

    class data_type:
        FP8_E4M3, FLOAT = "e4m3", "f32"

    class heur_mode:
        A, FALLBACK = "A", "FALLBACK"

    class diagonal_alignment:
        TOP_LEFT = "top_left"

    def __init__(self):
        self.log = []

    def pygraph(self, **kw):
        return FakeGraph(self.log, kw)


class Fp8(unittest.TestCase):
    def test_the_pass_is_the_forward_grid_in_one_table(self):
        ts = peers.tables_for(peers.parse_args(["fp8"]), [])
        self.assertEqual([t.id for t, _, _ in ts], ["fwd_fp8"])
        table, cases, kind = ts[0]
        self.assertEqual((kind, table.own), ("fp8", "fa4_bf16"))
        self.assertEqual(table.libs, ["fa4", "fa3", "cudnn_fp8", "fa4_bf16"])
        self.assertEqual([c.label for c in cases], [c.label for c in peers.fwd_cases(False)])
        labels = [c.label for c in cases]
        self.assertIn("d128 16k", labels)  # the two shapes the fp8 claims are about
        self.assertIn("d256 16k", labels)
        quick = peers.tables_for(peers.parse_args(["fp8", "--quick"]), ["alt"])[0]
        self.assertEqual(len(quick[1]), 6)
        self.assertEqual(quick[0].libs[-1], "alt")
        self.assertEqual(peers.parse_args(["fp8", "--only", "fa4,cudnn_fp8"]).only, ["fa4", "cudnn_fp8"])

    def test_fp8_set_bytes(self):
        # d128 1k: Q, K, V one byte each, O two: 16384 tokens · 16 heads · (128 · 3 + 2 · 128).
        c = peers.fwd_cases(False)[6]
        self.assertEqual(c.fp8_set_bytes(), 16384 * 16 * 640)
        self.assertEqual(peers.copies_for(c.fp8_set_bytes(), 50 << 20), 2)
        self.assertEqual(peers.copies_for(c.set_bytes(), 50 << 20), 1)

    def test_the_own_column_is_a_ratio_never_the_best_peer(self):
        t = peers.Table("fwd_fp8", "fp8", "TFLOP/s", ["fa4", "fa3", "cudnn_fp8", "fa4_bf16"], own="fa4_bf16")
        res = {"fa4": [(1.0, 10.0)] * 5, "fa3": [(1.1, 10.0)] * 5, "cudnn_fp8": [(1.2, 80.0)] * 5,
               "fa4_bf16": [(0.5, 10.0)] * 5}  # the own column faster than all: still not a peer
        row = t.add("d128 16k", res, lambda ms: 1.0 / ms)
        s = row["_summary"]
        self.assertEqual(s["best"], "fa3")
        self.assertAlmostEqual(s["own"], 0.5)
        self.assertIn("0.50x", t.line(row))
        self.assertIn("fa4/fa4_bf16", t.header())
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            peers.summarise(t)
        self.assertIn("fwd_fp8: fa4 / fa4_bf16 geomean 0.500x over 1 cases", out.getvalue())
        self.assertIn("at least 1.8x on 0", out.getvalue())
        meta = dict(date="2026-12-06", gpu="NVIDIA H100", driver=None, versions=FakeMods.versions, method="m",
                    lib_names=peers.Mods.lib_names(FakeMods()))
        j = t.json(meta)
        perf_table.validate(j, "fwd_fp8.json")
        self.assertEqual(j["lib_names"]["cudnn_fp8"], "cuDNN 9.19 (fp8 O)")
        self.assertEqual(perf_table.best_peer(j, j["rows"][0])[0], "fa3")
        self.assertFalse(perf_table.is_peer(j, "fa4_bf16"))
        self.assertTrue(perf_table.is_peer(j, "cudnn_fp8"))
        self.assertIn("cuDNN frontend 1.32.0", perf_table.caption_text(j))

    def test_bshd_strides(self):
        # A contiguous (2, 3, 4, 8) tensor seen as (batch, heads, seqlen, d).
        self.assertEqual(peers.bshd(2, 3, 4, 8), ([2, 4, 3, 8], [96, 8, 32, 1]))

    def test_cudnn_graph(self):
        cases = {c.label: c for c in peers.fwd_cases(True)}
        for label, causal in (("d128 4k", False), ("d128 4k causal", True)):
            cud = FakeCudnn()
            g, ts = peers.cudnn_fp8_graph(cud, cases[label], "handle")
            self.assertEqual(g.kwargs, dict(io_data_type="e4m3", intermediate_data_type="f32", compute_data_type="f32",
                                            handle="handle"))
            # 4 sequences of 4096, 16 heads of 128, in fa4's (batch, seqlen, heads, d) layout.
            self.assertEqual(ts["q"].attrs, dict(dim=[4, 16, 4096, 128], stride=[4096 * 2048, 128, 2048, 1],
                                                 data_type="e4m3"))
            self.assertEqual(ts["descale_v"].attrs["dim"], [1, 1, 1, 1])
            self.assertEqual(ts["o"].attrs, dict(output=True, dim=[4, 16, 4096, 128],
                                                 stride=[4096 * 2048, 128, 2048, 1], data_type="e4m3"))
            self.assertNotIn("amax_s", ts)
            self.assertEqual(ts["amax_o"].attrs["data_type"], "f32")
            kw = g.sdpa
            self.assertEqual(kw["generate_stats"], False)
            self.assertAlmostEqual(kw["attn_scale"], 128 ** -0.5)
            self.assertEqual(kw["scale_s"], ts["scale_s"])
            if causal:
                self.assertEqual((kw["diagonal_alignment"], kw["right_bound"]), ("top_left", 0))
            else:
                self.assertNotIn("right_bound", kw)
            self.assertEqual([step for step, _ in cud.log],
                             ["validate", "build_operation_graph", "create_execution_plans", "check_support",
                              "build_plans"])
        _, ts = peers.cudnn_fp8_graph(FakeCudnn(), cases["d128 1k"], None, amax_s_output=True)
        self.assertEqual(ts["amax_s"].attrs["output"], True)

    def test_method_line_and_wanted(self):
        a = peers.parse_args(["fp8", "--rounds", "3"])
        line = peers.method_line(a)
        self.assertIn("per-tensor descales and fp8 O", line)
        self.assertIn("3 rounds", line)

        class M:
            libs, only = peers.PASS_LIBS["fp8"], None
        self.assertTrue(peers.Mods.wanted(M, "cudnn_fp8"))
        self.assertFalse(peers.Mods.wanted(M, "fa4cute"))  # not imported for this pass
        M.only = ["fa4"]
        self.assertFalse(peers.Mods.wanted(M, "fa3"))


class Ncu(unittest.TestCase):
    def test_kernels_are_grouped_between_markers(self):
        kernels = [("fa4_fwd_sm90", 100000), ("fa4_fixup", 3000), ("spin_kernel", 1000),
                   ("fa4_fwd_sm90", 110000), ("fa4_fixup", 3000), ("spin_kernel", 1000),
                   ("fa4_fwd_sm90", 90000), ("fa4_fixup", 3000), ("spin_kernel", 1000),
                   ("cudnn_fprop", 200000), ("spin_kernel", 1000)]
        labels = [{"case": "d128 1k", "lib": "fa4"}] * 3 + [{"case": "d128 1k", "lib": "cudnn"}]
        out = peers.ncu_durations(kernels, labels)
        self.assertAlmostEqual(out["d128 1k"]["fa4"], 103.0)  # calls of 93, 103, 113 µs
        self.assertAlmostEqual(out["d128 1k"]["cudnn"], 200.0)

    def test_csv_reading(self):
        text = ('==PROF== Connected\n"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n'
                '"0","fa4_fwd_sm90","1,234"\n"1","spin_kernel","900"\n')
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "r.csv")
            with open(p, "w") as f:
                f.write(text)
            self.assertEqual(peers.read_ncu_csv(p), [("fa4_fwd_sm90", 1234.0), ("spin_kernel", 900.0)])


if __name__ == "__main__":
    unittest.main()
