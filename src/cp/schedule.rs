//! The ring schedule: at step `t` rank `r` holds the K/V of rank `(r − t) mod N` and computes
//! every (query piece, key piece) product the whole sequence's mask allows.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::mask::{Mask, TileKind};

use super::split::Split;

/// How a product is masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProductKind {
    /// Every (row, key) pair is allowed: no mask.
    Full,
    /// A causal boundary crosses the product (a diagonal block). The product is trimmed to the
    /// rows and keys that take part, and its local mask is the window `(unbounded, right)` in
    /// the bottom-right convention of a `rows × keys` call, which equals the whole sequence's
    /// causal rule on those rows and keys.
    Diagonal {
        /// The window's right side (`0` is plain causal).
        right: usize,
    },
}

impl ProductKind {
    /// The mask a `rows × keys` attention call of this product uses.
    pub fn mask(&self) -> Mask {
        match *self {
            ProductKind::Full => Mask::None,
            ProductKind::Diagonal { right: 0 } => Mask::Causal,
            ProductKind::Diagonal { right } => Mask::Window {
                left: None,
                right: Some(right),
            },
        }
    }
}

/// One attention call of a ring step: query rows of the rank's local Q against keys of the K/V
/// block in hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Product {
    /// Rows of the rank's local Q (and O).
    pub q_local: Range<usize>,
    /// Rows of the K/V block in hand (the source rank's local K/V).
    pub k_local: Range<usize>,
    /// Global query rows (`q_local` shifted; pieces are contiguous).
    pub q_global: Range<usize>,
    /// Global key rows.
    pub k_global: Range<usize>,
    /// Mask of the call.
    pub kind: ProductKind,
}

/// One attention call of a step: one or more products fused (see [`Schedule::calls`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Rows of the rank's local Q (and O).
    pub q_local: Range<usize>,
    /// Rows of the K/V block in hand.
    pub k_local: Range<usize>,
    /// The call's mask, in the bottom-right convention of a `q_local × k_local` problem.
    pub mask: Mask,
}

/// One step of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The rank whose K/V is in hand.
    pub source: usize,
    /// The products of (query piece, key piece) pairs the mask does not skip, one per pair.
    pub products: Vec<Product>,
}

/// Work counts of one rank over all its steps, for the load-balance check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Work {
    /// Chunk-pair products with no mask.
    pub full: usize,
    /// Chunk-pair products crossed by the causal boundary.
    pub diagonal: usize,
    /// Allowed (query row, key) pairs.
    pub pairs: u64,
}

/// The ring schedule of a problem over `N` ranks: `steps[r][t]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    q: Split,
    k: Split,
    mask: Mask,
    steps: Vec<Vec<Step>>,
}

impl Schedule {
    /// The schedule of queries split by `q` and keys by `k` (the same kind and ranks) under
    /// `mask`, which must be no mask or causal (bottom-right aligned to the whole sequence).
    pub fn new(q: Split, k: Split, mask: Mask) -> Result<Schedule> {
        if q.ranks() != k.ranks() || q.kind() != k.kind() {
            return Err(Error::invalid(
                "k",
                format!(
                    "keys split {} over {} ranks, queries {} over {}: both must match",
                    k.kind(),
                    k.ranks(),
                    q.kind(),
                    q.ranks()
                ),
            ));
        }
        match mask {
            Mask::None | Mask::Causal => {}
            Mask::Window { .. } => {
                return Err(Error::invalid(
                    "mask",
                    "context parallelism computes no mask and causal; a local window is not \
                     supported (its diagonal blocks need a left bound the chunk calls cannot \
                     express yet)",
                ))
            }
        }
        let n = q.ranks();
        let (sq, sk) = (q.len(), k.len());
        let m = mask.for_sequence(sq, sk);
        let steps = (0..n)
            .map(|r| {
                (0..n)
                    .map(|t| {
                        let source = (r + n - t) % n;
                        let mut products = Vec::new();
                        for qp in q.pieces(r) {
                            for kp in k.pieces(source) {
                                if qp.global.is_empty() || kp.global.is_empty() {
                                    continue;
                                }
                                if let Some(p) = product(&m, &qp, &kp) {
                                    products.push(p);
                                }
                            }
                        }
                        Step { source, products }
                    })
                    .collect()
            })
            .collect();
        Ok(Schedule { q, k, mask, steps })
    }

    /// Ranks.
    pub fn ranks(&self) -> usize {
        self.q.ranks()
    }
    /// The query split.
    pub fn q_split(&self) -> &Split {
        &self.q
    }
    /// The key split.
    pub fn k_split(&self) -> &Split {
        &self.k
    }
    /// The mask of the whole sequence.
    pub fn mask(&self) -> Mask {
        self.mask
    }
    /// Rank `r`'s step `t`.
    pub fn step(&self, r: usize, t: usize) -> &Step {
        &self.steps[r][t]
    }

