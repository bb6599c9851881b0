//! `fa4::mask` defines the key blocks a tile visits and which of them need a per-element mask;
//! `kernels/common/mask.cuh` implements them for every CUDA kernel. This test evaluates the
//! header's formulas (transcribed below, and checked to still be the header's text) against
//! `SeqMask` on every mask kind and many shapes, so that a kernel walk (decode, backward) can be
//! proved on the CPU before it runs.

use fa4::mask::{Mask, TileKind};

const MASK_CUH: &str = include_str!("../src/kernels/common/mask.cuh");

/// The header's inputs: the prelude's HAS_WINDOW and the params' window sides (−1 unbounded, as
/// the launch passes a side at least as long as the sequence's queries plus keys).
struct Cuda {
    has_window: bool,
    window_left: i64,
    window_right: i64,
    q_len: i64,
    k_len: i64,
    block_n: i64,
}

impl Cuda {
    fn new(mask: Mask, q_len: usize, k_len: usize, block_n: usize) -> Cuda {
        let (left, right) = mask.bounds();
        let span = q_len + k_len;
        let side = |b: Option<usize>| match b {
            Some(x) if x < span => x as i64,
            _ => -1,
        };
        Cuda {
            has_window: mask.is_restrictive(),
            window_left: side(left),
            window_right: side(right),
            q_len: q_len as i64,
            k_len: k_len as i64,
            block_n: block_n as i64,
        }
    }
    fn key_lo(&self, i: i64) -> i64 {
        if !self.has_window || self.window_left < 0 {
            return 0;
        }
        0.max(i + self.k_len - self.q_len - self.window_left)
    }
    fn key_hi(&self, i: i64) -> i64 {
        if !self.has_window || self.window_right < 0 {
            return self.k_len;
        }
        0.max(
            self.k_len
                .min(i + self.k_len - self.q_len + self.window_right + 1),
        )
    }
    /// `key_blocks`: (n_begin, n_end, free_lo, free_hi).
    fn key_blocks(&self, first_row: i64, last_row: i64) -> (i64, i64, i64, i64) {
        let (span_lo, span_hi) = (self.key_lo(first_row), self.key_hi(last_row));
        let n_begin = span_lo / self.block_n;
        let n_end = if span_hi > span_lo {
            (span_hi + self.block_n - 1) / self.block_n
        } else {
            n_begin
        };
        (
            n_begin,
            n_end,
            self.key_lo(last_row),
            self.key_hi(first_row),
        )
    }
    fn masked(&self, free_lo: i64, free_hi: i64, n: i64) -> bool {
        let key0 = n * self.block_n;
        key0 < free_lo || key0 + self.block_n > free_hi
    }
}

#[test]
fn the_transcription_is_the_headers_text() {
    for line in [
        "if (!HAS_WINDOW || p.window_left < 0) return 0;",
        "return max(0, i + s.k_len - s.q_len - p.window_left);",
        "if (!HAS_WINDOW || p.window_right < 0) return s.k_len;",
        "return max(0, min(s.k_len, i + s.k_len - s.q_len + p.window_right + 1));",
        "const int span_lo = key_lo(p, s, first_row), span_hi = key_hi(p, s, last_row);",
        "kb.n_begin = span_lo / BLOCK_N;",
        "kb.n_end = span_hi > span_lo && any_rows ? (span_hi + BLOCK_N - 1) / BLOCK_N : kb.n_begin;",
        "kb.free_lo = key_lo(p, s, last_row);",
        "kb.free_hi = key_hi(p, s, first_row);",
        "return key0 < free_lo || key0 + BLOCK_N > free_hi;",
    ] {
        assert!(MASK_CUH.contains(line), "mask.cuh no longer holds `{line}`");
    }
}

