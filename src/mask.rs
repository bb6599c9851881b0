//! Mask kinds and their tile logic, shared by the planners, the CPU backend and the tests.
//!
//! Key `j` is allowed for query row `i` of a sequence with `sq` queries and `sk` keys when
//! `j < sk`, `i < sq` and `i + sk − sq − left ≤ j ≤ i + sk − sq + right` (`docs/attention.md`;
//! windows align to the bottom-right corner). Causal is the window `(unbounded, 0)`.
//! The allowed keys of a row form one interval whose ends never decrease with `i`, which is what
//! makes tile classification exact with two corner tests.

use std::ops::Range;

use crate::error::{Error, Result};

/// Which keys each query may attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mask {
    /// Every key.
    #[default]
    None,
    /// Keys up to the query's diagonal, aligned to the bottom-right corner (`j ≤ i + sk − sq`).
    Causal,
    /// A local window around the diagonal: `left` keys before it and `right` after; `None` is
    /// unbounded on that side.
    Window {
        /// Keys allowed before the diagonal, `None` = unbounded.
        left: Option<usize>,
        /// Keys allowed after the diagonal, `None` = unbounded.
        right: Option<usize>,
    },
}

impl Mask {
    /// A window from FlashAttention-style integers, where −1 means unbounded.
    pub fn window_from_signed(left: i64, right: i64) -> Result<Mask> {
        let side = |name: &str, v: i64| match v {
            -1 => Ok(None),
            v if v >= 0 => Ok(Some(v as usize)),
            v => Err(Error::invalid(
                name,
                format!("window sides are ≥ 0 or −1 (unbounded), got {v}"),
            )),
        };
        Ok(Mask::Window {
            left: side("window.left", left)?,
            right: side("window.right", right)?,
        })
    }

    /// `(left, right)` bounds, `None` = unbounded.
    pub fn bounds(self) -> (Option<usize>, Option<usize>) {
        match self {
            Mask::None => (None, None),
            Mask::Causal => (None, Some(0)),
            Mask::Window { left, right } => (left, right),
        }
    }

    /// True when this mask can exclude keys inside `0..sk` (anything but no mask or a window
    /// unbounded on both sides).
    pub fn is_restrictive(self) -> bool {
        self.bounds() != (None, None)
    }

    /// The mask as it applies to one sequence of `sq` queries and `sk` keys.
    pub fn for_sequence(self, sq: usize, sk: usize) -> SeqMask {
        let (left, right) = self.bounds();
        SeqMask {
            sq: sq as i64,
            sk: sk as i64,
            left: left.map(|l| l.min(i64::MAX as usize / 4) as i64),
            right: right.map(|r| r.min(i64::MAX as usize / 4) as i64),
        }
    }
}

/// How a (query block, key block) tile is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TileKind {
    /// No allowed element: skipped without work.
    Masked,
    /// Some elements masked: each element is checked.
    Partial,
    /// Every element allowed: no per-element checks.
    Free,
}

/// A mask bound to one sequence's lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqMask {
    sq: i64,
    sk: i64,
    left: Option<i64>,
    right: Option<i64>,
}

impl SeqMask {
    /// The allowed keys of query row `i` (possibly empty).
    #[inline]
    pub fn key_range(&self, i: usize) -> Range<usize> {
        let diag = i as i64 + self.sk - self.sq;
        let lo = self.left.map_or(0, |l| (diag - l).max(0));
        let hi = self.right.map_or(self.sk, |r| (diag + r + 1).min(self.sk));
        let hi = hi.max(0);
        let lo = lo.min(hi);
        lo as usize..hi as usize
    }

    /// Whether key `j` is allowed for row `i`.
    #[inline]
    pub fn allowed(&self, i: usize, j: usize) -> bool {
        (i as i64) < self.sq && self.key_range(i).contains(&j)
    }

    /// The keys any row of `rows` may attend to: `[lo(first), hi(last))`, empty if none.
    pub fn key_span(&self, rows: Range<usize>) -> Range<usize> {
        if rows.is_empty() {
            return 0..0;
        }
        let first = self.key_range(rows.start);
        let last = self.key_range(rows.end - 1);
        let lo = first.start;
        let hi = last.end.max(lo);
        lo..hi
    }

