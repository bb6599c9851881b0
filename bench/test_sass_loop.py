"""Unit tests of bench/sass_loop.py on a made-up dump (no GPU, no CUDA tools)."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_loop  # noqa: E402

DUMP = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   FMUL R2, R2, R3 ;
        /*0030*/              @!P0 BRA 0x60 ;
        /*0040*/                   FSEL R4, R4, -INF , P1 ;
        /*0050*/                   FSEL R5, R5, -INF , P1 ;
        /*0060*/                   MUFU.EX2 R6, R6 ;
        /*0070*/               @P2 BRA 0x10 ;
        /*0080*/              @!P3 BRA 0x0 ;
        /*0090*/                   EXIT ;
"""


class SassLoop(unittest.TestCase):
    def test_the_innermost_loop_with_hgmma_block_by_block(self):
        ins = sass_loop.functions(DUMP)["k"]
        self.assertEqual(sass_loop.main_loop(ins), (0x10, 0x70))
        self.assertEqual([(a, b) for a, b, _ in sass_loop.blocks(ins, 0x10, 0x70)],
                         [(0x10, 0x30), (0x40, 0x50), (0x60, 0x70)])

    def test_cold_blocks_stay_out_of_the_steady_state(self):
        ins = sass_loop.functions(DUMP)["k"]
        out = sass_loop.report(ins, [(0x40, 0x50)])
        self.assertIn("steady state: 5 instructions", out)
        self.assertNotIn("FSEL", out.splitlines()[-1])
        self.assertIn("FSEL 2", sass_loop.report(ins, []).splitlines()[-1])

    def test_opcode_drops_guard_and_modifiers(self):
        self.assertEqual(sass_loop.opcode("@!P0 BRA 0x60"), "BRA")
        self.assertEqual(sass_loop.opcode("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ"), "HGMMA")

    def test_bad_arguments_exit_2_naming_them(self):
        with tempfile.NamedTemporaryFile("w", suffix=".sass", delete=False) as f:
            f.write(DUMP)
        try:
            for argv, word in (([f.name, "--function", "nope"], "--function"),
                               ([f.name, "--cold", "zz"], "--cold"),
                               ([f.name + ".missing"], ".missing")):
                err = io.StringIO()
                with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
                    sass_loop.run(argv)
                self.assertEqual(e.exception.code, 2)
                self.assertIn(word, err.getvalue())
        finally:
            os.unlink(f.name)


if __name__ == "__main__":
    unittest.main()
