"""Unit checks of bench/perf_table.py and bench/plot_perf.py: the table schema, fa4's ratio to
its best peer (nulls, lower-is-better units, the spread rule), the markdown, and that docs/perf.md's
generated tables match docs/data. The drawing test needs matplotlib and is skipped without it.

    python3 -m unittest discover -s bench -p 'test_*.py'
"""
import copy, glob, importlib.util, json, os, sys, tempfile, unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import perf_table as pt  # noqa: E402
import plot_perf  # noqa: E402

DOCS = os.path.join(HERE, "..", "docs")


def table(**over):
    t = {
        "id": "t", "title": "T", "date": "2026-12-02", "gpu": "NVIDIA H200", "driver": "580.159.04",
        "versions": {"torch": "2.11.0+cu130", "fa4": "abc1234"},
        "method": "one CUDA event pair around 10 back-to-back calls, median of 9 rounds",
        "unit": "TFLOP/s", "higher_is_better": True,
        "libs": ["fa4", "cudnn", "fa2"],
        "lib_names": {"fa4": "fa4", "cudnn": "cuDNN 9.19", "fa2": "FlashAttention-2"},
        "rows": [
            {"case": "a", "values": {"fa4": 400.0, "cudnn": 440.0, "fa2": 300.0}},
            {"case": "b", "values": {"fa4": 500.0, "cudnn": None, "fa2": 250.0}},
            {"case": "c", "values": {"fa4": None, "cudnn": 100.0, "fa2": 90.0}},
            {"case": "d", "values": {"fa4": 10.0, "cudnn": None, "fa2": None}},
        ],
    }
    t.update(over)
    return t


class Schema(unittest.TestCase):
    def test_a_good_table_passes(self):
        t = table()
        self.assertIs(pt.validate(t), t)

    def test_every_file_in_docs_data_loads(self):
        files = sorted(glob.glob(os.path.join(DOCS, "data", "*.json")))
        self.assertTrue(files, "docs/data holds no tables")
        for f in files:
            with self.subTest(f=os.path.basename(f)):
                t = pt.load(f)
                self.assertEqual(t["libs"][0], "fa4")

    def bad(self, t, words):
        with self.assertRaises(pt.SchemaError) as e:
            pt.validate(t)
        self.assertIn(words, str(e.exception))

    def test_missing_field(self):
        t = table()
        del t["unit"]
        self.bad(t, "missing unit")

    def test_fa4_must_be_a_library(self):
        t = table(libs=["cudnn", "fa2"], lib_names={"cudnn": "c", "fa2": "f"})
        self.bad(t, "must include 'fa4'")

    def test_names_must_match_libraries(self):
        t = table()
        del t["lib_names"]["fa2"]
        self.bad(t, "lib_names")

    def test_values_are_numbers_or_null(self):
        t = table()
        t["rows"][0]["values"]["fa2"] = "300"
        self.bad(t, "rows[0].values.fa2")
        t["rows"][0]["values"]["fa2"] = float("nan")
        self.bad(t, "rows[0].values.fa2")
        t["rows"][0]["values"]["fa2"] = True
        self.bad(t, "rows[0].values.fa2")

    def test_unknown_library_in_a_row(self):
        t = table()
        t["rows"][1]["spread"] = {"fa3": 0.01}
        self.bad(t, "'fa3' is not in `libs`")

    def test_rounds_are_lists_of_numbers(self):
        t = table()
        t["rows"][0]["rounds"] = {"fa4": [0.5, 0.51], "cudnn": None}
        pt.validate(t)
        t["rows"][0]["rounds"] = {"fa4": [0.5, "x"]}
        self.bad(t, "rows[0].rounds.fa4")

    def test_other_fields_are_carried_along(self):
        t = table(notes="kept")
        t["rows"][0]["verdict"] = "win"
        pt.validate(t)

    def test_dates_and_duplicate_cases(self):
        self.bad(table(date="2/12/2026"), "YYYY-MM-DD")
        t = table()
        t["rows"][1]["case"] = "a"
        self.bad(t, "appears twice")

    def test_gpu_and_driver_may_be_null(self):
        pt.validate(table(gpu=None, driver=None))
        self.bad(table(driver=580), "`driver`")

    def test_id_must_be_the_file_stem(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "other.json")
            with open(p, "w") as f:
                json.dump(table(), f)
            with self.assertRaises(pt.SchemaError) as e:
                pt.load(p)
            self.assertIn("file stem 'other'", str(e.exception))
            p = os.path.join(d, "t.json")
            with open(p, "w") as f:
                f.write("{not json")
            with self.assertRaises(pt.SchemaError):
                pt.load(p)