    /// Classifies the tile `rows × keys` (both non-empty, inside the sequence).
    pub fn tile_kind(&self, rows: Range<usize>, keys: Range<usize>) -> TileKind {
        let span = self.key_span(rows.clone());
        if keys.end <= span.start || keys.start >= span.end {
            return TileKind::Masked;
        }
        // Interval ends are monotone in the row, so the corners decide.
        let first = self.key_range(rows.start);
        let last = self.key_range(rows.end - 1);
        if last.start <= keys.start && first.end >= keys.end {
            TileKind::Free
        } else {
            TileKind::Partial
        }
    }

    /// Key blocks of size `block_n` (block index range) that `rows` must visit.
    pub fn key_blocks(&self, rows: Range<usize>, block_n: usize) -> Range<usize> {
        let span = self.key_span(rows);
        if span.is_empty() {
            return 0..0;
        }
        span.start / block_n..span.end.div_ceil(block_n)
    }

    /// The query rows that may attend to key `j` (possibly empty): the backward's walk from
    /// the key side. Both ends never decrease with `j`.
    #[inline]
    pub fn query_range(&self, j: usize) -> Range<usize> {
        if j as i64 >= self.sk {
            return 0..0;
        }
        let diag = j as i64 - (self.sk - self.sq);
        let lo = self.right.map_or(0, |r| (diag - r).max(0)).min(self.sq);
        let hi = self
            .left
            .map_or(self.sq, |l| (diag + l + 1).min(self.sq))
            .max(0);
        let lo = lo.min(hi);
        lo as usize..hi as usize
    }

