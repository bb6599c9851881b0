//! FA4Config against the contract: worked values, invariants over a sweep, error cases.

use fa4::config::sm100::{FA4Config, FA4Inputs, Swizzle, Unsupported};
use fa4::Error;

fn plan(
    num_q_heads: u32,
    group: u32,
    depth: u32,
    dtype_size: u32,
    swizzle_mode: Swizzle,
) -> FA4Config {
    FA4Config::new(FA4Inputs {
        num_q_heads,
        group,
        depth,
        dtype_size,
        swizzle_mode,
    })
    .unwrap_or_else(|e| {
        panic!("valid inputs H={num_q_heads} g={group} d={depth} s={dtype_size}: {e}")
    })
}

/// The contract's worked-values table (128B swizzle):
/// s, d, split, BM, pd, BN, S1, C0, C1, O0, O1, tmem_used, kv_stages, smem_used, supported.
type Row = (
    u32,
    u32,
    bool,
    u64,
    u64,
    u64,
    u32,
    u32,
    u32,
    u32,
    u32,
    u64,
    u64,
    u64,
    bool,
);

const WORKED: [Row; 5] = [
    (
        2, 64, false, 256, 64, 192, 192, 96, 288, 384, 448, 512, 8, 229_628, true,
    ),
    (
        2, 128, false, 256, 128, 128, 128, 64, 192, 256, 384, 512, 5, 229_580, true,
    ),
    (
        2, 256, true, 128, 256, 256, 1_048_576, 128, 1_048_704, 256, 1_048_832, 512, 1, 196_748,
        false,
    ),
    (
        1, 128, false, 256, 128, 128, 128, 64, 192, 256, 384, 512, 12, 229_692, true,
    ),
    (
        1, 256, true, 128, 256, 256, 1_048_576, 128, 1_048_704, 256, 1_048_832, 512, 3, 229_548,
        true,
    ),
];

#[test]
fn worked_values_match_the_contract_for_every_group() {
    for (s, d, split, bm, pd, bn, s1, c0, c1, o0, o1, tmem, stages, smem, ok) in WORKED {
        for (h, g) in [(32, 1), (32, 4), (32, 8), (8, 8), (1, 1)] {
            let c = plan(h, g, d, s, Swizzle::B128);
            let ctx = format!("s={s} d={d} H={h} g={g}");
            assert_eq!(c.split_m(), split, "{ctx}");
            assert_eq!(c.bm(), bm, "{ctx}");
            assert_eq!(c.mma_m(), if split { 64 } else { 128 }, "{ctx}");
            assert_eq!(c.padded_depth(), pd, "{ctx}");
            assert_eq!(c.bn(), bn, "{ctx}");
            assert_eq!(c.bk0(), pd, "{ctx}");
            assert_eq!(c.bk1(), bn, "{ctx}");
            assert_eq!(c.tmem_s1().raw(), s1, "{ctx}");
            assert_eq!(c.tmem_p0().raw(), 0, "{ctx}");
            assert_eq!(c.tmem_p1().raw(), s1, "{ctx}");
            assert_eq!(c.tmem_c0().raw(), c0, "{ctx}");
            assert_eq!(c.tmem_c1().raw(), c1, "{ctx}");
            assert_eq!(c.tmem_o0().raw(), o0, "{ctx}");
            assert_eq!(c.tmem_o1().raw(), o1, "{ctx}");
            assert_eq!(c.tmem_used(), tmem, "{ctx}");
            assert_eq!(c.num_kv_stages(), stages, "{ctx}");
            assert_eq!(c.num_mma_stages(), 1, "{ctx}");
            assert_eq!(c.smem_used(), smem, "{ctx}");
            assert_eq!(c.supported(), ok, "{ctx}");
            assert_eq!(c.num_kv_heads(), u64::from(h / g), "{ctx}");
            assert_eq!(c.group(), u64::from(g), "{ctx}");
            assert!(c.use_tmem_for_correction(), "{ctx}");
            assert_eq!(c.correction_smem_elements(), 0, "{ctx}");
            assert_eq!(c.num_qo(), 2);
            assert_eq!(c.num_active_warps_per_group(), 4);
            assert_eq!(c.num_active_threads_per_group(), 128);
        }
    }
}