class Ratios(unittest.TestCase):
    def test_best_peer_and_ratio_for_a_rate(self):
        t = table()
        a, b, c, d = t["rows"]
        self.assertEqual(pt.best_peer(t, a), ("cudnn", 440.0))
        self.assertAlmostEqual(pt.ratio(t, a), 400 / 440)
        self.assertEqual(pt.best_peer(t, b), ("fa2", 250.0))   # cuDNN's null is skipped
        self.assertAlmostEqual(pt.ratio(t, b), 2.0)
        self.assertIsNone(pt.ratio(t, c))                      # fa4 did not run it
        self.assertIsNone(pt.best_peer(t, d))                  # no peer ran it
        self.assertIsNone(pt.ratio(t, d))

    def test_own_columns_and_diagnostics_are_not_peers(self):
        t = table(libs=["fa4", "sm80", "cudnn", "cudnn_expanded"],
                  lib_names={"fa4": "fa4", "sm80": "fa4 with FA4_BWD_KERNEL=sm80",
                             "cudnn": "cuDNN 9.19", "cudnn_expanded": "cuDNN, K/V repeated"},
                  rows=[{"case": "a", "values": {"fa4": 400.0, "sm80": 900.0, "cudnn": 440.0,
                                                 "cudnn_expanded": 800.0}}])
        self.assertEqual(pt.peers(t), ["cudnn"])
        self.assertEqual(pt.best_peer(t, t["rows"][0]), ("cudnn", 440.0))
        self.assertTrue(pt.is_peer(table(), "fa2"))
        named = table(lib_names={"fa4": "fa4", "cudnn": "cuDNN", "fa2": "fa4cute-like name"})
        self.assertTrue(pt.is_peer(named, "fa2"))

    def test_lower_is_better_inverts(self):
        t = table(unit="µs", higher_is_better=False)
        a = t["rows"][0]
        self.assertEqual(pt.best_peer(t, a), ("fa2", 300.0))
        self.assertAlmostEqual(pt.ratio(t, a), 300 / 400)

    def test_verdict_needs_both_spreads(self):
        t = table()
        a = t["rows"][0]                                       # 0.909
        self.assertIsNone(pt.verdict(t, a))
        a["spread"] = {"fa4": 0.02, "cudnn": 0.05}
        self.assertEqual(pt.verdict(t, a), "loss")
        a["spread"] = {"fa4": 0.02, "cudnn": 0.12}
        self.assertEqual(pt.verdict(t, a), "tie")
        a["values"]["fa4"] = 480.0                             # 1.09, margin 0.05
        a["spread"] = {"fa4": 0.05, "cudnn": 0.01}
        self.assertEqual(pt.verdict(t, a), "win")
        a["spread"] = {"fa4": 0.05}
        self.assertIsNone(pt.verdict(t, a))

    def test_summary(self):
        s = pt.summary(table())
        self.assertEqual((s["n"], s["ahead"], s["behind"], s["level"]), (2, 1, 1, 0))
        self.assertAlmostEqual(s["geomean"], (400 / 440 * 2.0) ** 0.5)

    def test_colours_follow_the_ratio_or_the_verdict(self):
        t = table()
        labels = [c and c[0] for c in plot_perf.colours(t)]
        self.assertEqual(labels, ["behind", "ahead", None, None])
        t["rows"][0]["spread"] = {"fa4": 0.02, "cudnn": 0.12}
        self.assertEqual(plot_perf.colours(t)[0][0], "tie")