    /// Query blocks of size `block_m` (block index range) that the keys `keys` must visit.
    pub fn query_blocks(&self, keys: Range<usize>, block_m: usize) -> Range<usize> {
        if keys.is_empty() {
            return 0..0;
        }
        let lo = self.query_range(keys.start).start;
        let hi = self.query_range(keys.end - 1).end;
        if hi <= lo {
            return 0..0;
        }
        lo / block_m..hi.div_ceil(block_m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute-force classification by the oracle's per-element predicate (written from the
    /// definition, sharing no code with `SeqMask`), which the fast path must match.
    fn brute(mask: Mask, sq: usize, sk: usize, rows: Range<usize>, keys: Range<usize>) -> TileKind {
        let n = rows.len() * keys.len();
        let allowed = rows
            .clone()
            .flat_map(|i| keys.clone().map(move |j| (i, j)))
            .filter(|&(i, j)| crate::cpu::reference::allowed(mask, sq, sk, i, j))
            .count();
        match allowed {
            0 => TileKind::Masked,
            a if a == n => TileKind::Free,
            _ => TileKind::Partial,
        }
    }

    #[test]
    fn causal_is_bottom_right_aligned() {
        let m = Mask::Causal.for_sequence(2, 5);
        assert_eq!(m.key_range(0), 0..4);
        assert_eq!(m.key_range(1), 0..5);
        let m = Mask::Causal.for_sequence(5, 2);
        assert_eq!(m.key_range(0), 0..0);
        assert_eq!(m.key_range(2), 0..0);
        assert_eq!(m.key_range(3), 0..1);
        assert_eq!(m.key_range(4), 0..2);
    }

    /// Window key ranges worked out by hand from the definition (diagonal `i + sk − sq`).
    #[test]
    fn window_key_ranges_match_hand_derived_values() {
        let w = |left, right| Mask::Window { left, right };
        // (1, 1), sq = sk = 5: keys i − 1 ..= i + 1, clipped to 0..5.
        let m = w(Some(1), Some(1)).for_sequence(5, 5);
        let got: Vec<_> = (0..5).map(|i| m.key_range(i)).collect();
        assert_eq!(got, [0..2, 0..3, 1..4, 2..5, 3..5]);
        // (2, 0), sq = 3, sk = 6: diagonal i + 3, keys i + 1 ..= i + 3.
        let m = w(Some(2), Some(0)).for_sequence(3, 6);
        let got: Vec<_> = (0..3).map(|i| m.key_range(i)).collect();
        assert_eq!(got, [1..4, 2..5, 3..6]);
        // (0, 1), sq = 4, sk = 2: diagonal i − 2, keys i − 2 ..= i − 1; row 0 sees nothing.
        let m = w(Some(0), Some(1)).for_sequence(4, 2);
        assert!(m.key_range(0).is_empty());
        let got: Vec<_> = (1..4).map(|i| m.key_range(i)).collect();
        assert_eq!(got, [0..1, 0..2, 1..2]);
        // (1, unbounded), sq = 2, sk = 4: keys from i + 1 to the end.
        let m = w(Some(1), None).for_sequence(2, 4);
        assert_eq!([m.key_range(0), m.key_range(1)], [1..4, 2..4]);
        // (unbounded, 2), sq = 4, sk = 3: diagonal i − 1, keys ..= i + 1.
        let m = w(None, Some(2)).for_sequence(4, 3);
        let got: Vec<_> = (0..4).map(|i| m.key_range(i)).collect();
        assert_eq!(got, [0..2, 0..3, 0..3, 0..3]);
        // Sides larger than any sequence do not wrap.
        let m = w(Some(usize::MAX), Some(usize::MAX)).for_sequence(3, 2);
        assert_eq!(m.key_range(0), 0..2);
        // Tiles by hand: causal 4 × 4, rows 0..2 × keys 0..2 partial, × keys 2..4 masked,
        // rows 2..4 × keys 0..2 free.
        let m = Mask::Causal.for_sequence(4, 4);
        assert_eq!(m.tile_kind(0..2, 0..2), TileKind::Partial);
        assert_eq!(m.tile_kind(0..2, 2..4), TileKind::Masked);
        assert_eq!(m.tile_kind(2..4, 0..2), TileKind::Free);
        assert_eq!(m.key_blocks(0..2, 2), 0..1);
        assert_eq!(m.key_blocks(2..4, 2), 0..2);
    }

    #[test]
    fn tile_kinds_and_key_blocks_match_brute_force() {
        let masks = [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(3),
                right: Some(0),
            },
            Mask::Window {
                left: Some(0),
                right: Some(2),
            },
            Mask::Window {
                left: None,
                right: Some(5),
            },
            Mask::Window {
                left: Some(7),
                right: None,
            },
            Mask::Window {
                left: Some(0),
                right: Some(0),
            },
        ];
        for mask in masks {
            for (sq, sk) in [(1, 1), (7, 7), (5, 13), (13, 5), (17, 33), (0, 4), (4, 0)] {
                let m = mask.for_sequence(sq, sk);
                for bm in [1, 2, 4, 8] {
                    for bn in [1, 3, 4, 8] {
                        for i0 in (0..sq).step_by(bm) {
                            let rows = i0..(i0 + bm).min(sq);
                            let blocks = m.key_blocks(rows.clone(), bn);
                            for jb in 0..sk.div_ceil(bn) {
                                let keys = jb * bn..((jb + 1) * bn).min(sk);
                                let want = brute(mask, sq, sk, rows.clone(), keys.clone());
                                let got = m.tile_kind(rows.clone(), keys.clone());
                                assert_eq!(got, want, "{mask:?} sq={sq} sk={sk} {rows:?}×{keys:?}");
                                if want != TileKind::Masked {
                                    assert!(blocks.contains(&jb), "{mask:?} {rows:?} block {jb}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn query_ranges_are_the_rows_that_see_each_key() {
        let masks = [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(3),
                right: Some(0),
            },
            Mask::Window {
                left: Some(0),
                right: Some(2),
            },
            Mask::Window {
                left: None,
                right: Some(5),
            },
            Mask::Window {
                left: Some(7),
                right: None,
            },
        ];
        for mask in masks {
            for (sq, sk) in [(1, 1), (7, 7), (5, 13), (13, 5), (0, 4), (4, 0)] {
                let m = mask.for_sequence(sq, sk);
                for j in 0..sk + 2 {
                    let want: Vec<usize> = (0..sq)
                        .filter(|&i| j < sk && crate::cpu::reference::allowed(mask, sq, sk, i, j))
                        .collect();
                    let got: Vec<usize> = m.query_range(j).collect();
                    assert_eq!(got, want, "{mask:?} sq={sq} sk={sk} key {j}");
                }
            }
        }
    }

    #[test]
    fn negative_window_sides_are_rejected() {
        assert!(Mask::window_from_signed(-2, 0).is_err());
        assert_eq!(
            Mask::window_from_signed(-1, 0).unwrap().bounds(),
            Mask::Causal.bounds()
        );
    }
}