#[test]
fn bf16_d256_is_unsupported_for_stages_alone() {
    let c = plan(32, 1, 256, 2, Swizzle::B128);
    assert_eq!(
        c.unsupported_reasons(),
        vec![Unsupported::TooFewKvStages {
            stages: 1,
            per_stage: 256 * 256 * 2 + 16,
            available: 232_448 - (4 + 15 * 8 + 128 * 256 * 2),
        }]
    );
}

#[test]
fn split_m_second_tile_is_lane_16_of_the_same_columns() {
    let c = plan(16, 2, 192, 1, Swizzle::B128);
    for (a, b) in [
        (FA4Config::TMEM_S0, c.tmem_s1()),
        (c.tmem_p0(), c.tmem_p1()),
        (c.tmem_c0(), c.tmem_c1()),
        (c.tmem_o0(), c.tmem_o1()),
    ] {
        assert_eq!(b.column(), a.column());
        assert_eq!(b.lane(), a.lane() + 16);
        assert_eq!(b.raw(), a.raw() + (16 << 16));
    }
    // Upstream's `(X + 16) << 16` would put O1 at 17 825 792 for BN = 256.
    assert_ne!(
        plan(32, 1, 256, 2, Swizzle::B128).tmem_o1().raw(),
        (256 + 16) << 16
    );
}

#[test]
fn constants_are_the_seed_values() {
    assert_eq!(FA4Config::MMA_K, 16);
    assert_eq!(FA4Config::NUM_THREADS, 512);
    assert_eq!(FA4Config::SM100_SMEM_CARVEOUT, 232_448);
    assert_eq!(FA4Config::SM100_TMEM_COLS, 512);
    assert_eq!(FA4Config::MBAR_SIZE, 8);
    assert_eq!(FA4Config::NUM_CORRECTION_COLS, 1);
    assert_eq!(FA4Config::TMEM_S0.raw(), 0);
    let bytes: Vec<u32> = Swizzle::ALL.iter().map(|s| s.bytes()).collect();
    assert_eq!(bytes, [16, 32, 64, 128]);
}

#[test]
fn other_swizzles_follow_the_formula() {
    // bf16 d = 80: 64B swizzle rows of 32 elements pad to 96; none pads to 80 and BN = 176.
    let c = plan(8, 1, 80, 2, Swizzle::B64);
    assert_eq!((c.padded_depth(), c.bn()), (96, 160));
    let c = plan(8, 1, 80, 2, Swizzle::None);
    assert_eq!((c.padded_depth(), c.bn()), (80, 176));
    assert_eq!(c.tmem_used(), 2 * 176 + 2 * 80);
    // f32, 128B: 32 elements per row.
    let c = plan(8, 1, 40, 4, Swizzle::B128);
    assert_eq!(c.padded_depth(), 64);
    assert!(!plan(8, 1, 32, 2, Swizzle::B128).supported(), "d < 64");
}