#[test]
fn trip_counts_and_masked_blocks_agree_on_every_mask_kind() {
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(0),
            right: Some(0),
        },
        Mask::Window {
            left: Some(5),
            right: Some(0),
        },
        Mask::Window {
            left: Some(100),
            right: None,
        },
        Mask::Window {
            left: None,
            right: Some(37),
        },
        Mask::Window {
            left: Some(64),
            right: Some(200),
        },
        Mask::Window {
            left: None,
            right: None,
        },
        Mask::Window {
            left: Some(1 << 40),
            right: Some(3),
        },
    ];
    let mut checked = 0usize;
    for mask in masks {
        for (sq, sk) in [
            (1, 1),
            (17, 300),
            (128, 128),
            (300, 17),
            (513, 1000),
            (1000, 513),
            (64, 0),
            (200, 64),
        ] {
            for (block_m, block_n) in [(64, 64), (128, 128), (128, 176), (128, 80)] {
                let rust = mask.for_sequence(sq, sk);
                let cuda = Cuda::new(mask, sq, sk, block_n);
                for m0 in (0..sq).step_by(block_m) {
                    let rows = m0..(m0 + block_m).min(sq);
                    let (nb, ne, free_lo, free_hi) =
                        cuda.key_blocks(rows.start as i64, rows.end as i64 - 1);
                    let want = rust.key_blocks(rows.clone(), block_n);
                    let ctx = format!("{mask:?} sq {sq} sk {sk} rows {rows:?} block_n {block_n}");
                    // The same trip (an empty one may start anywhere).
                    assert_eq!((ne - nb).max(0) as usize, want.len(), "trip count, {ctx}");
                    if !want.is_empty() {
                        assert_eq!((nb as usize, ne as usize), (want.start, want.end), "{ctx}");
                    }
                    for n in want.clone() {
                        let keys = n * block_n..((n + 1) * block_n).min(sk);
                        let kind = rust.tile_kind(rows.clone(), keys.clone());
                        // The kernel masks exactly the blocks the Rust mask calls partial, and
                        // a last block that runs past the keys (its padding is masked too).
                        let want_masked = kind != TileKind::Free || (n + 1) * block_n > sk;
                        assert_eq!(
                            cuda.masked(free_lo, free_hi, n as i64),
                            want_masked,
                            "block {n} ({kind:?}), {ctx}"
                        );
                        assert_ne!(kind, TileKind::Masked, "a visited block has a key, {ctx}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 1000, "{checked} blocks checked");
}

impl Cuda {
    fn query_lo(&self, j: i64) -> i64 {
        if !self.has_window || self.window_right < 0 {
            return 0;
        }
        self.q_len
            .min(0.max(j - (self.k_len - self.q_len) - self.window_right))
    }
    fn query_hi(&self, j: i64) -> i64 {
        if !self.has_window || self.window_left < 0 {
            return self.q_len;
        }
        0.max(
            self.q_len
                .min(j - (self.k_len - self.q_len) + self.window_left + 1),
        )
    }
    /// `query_blocks`: (m_begin, m_end, free_lo, free_hi).
    fn query_blocks(&self, first_key: i64, last_key: i64, block_m: i64) -> (i64, i64, i64, i64) {
        let (span_lo, span_hi) = (self.query_lo(first_key), self.query_hi(last_key));
        let m_begin = span_lo / block_m;
        let m_end = if span_hi > span_lo {
            (span_hi + block_m - 1) / block_m
        } else {
            m_begin
        };
        (
            m_begin,
            m_end,
            self.query_lo(last_key),
            self.query_hi(first_key),
        )
    }
}

#[test]
fn the_backward_query_walk_is_the_headers_text() {
    for line in [
        "if (!HAS_WINDOW || p.window_right < 0) return 0;",
        "return min(s.q_len, max(0, j - (s.k_len - s.q_len) - p.window_right));",
        "if (!HAS_WINDOW || p.window_left < 0) return s.q_len;",
        "return max(0, min(s.q_len, j - (s.k_len - s.q_len) + p.window_left + 1));",
        "const int span_lo = query_lo(p, s, first_key), span_hi = query_hi(p, s, last_key);",
        "qb.m_begin = span_lo / block_m;",
        "qb.m_end = span_hi > span_lo ? (span_hi + block_m - 1) / block_m : qb.m_begin;",
        "qb.free_lo = query_lo(p, s, last_key);",
        "qb.free_hi = query_hi(p, s, first_key);",
        "return row0 < free_lo || row0 + block_m > free_hi;",
    ] {
        assert!(MASK_CUH.contains(line), "mask.cuh no longer holds `{line}`");
    }
}

/// The backward's key-side walk: for each key block, the header's query blocks are the Rust
/// `query_blocks`, every query block that holds an allowed element is visited, and the blocks
/// the header runs unmasked are exactly those the Rust mask calls free.
#[test]
fn query_blocks_of_key_blocks_agree_on_every_mask_kind() {
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(0),
            right: Some(0),
        },
        Mask::Window {
            left: Some(5),
            right: Some(0),
        },
        Mask::Window {
            left: Some(100),
            right: None,
        },
        Mask::Window {
            left: None,
            right: Some(37),
        },
        Mask::Window {
            left: Some(1 << 40),
            right: Some(3),
        },
    ];
    let mut checked = 0usize;
    for mask in masks {
        for (sq, sk) in [
            (1, 1),
            (17, 300),
            (128, 128),
            (300, 17),
            (513, 1000),
            (64, 0),
            (0, 64),
        ] {
            for (block_m, block_n) in [(64, 64), (64, 128), (32, 64)] {
                let rust = mask.for_sequence(sq, sk);
                let cuda = Cuda::new(mask, sq, sk, block_n);
                for n0 in (0..sk).step_by(block_n) {
                    let keys = n0..(n0 + block_n).min(sk);
                    let (mb, me, free_lo, free_hi) =
                        cuda.query_blocks(keys.start as i64, keys.end as i64 - 1, block_m as i64);
                    let want = rust.query_blocks(keys.clone(), block_m);
                    let ctx = format!("{mask:?} sq {sq} sk {sk} keys {keys:?} block_m {block_m}");
                    assert_eq!((me - mb).max(0) as usize, want.len(), "trip count, {ctx}");
                    if !want.is_empty() {
                        assert_eq!((mb as usize, me as usize), (want.start, want.end), "{ctx}");
                    }
                    for m in 0..sq.div_ceil(block_m) {
                        let rows = m * block_m..((m + 1) * block_m).min(sq);
                        let kind = rust.tile_kind(rows.clone(), keys.clone());
                        if kind != TileKind::Masked {
                            assert!(want.contains(&m), "block {m} has an allowed element, {ctx}");
                        }
                        if !want.contains(&m) {
                            continue;
                        }
                        let row0 = (m * block_m) as i64;
                        let header_masked = row0 < free_lo || row0 + block_m as i64 > free_hi;
                        let want_masked = kind != TileKind::Free || (m + 1) * block_m > sq;
                        assert_eq!(header_masked, want_masked, "block {m} ({kind:?}), {ctx}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 500, "{checked} blocks checked");
}
