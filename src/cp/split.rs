//! How a sequence is cut into the slices the ranks hold.

use std::ops::Range;

use crate::error::{Error, Result};

/// The layout of a sequence over `N` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SplitKind {
    /// `2N` chunks; rank `r` holds chunks `r` and `2N − 1 − r`, so that under a causal mask
    /// every rank holds as many early (cheap) rows as late (expensive) ones. The default.
    #[default]
    Zigzag,
    /// `N` chunks; rank `r` holds chunk `r`. Balanced without a mask only: under a causal mask
    /// the last rank does about `2N − 1` times the work of the first.
    Contiguous,
}

impl std::str::FromStr for SplitKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "zigzag" => Ok(SplitKind::Zigzag),
            "contiguous" => Ok(SplitKind::Contiguous),
            _ => Err(Error::invalid(
                "split",
                format!("expected zigzag or contiguous, got `{s}`"),
            )),
        }
    }
}

impl std::fmt::Display for SplitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SplitKind::Zigzag => "zigzag",
            SplitKind::Contiguous => "contiguous",
        })
    }
}

/// One contiguous run of a rank's rows: global rows `global`, stored from local row
/// `local_start` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Which chunk of the split this is.
    pub chunk: usize,
    /// Rows of the whole sequence.
    pub global: Range<usize>,
    /// Where the piece starts in the rank's local tensor.
    pub local_start: usize,
}

impl Piece {
    /// Rows of the rank's local tensor this piece occupies.
    pub fn local(&self) -> Range<usize> {
        self.local_start..self.local_start + self.global.len()
    }
}

/// A sequence of `len` rows cut over `ranks` ranks.
///
/// Chunk `c` of `C` (`C = 2N` zigzag, `N` contiguous) is rows `⌊c·len/C⌋ .. ⌊(c+1)·len/C⌋`:
/// lengths that do not divide `C` are neither padded nor refused, chunks just differ by at most
/// one row (and may be empty when `len < C`). A rank's local tensor holds its pieces one after
/// the other, in chunk order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Split {
    kind: SplitKind,
    len: usize,
    ranks: usize,
}

impl Split {
    /// `ranks ≥ 1`; `len` may be anything (0 included).
    pub fn new(kind: SplitKind, len: usize, ranks: usize) -> Result<Split> {
        if ranks == 0 {
            return Err(Error::invalid("ranks", "must be at least 1, got 0"));
        }
        if len.checked_mul(2 * ranks).is_none() {
            return Err(Error::invalid("ranks", "seqlen × 2·ranks overflows"));
        }
        Ok(Split { kind, len, ranks })
    }

    /// The layout kind.
    pub fn kind(&self) -> SplitKind {
        self.kind
    }
    /// Rows of the whole sequence.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
    /// Chunks the sequence is cut into.
    pub fn chunks(&self) -> usize {
        match self.kind {
            SplitKind::Zigzag => 2 * self.ranks,
            SplitKind::Contiguous => self.ranks,
        }
    }

    /// Global rows of chunk `c`.
    pub fn chunk(&self, c: usize) -> Range<usize> {
        let n = self.chunks();
        c * self.len / n..(c + 1) * self.len / n
    }

    /// The chunks rank `r` holds, in local order.
    pub fn chunks_of(&self, r: usize) -> Vec<usize> {
        match self.kind {
            SplitKind::Zigzag => vec![r, 2 * self.ranks - 1 - r],
            SplitKind::Contiguous => vec![r],
        }
    }

    /// Rank `r`'s pieces, in local order.
    pub fn pieces(&self, r: usize) -> Vec<Piece> {
        let mut local_start = 0;
        self.chunks_of(r)
            .into_iter()
            .map(|chunk| {
                let global = self.chunk(chunk);
                let p = Piece {
                    chunk,
                    global: global.clone(),
                    local_start,
                };
                local_start += global.len();
                p
            })
            .collect()
    }

    /// Rows rank `r` holds.
    pub fn local_len(&self, r: usize) -> usize {
        self.chunks_of(r)
            .into_iter()
            .map(|c| self.chunk(c).len())
            .sum()
    }

    /// The largest [`Split::local_len`] over the ranks (the size of a receive buffer).
    pub fn max_local_len(&self) -> usize {
        (0..self.ranks)
            .map(|r| self.local_len(r))
            .max()
            .unwrap_or(0)
    }

    /// The global row of rank `r`'s local row `i`.
    pub fn global_row(&self, r: usize, i: usize) -> usize {
        for p in self.pieces(r) {
            if p.local().contains(&i) {
                return p.global.start + (i - p.local_start);
            }
        }
        panic!(
            "local row {i} is outside rank {r}'s {} rows",
            self.local_len(r)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_belongs_to_exactly_one_rank() {
        for kind in [SplitKind::Zigzag, SplitKind::Contiguous] {
            for ranks in 1..6 {
                for len in [0, 1, 3, 7, 8, 17, 64, 101] {
                    let s = Split::new(kind, len, ranks).unwrap();
                    let mut owner = vec![usize::MAX; len];
                    for r in 0..ranks {
                        for i in 0..s.local_len(r) {
                            let g = s.global_row(r, i);
                            assert_eq!(owner[g], usize::MAX, "{kind} N={ranks} len={len}");
                            owner[g] = r;
                        }
                    }
                    assert!(owner.iter().all(|&o| o != usize::MAX));
                    let lens: Vec<usize> = (0..ranks).map(|r| s.local_len(r)).collect();
                    let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
                    // Chunks differ by at most one row, so ranks by at most two.
                    assert!(hi - lo <= 2, "{kind} N={ranks} len={len}: {lens:?}");
                }
            }
        }
    }

    #[test]
    fn zigzag_pairs_chunk_r_with_its_mirror() {
        let s = Split::new(SplitKind::Zigzag, 16, 2).unwrap();
        let p = s.pieces(0);
        assert_eq!((p[0].global.clone(), p[1].global.clone()), (0..4, 12..16));
        let p = s.pieces(1);
        assert_eq!((p[0].global.clone(), p[1].global.clone()), (4..8, 8..12));
        assert_eq!(p[1].local(), 4..8);
        assert!(Split::new(SplitKind::Zigzag, 16, 0).is_err());
    }
}