fn overlaps(a: &std::ops::Range<u64>, b: &std::ops::Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Checks every invariant of one config; returns whether it was supported.
fn check_invariants(c: &FA4Config, ctx: &str) -> bool {
    let b = c.smem_budget();
    assert_eq!(b.total, c.smem_used(), "{ctx}: budget adds up");
    assert!(c.padded_depth() >= c.depth(), "{ctx}");
    let row = u64::from(c.swizzle_mode().bytes()) / c.dtype_size();
    assert_eq!(c.padded_depth() % row, 0, "{ctx}");
    assert!(c.padded_depth() - c.depth() < row, "{ctx}");
    assert!(c.bn().is_multiple_of(16) && c.bn() <= 256, "{ctx}");
    assert_eq!(c.supported(), c.unsupported_reasons().is_empty(), "{ctx}");
    if !c.supported() {
        return false;
    }
    assert!(c.tmem_used() <= 512, "{ctx}");
    assert!(c.smem_used() <= FA4Config::SM100_SMEM_CARVEOUT, "{ctx}");
    assert!(
        c.num_kv_stages() >= 2 && c.bn() >= 64 && c.depth() >= 64,
        "{ctx}"
    );
    let regions = c.tmem_regions();
    for r in &regions {
        assert!(
            r.column_range().end <= 512,
            "{ctx}: {} past column 512",
            r.name
        );
    }
    // Within one tile P, C and O are disjoint, and so are S and O (P and C lie inside S by design).
    for tile in 0..2 {
        let col = |n: &str| {
            regions
                .iter()
                .find(|r| r.tile == tile && r.name.starts_with(n))
                .unwrap()
                .column_range()
        };
        let (s, p, cc, o) = (col("S"), col("P"), col("C"), col("O"));
        for (x, y, what) in [
            (&p, &cc, "P/C"),
            (&p, &o, "P/O"),
            (&cc, &o, "C/O"),
            (&s, &o, "S/O"),
        ] {
            assert!(
                !overlaps(x, y),
                "{ctx}: tile {tile} {what} overlap: {x:?} {y:?}"
            );
        }
        assert!(cc.start >= s.start && cc.end <= s.end, "{ctx}: C inside S");
    }
    // Across tiles: same lanes (not split) means disjoint columns; split means lane offset 16.
    if !c.split_m() {
        for r0 in regions.iter().filter(|r| r.tile == 0) {
            for r1 in regions.iter().filter(|r| r.tile == 1) {
                assert!(
                    !overlaps(&r0.column_range(), &r1.column_range()),
                    "{ctx}: {} and {} overlap",
                    r0.name,
                    r1.name
                );
            }
        }
    } else {
        for r1 in regions.iter().filter(|r| r.tile == 1) {
            assert_eq!(r1.start.lane(), 16, "{ctx}");
        }
    }
    true
}

#[test]
fn invariants_hold_and_nothing_overflows_for_depth_up_to_65536() {
    let mut supported = 0;
    for s in [1, 2, 4] {
        for sw in Swizzle::ALL {
            for d in (1..=65_536).chain([1 << 20, u32::MAX - 1, u32::MAX]) {
                let c = plan(64, 8, d, s, sw);
                if check_invariants(&c, &format!("s={s} sw={sw} d={d}")) {
                    supported += 1;
                }
            }
        }
    }
    assert!(supported > 100, "the sweep must reach supported configs");
}

#[test]
fn every_input_error_names_its_argument() {
    let base = FA4Inputs {
        num_q_heads: 32,
        group: 1,
        depth: 128,
        dtype_size: 2,
        swizzle_mode: Swizzle::B128,
    };
    let cases = [
        (
            FA4Inputs {
                num_q_heads: 0,
                ..base
            },
            "num_q_heads",
        ),
        (FA4Inputs { group: 0, ..base }, "group"),
        (FA4Inputs { group: 3, ..base }, "group"),
        (FA4Inputs { group: 64, ..base }, "group"),
        (FA4Inputs { depth: 0, ..base }, "depth"),
        (
            FA4Inputs {
                dtype_size: 0,
                ..base
            },
            "dtype_size",
        ),
        (
            FA4Inputs {
                dtype_size: 3,
                ..base
            },
            "dtype_size",
        ),
        (
            FA4Inputs {
                dtype_size: 8,
                ..base
            },
            "dtype_size",
        ),
    ];
    for (inputs, arg) in cases {
        match FA4Config::new(inputs) {
            Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, arg, "{inputs:?}"),
            other => panic!("{inputs:?}: expected an error naming {arg}, got {other:?}"),
        }
    }
}

#[test]
fn json_has_the_seed_names_and_values() {
    let c = plan(32, 4, 128, 2, Swizzle::B128);
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    let fields = [
        "MMA_M",
        "BM",
        "BN",
        "BK0",
        "BK1",
        "depth",
        "padded_depth",
        "group",
        "num_q_heads",
        "num_kv_heads",
        "TMEM_S1",
        "TMEM_O0",
        "TMEM_O1",
        "TMEM_P0",
        "TMEM_P1",
        "TMEM_C0",
        "TMEM_C1",
        "tmem_used",
        "num_kv_stages",
        "num_mma_stages",
        "smem_used",
        "dtype_size",
        "split_m",
        "swizzle_mode",
        "TMEM_S0",
        "MMA_K",
        "num_threads",
        "sm100_smem_carveout",
        "sm100_tmem_cols",
        "mbar_size",
        "num_correction_cols",
        "num_qo",
        "supported",
        "use_tmem_for_correction",
        "correction_smem_elements",
        "num_active_warps_per_group",
        "num_active_threads_per_group",
    ];
    for k in fields {
        assert!(v.get(k).is_some(), "missing key {k}");
    }
    assert_eq!(v["num_kv_heads"], 8);
    assert_eq!(v["swizzle_mode"], "128B");
    assert_eq!(v["split_m"], false);
    assert_eq!(v["supported"], true);
    assert_eq!(v["TMEM_O1"], 384);
}