    /// The products of rank `r`'s step `t` as attention calls: full products that share their
    /// keys and have adjacent local rows (or share their rows and have adjacent keys) become one
    /// call, so a zigzag step after the first is one call instead of two.
    pub fn calls(&self, r: usize, t: usize) -> Vec<Call> {
        let mut out: Vec<Call> = Vec::new();
        for p in &self.steps[r][t].products {
            let c = Call {
                q_local: p.q_local.clone(),
                k_local: p.k_local.clone(),
                mask: p.kind.mask(),
            };
            let merged = out.iter_mut().any(|a| {
                if a.mask != Mask::None || c.mask != Mask::None {
                    false
                } else if a.k_local == c.k_local && a.q_local.end == c.q_local.start {
                    a.q_local.end = c.q_local.end;
                    true
                } else if a.q_local == c.q_local && a.k_local.end == c.k_local.start {
                    a.k_local.end = c.k_local.end;
                    true
                } else {
                    false
                }
            });
            if !merged {
                out.push(c);
            }
        }
        out
    }

    /// Rank `r`'s work over all steps.
    pub fn work(&self, r: usize) -> Work {
        let (sq, sk) = (self.q.len(), self.k.len());
        let m = self.mask.for_sequence(sq, sk);
        let mut w = Work::default();
        for step in &self.steps[r] {
            for p in &step.products {
                match p.kind {
                    ProductKind::Full => w.full += 1,
                    ProductKind::Diagonal { .. } => w.diagonal += 1,
                }
                w.pairs += p
                    .q_global
                    .clone()
                    .map(|i| {
                        let kr = m.key_range(i);
                        (kr.start.max(p.k_global.start)..kr.end.min(p.k_global.end)).len() as u64
                    })
                    .sum::<u64>();
            }
        }
        w
    }
}

/// The product of a query piece and a key piece, or `None` when the mask allows no pair.
fn product(
    m: &crate::mask::SeqMask,
    qp: &super::split::Piece,
    kp: &super::split::Piece,
) -> Option<Product> {
    let to_product = |rows: Range<usize>, keys: Range<usize>, kind| Product {
        q_local: qp.local_start + (rows.start - qp.global.start)
            ..qp.local_start + (rows.end - qp.global.start),
        k_local: kp.local_start + (keys.start - kp.global.start)
            ..kp.local_start + (keys.end - kp.global.start),
        q_global: rows,
        k_global: keys,
        kind,
    };
    let (rows, keys) = (qp.global.clone(), kp.global.clone());
    match m.tile_kind(rows.clone(), keys.clone()) {
        TileKind::Masked => None,
        TileKind::Free => Some(to_product(rows, keys, ProductKind::Full)),
        TileKind::Partial => {
            // Causal: row i sees keys < hi(i), hi non-decreasing. Trim to the rows that see a
            // key of the piece and the keys some row sees; then the first kept row sees keys
            // j ≤ i0 + D with D = sk − sq, and the call's own bottom-right rule on R rows and
            // C keys is j' ≤ i' + C − R + right, so right = (i0 + D − ks) − (C − R) ≥ 0
            // (C ≤ hi(last) − ks ≤ R + i0 + D − ks).
            let i0 = rows
                .clone()
                .find(|&i| m.key_range(i).end > keys.start)
                .expect("a partial tile has a row that sees a key");
            let hi_last = m.key_range(rows.end - 1).end.min(keys.end);
            let (r_rows, c_keys) = (rows.end - i0, hi_last - keys.start);
            let rows = i0..rows.end;
            let keys = keys.start..hi_last;
            if m.tile_kind(rows.clone(), keys.clone()) == TileKind::Free {
                return Some(to_product(rows, keys, ProductKind::Full));
            }
            let d = m.key_range(i0).end as i64 - 1 - i0 as i64; // the diagonal's offset D here
            let right = (i0 as i64 + d - keys.start as i64) - (c_keys as i64 - r_rows as i64);
            debug_assert!(right >= 0);
            Some(to_product(
                rows,
                keys,
                ProductKind::Diagonal {
                    right: right as usize,
                },
            ))
        }
    }
}

/// Used by the tests: the oracle predicate without the mask module.
#[doc(hidden)]
pub fn reference_allowed(causal: bool, sq: usize, sk: usize, i: usize, j: usize) -> bool {
    i < sq && j < sk && (!causal || j as i64 <= i as i64 + sk as i64 - sq as i64)
}

#[cfg(test)]
mod tests {
    use super::super::split::SplitKind;
    use super::*;

    #[test]
    fn the_local_mask_of_each_product_is_the_global_rule() {
        for kind in [SplitKind::Zigzag, SplitKind::Contiguous] {
            for n in 1..5 {
                for (sq, sk) in [(16, 16), (17, 17), (5, 23), (23, 5), (3, 3), (1, 9)] {
                    for causal in [false, true] {
                        let mask = if causal { Mask::Causal } else { Mask::None };
                        let s = Schedule::new(
                            Split::new(kind, sq, n).unwrap(),
                            Split::new(kind, sk, n).unwrap(),
                            mask,
                        )
                        .unwrap();
                        for r in 0..n {
                            for t in 0..n {
                                for p in &s.step(r, t).products {
                                    let (rr, cc) = (p.q_global.len(), p.k_global.len());
                                    let local = p.kind.mask().for_sequence(rr, cc);
                                    for i in 0..rr {
                                        for j in 0..cc {
                                            let g = reference_allowed(
                                                causal,
                                                sq,
                                                sk,
                                                p.q_global.start + i,
                                                p.k_global.start + j,
                                            );
                                            assert_eq!(
                                                local.allowed(i, j),
                                                g,
                                                "{kind} N={n} {sq}x{sk} r{r} t{t} {p:?} ({i},{j})"
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