class Markdown(unittest.TestCase):
    def test_table(self):
        md = pt.markdown(table(), caption=False).splitlines()
        self.assertEqual(md[0], "| case | fa4 | cuDNN 9.19 | FlashAttention-2 | best peer | fa4 / best peer |")
        self.assertEqual(md[2], "| a | 400 | 440 | 300 | cuDNN 9.19 | 0.91 |")
        self.assertEqual(md[3], "| b | 500 | – | 250 | FlashAttention-2 | **2.00** |")
        self.assertEqual(md[4], "| c | – | 100 | 90 | cuDNN 9.19 | – |")
        self.assertEqual(md[5], "| d | 10 | – | – | – | – |")

    def test_decimals_follow_the_data(self):
        t = table()
        t["rows"][0]["values"]["fa2"] = 2.5
        t["rows"][1]["values"]["fa2"] = 4.25
        self.assertEqual(pt.decimals(t), 2)
        self.assertIn("| 400.00 |", pt.markdown(t, caption=False))

    def test_spreads_and_verdicts_appear_when_given(self):
        t = table()
        t["rows"][0]["spread"] = {"fa4": 0.02, "cudnn": 0.05}
        md = pt.markdown(t, caption=False).splitlines()
        self.assertTrue(md[0].endswith("| verdict |"))
        self.assertEqual(md[2], "| a | 400 (2.0%) | 440 (5.0%) | 300 | cuDNN 9.19 | 0.91 | loss |")

    def test_caption_names_date_gpu_versions_method(self):
        cap = pt.caption_text(table())
        for words in ("2026-12-02", "NVIDIA H200", "driver 580.159.04", "torch 2.11.0+cu130",
                      "median of 9 rounds", "TFLOP/s"):
            self.assertIn(words, cap.replace("\n", " "))

    def test_perf_md_matches_its_data(self):
        md = os.path.join(DOCS, "perf.md")
        with open(md, encoding="utf-8") as f:
            ids = [i for i, _, _ in pt.blocks(f.read(), os.path.join(DOCS, "data"))]
        self.assertTrue(ids, "docs/perf.md has no generated table")
        self.assertEqual(pt.check(md), [], "run: python3 bench/perf_table.py --update docs/perf.md")

    def test_update_rewrites_a_stale_block(self):
        with tempfile.TemporaryDirectory() as d:
            os.mkdir(os.path.join(d, "data"))
            with open(os.path.join(d, "data", "t.json"), "w") as f:
                json.dump(table(), f)
            md = os.path.join(d, "x.md")
            with open(md, "w") as f:
                f.write("before\n<!-- table: t -->\nold\n<!-- end table -->\nafter\n")
            self.assertEqual(pt.check(md), ["t"])
            self.assertEqual(pt.update(md), ["t"])
            self.assertEqual(pt.check(md), [])
            with open(md) as f:
                text = f.read()
            self.assertTrue(text.startswith("before\n<!-- table: t -->\n**T.**"))
            self.assertTrue(text.endswith("<!-- end table -->\nafter\n"))


@unittest.skipUnless(importlib.util.find_spec("matplotlib"), "matplotlib is not installed")
class Drawing(unittest.TestCase):
    def test_svg_is_small_and_keeps_text_as_text(self):
        t = copy.deepcopy(table())
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "t.svg")
            plot_perf.draw(t, p)
            with open(p, encoding="utf-8") as f:
                svg = f.read()
        self.assertIn("<svg", svg)
        self.assertLess(len(svg.encode()), 60_000)
        self.assertNotIn("@font-face", svg)
        self.assertIn("cuDNN 9.19", svg)

    def test_main_writes_one_svg_per_table(self):
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "t.json")
            with open(src, "w") as f:
                json.dump(table(), f)
            self.assertEqual(plot_perf.main([src, "--out", d]), 0)
            self.assertTrue(os.path.exists(os.path.join(d, "t.svg")))


if __name__ == "__main__":
    unittest.main()
