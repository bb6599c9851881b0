//! The CPU twin of the Hopper kernel's tile scheduler (`kernels/sm90/tiles.cuh`): which tiles
//! (query block, head, sequence) each CTA walks, in the kernel's order. The formulas are the
//! header's, line for line; the tests check the walk covers every tile exactly once for the
//! grids the planner launches (one CTA per tile, persistent, varlen), and that the header still
//! holds these formulas, so a change to one without the other fails here.

/// One tile of a launch: a query block of one (sequence, head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TileRef {
    /// Query block (rows `[m_block · block_m, …)` of the sequence).
    pub m_block: usize,
    /// Query head.
    pub head: usize,
    /// Sequence of the batch.
    pub batch: usize,
}

/// A launch of the Hopper kernel as its tile scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk {
    /// CTAs (`gridDim.x`).
    pub grid: usize,
    /// Query blocks per (sequence, head): of the longest sequence.
    pub m_blocks: usize,
    /// Query heads.
    pub heads: usize,
    /// Sequences.
    pub batch: usize,
    /// [`super::Tiles::longest_first`]: query block slowest, last first, plain striding.
    pub longest_first: bool,
}

impl Walk {
    /// Tiles of the launch (`num_tiles`).
    pub fn total(&self) -> usize {
        self.m_blocks * self.heads * self.batch
    }

    /// The number of CTA `cta`'s k-th tile, or `None` when it has none (`tile_number`).
    pub fn tile_number(&self, cta: usize, k: usize) -> Option<usize> {
        let (g, total) = (self.grid, self.total());
        if g >= total {
            return (k == 0).then_some(cta);
        }
        if self.longest_first {
            let t = k * g + cta;
            return (t < total).then_some(t);
        }
        let t = 2 * ((k / 2) * g + cta) + (k & 1);
        (t < total).then_some(t)
    }

    /// Tile number `t` (`tile_at`): query blocks fastest; one CTA per tile runs a head's blocks
    /// last first, a persistent launch in pairs last, first, second last, second, …; longest
    /// first, query blocks slowest, last first.
    pub fn tile_at(&self, t: usize) -> TileRef {
        let mb = self.m_blocks;
        if self.longest_first {
            let hbs = self.heads * self.batch;
            let hb = t % hbs;
            return TileRef {
                m_block: mb - 1 - t / hbs,
                head: hb % self.heads,
                batch: hb / self.heads,
            };
        }
        let (hb, r) = (t / mb, t % mb);
        let paired = self.grid < self.total();
        let m_block = if paired && r & 1 == 1 {
            r / 2
        } else {
            mb - 1 - if paired { r / 2 } else { r }
        };
        TileRef {
            m_block,
            head: hb % self.heads,
            batch: hb / self.heads,
        }
    }

    /// The tiles CTA `cta` runs, in order. `q_blocks(batch)` is a sequence's own query blocks
    /// (a varlen batch's shorter sequences): the kernel skips the tiles past them.
    pub fn cta_tiles(&self, cta: usize, q_blocks: impl Fn(usize) -> usize) -> Vec<TileRef> {
        (0..)
            .map_while(|k| self.tile_number(cta, k))
            .map(|t| self.tile_at(t))
            .filter(|w| w.m_block < q_blocks(w.batch))
            .collect()
    }
}

/// The dynamic schedule ([`super::Tiles::dynamic`]; `claim_tile` and `dynamic_tile_at`): CTA b
/// starts with tile b, then takes the counter's value plus the grid until that passes the last
/// tile; the tiles are numbered query block fastest, a (sequence, head)'s last first, over each
/// sequence's own query blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicWalk {
    /// CTAs (`gridDim.x`), at most [`DynamicWalk::total`].
    pub grid: usize,
    /// Query heads.
    pub heads: usize,
    /// Each sequence's query blocks (a fixed-length batch: the same for all).
    pub q_blocks: Vec<usize>,
}

/// `SeqCursor`: sequence `b`'s tiles are `[first, first + heads · blocks)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    b: usize,
    first: usize,
    blocks: usize,
}

impl DynamicWalk {
    /// Tiles the counter numbers (`Sm90Params::tiles`).
    pub fn total(&self) -> usize {
        self.heads * self.q_blocks.iter().sum::<usize>()
    }

    /// A CTA's cursor before its first tile (`first_cursor`).
    pub fn first_cursor(&self) -> Cursor {
        Cursor {
            b: 0,
            first: 0,
            blocks: self.q_blocks[0],
        }
    }

    /// Tile number `t` (`dynamic_tile_at`, varlen form; a fixed-length batch's equal blocks give
    /// its arithmetic form). The cursor only moves forward: `t` must not fall below its start.
    pub fn tile_at(&self, t: usize, c: &mut Cursor) -> TileRef {
        while t >= c.first + self.heads * c.blocks {
            c.first += self.heads * c.blocks;
            c.b += 1;
            c.blocks = self.q_blocks[c.b];
        }
        let r = t - c.first;
        TileRef {
            m_block: c.blocks - 1 - r % c.blocks,
            head: r / c.blocks,
            batch: c.b,
        }
    }

    /// One claim on the counter (`claim_tile`): the CTA's next tile number or `None`, and the
    /// counter after it (zero again after the launch's last claim).
    pub fn claim(&self, counter: &mut usize) -> Option<usize> {
        let v = *counter;
        *counter = if v == self.total() - 1 { 0 } else { v + 1 };
        let t = v + self.grid;
        (t < self.total()).then_some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::H200;
    use crate::config::sm90::plan;
    use crate::tensor::Layout;
    use crate::{DType, Options, Problem};
    use std::collections::HashSet;

    /// The kernel's scheduler, as text: each formula the twin transcribes must still be there.
    const TILES_CUH: &str = include_str!("../../kernels/sm90/tiles.cuh");

    #[test]
    fn the_twin_transcribes_the_header() {
        for line in [
            "if (g >= total) return k == 0 ? b : -1;",
            "const int t = 2 * ((k / 2) * g + b) + (k & 1);",
            "return t < total ? t : -1;",
            "const int t = k * g + b;",
            "const int hbs = p.heads_q * p.batch;",
            "hb = t % hbs;",
            "w.m0 = (m_blocks(p) - 1 - t / hbs) * BLOCK_M;",
            "const int mb = m_blocks(p), r = t % mb;",
            "hb = t / mb;",
            "const bool paired = static_cast<int>(gridDim.x) < num_tiles(p);",
            "w.m0 = (paired && (r & 1) ? r / 2 : mb - 1 - (paired ? r / 2 : r)) * BLOCK_M;",
            "w.head = hb % p.heads_q;",
            "w.batch = hb / p.heads_q;",
            "w.empty = VARLEN && w.m0 >= w.s.q_len;",
            "return m_blocks(p) * p.heads_q * p.batch;",
            "const int v = static_cast<int>(atomicAdd(&fa4_tile_counter, 1u));",
            "if (v == tiles - 1) atomicExch(&fa4_tile_counter, 0u);",
            "const int t = v + static_cast<int>(gridDim.x);",
            "return t < tiles ? t : -1;",
            "return SeqCursor{0, 0, VARLEN ? seq_q_blocks(p, 0) : 0};",
            "while (t >= c.first + p.heads_q * c.blocks) {",
            "c.first += p.heads_q * c.blocks;",
            "c.blocks = seq_q_blocks(p, ++c.b);",
            "const int r = t - c.first;",
            "return tile_of(p, (c.blocks - 1 - r % c.blocks) * BLOCK_M, r / c.blocks, c.b);",
            "const int mb = m_blocks(p), hb = t / mb;",
            "return tile_of(p, (mb - 1 - t % mb) * BLOCK_M, hb % p.heads_q, hb / p.heads_q);",
        ] {
            assert!(
                TILES_CUH.contains(line),
                "tiles.cuh no longer holds `{line}`"
            );
        }
    }

    /// Walks every CTA of a planned launch; checks each non-empty tile runs exactly once and
    /// no empty one runs, and returns the walk.
    fn walk_covers_once(
        seqs: &[(usize, usize)],
        heads: usize,
        causal: bool,
        varlen: bool,
        longest_first: bool,
    ) {
        let d = 128;
        let opts = if causal {
            Options::new().causal()
        } else {
            Options::new()
        };
        let p = if varlen {
            let tq: usize = seqs.iter().map(|s| s.0).sum();
            let tk: usize = seqs.iter().map(|s| s.1).sum();
            let mut cq = vec![0i32];
            let mut ck = vec![0i32];
            for s in seqs {
                cq.push(cq.last().unwrap() + s.0 as i32);
                ck.push(ck.last().unwrap() + s.1 as i32);
            }
            let lq = Layout::new("q", &[tq, heads, d], None).unwrap();
            let lk = Layout::new("k", &[tk, heads, d], None).unwrap();
            Problem::new(DType::Bf16, &lq, &lk, &lk, &lq, Some(&cq), Some(&ck), &opts).unwrap()
        } else {
            let (sq, sk) = seqs[0];
            let lq = Layout::new("q", &[seqs.len(), sq, heads, d], None).unwrap();
            let lk = Layout::new("k", &[seqs.len(), sk, heads, d], None).unwrap();
            Problem::new(DType::Bf16, &lq, &lk, &lk, &lq, None, None, &opts).unwrap()
        };
        let mut tiles = crate::config::sm90::tiles_for(&H200, d, seqs[0].0, seqs[0].1).unwrap();
        tiles.persistent &= !varlen;
        tiles.longest_first = longest_first;
        let planned = plan(&p, &H200, "sm_90a", None).unwrap();
        let pl = if longest_first {
            plan(&p, &H200, "sm_90a", Some(tiles)).unwrap()
        } else {
            planned
        };
        let block_m = pl.spec.tiles.block_m();
        let longest = seqs.iter().map(|s| s.0).max().unwrap();
        let w = Walk {
            grid: pl.grid.0 as usize,
            m_blocks: longest.div_ceil(block_m),
            heads,
            batch: seqs.len(),
            longest_first,
        };
        // Fewer CTAs than tiles only with the persistent launch (which, with no more tiles than
        // SMs, is one CTA per tile).
        assert!(w.grid == w.total() || (pl.spec.tiles.persistent && w.grid < w.total()));
        let q_blocks = |b: usize| seqs[b].0.div_ceil(block_m);
        let mut seen = HashSet::new();
        for cta in 0..w.grid {
            let tiles = w.cta_tiles(cta, q_blocks);
            // Tile numbers grow within a CTA (the kernel's Q-slot ring relies on it).
            let numbers: Vec<usize> = (0..).map_while(|k| w.tile_number(cta, k)).collect();
            assert!(numbers.windows(2).all(|p| p[0] < p[1]));
            for t in tiles {
                assert!(seen.insert(t), "{t:?} twice ({seqs:?}, grid {})", w.grid);
            }
        }
        let want: HashSet<TileRef> = (0..seqs.len())
            .flat_map(|batch| {
                (0..heads).flat_map(move |head| {
                    (0..q_blocks(batch)).map(move |m_block| TileRef {
                        m_block,
                        head,
                        batch,
                    })
                })
            })
            .collect();
        assert_eq!(seen, want, "{seqs:?} heads {heads}");
    }

    #[test]
    fn every_tile_runs_exactly_once() {
        // One CTA per tile (long sequences), persistent (short ones: the planner picks it),
        // odd block counts (pairs that cross heads), and varlen batches with empty sequences.
        for (seqs, heads, causal, varlen) in [
            (vec![(4096, 4096); 2], 8, true, false),
            (vec![(1024, 1024); 4], 16, false, false),
            (vec![(640, 640); 3], 5, true, false),
            (vec![(128, 200); 1], 1, true, false),
            (
                vec![(300, 100), (0, 5), (1000, 1000), (1, 1)],
                3,
                true,
                true,
            ),
            (vec![(5000, 4000), (17, 3000)], 2, false, true),
        ] {
            for longest_first in [false, true] {
                walk_covers_once(&seqs, heads, causal, varlen, longest_first);
            }
        }
    }

    #[test]
    fn longest_first_rounds_run_one_query_block_heaviest_first() {
        // 8 query blocks × 40 heads × 2 sequences on 132 CTAs: the k-th round holds the tiles
        // k·132 .. (k + 1)·132 of query block 7 − ⌊t / 80⌋, so the blocks never grow along a
        // CTA's walk and the first round is all of the last two blocks' heaviest tiles.
        let w = Walk {
            grid: 132,
            m_blocks: 8,
            heads: 40,
            batch: 2,
            longest_first: true,
        };
        let first: Vec<usize> = (0..132)
            .map(|cta| w.cta_tiles(cta, |_| 8)[0].m_block)
            .collect();
        assert!(first[..80].iter().all(|&m| m == 7) && first[80..].iter().all(|&m| m == 6));
        for cta in 0..w.grid {
            let tiles = w.cta_tiles(cta, |_| 8);
            assert!(
                tiles.windows(2).all(|p| p[0].m_block >= p[1].m_block),
                "{tiles:?}"
            );
        }
    }

    #[test]
    fn persistent_pairs_balance_causal_cost() {
        // Paired: the k-th and (k+1)-th tiles of a CTA (k even) in one head are query blocks
        // m and m_blocks − 1 − m, so each pair's causal cost is the same.
        let w = Walk {
            grid: 132,
            m_blocks: 8,
            heads: 64,
            batch: 2,
            longest_first: false,
        };
        for cta in 0..w.grid {
            let tiles = w.cta_tiles(cta, |_| 8);
            for pair in tiles.chunks(2) {
                if let [a, b] = pair {
                    if (a.head, a.batch) == (b.head, b.batch) {
                        assert_eq!(a.m_block + b.m_block, 7, "{a:?} {b:?}");
                    }
                }
            }
        }
        // One CTA per tile: each head's blocks last first.
        let w = Walk {
            grid: 24,
            m_blocks: 8,
            heads: 3,
            batch: 1,
            longest_first: false,
        };
        let order: Vec<usize> = (0..8).map(|t| w.tile_at(t).m_block).collect();
        assert_eq!(order, [7, 6, 5, 4, 3, 2, 1, 0]);
    }

    /// Runs a dynamic launch with the CTAs' claims interleaved by `pick` (which of the CTAs
    /// still running claims next) and checks: each tile once, every CTA's numbers growing, the
    /// varlen cursor agreeing with the fixed-length arithmetic where the blocks are equal, and
    /// the counter zero at the end, the reset being the launch's last claim.
    fn dynamic_launch(w: &DynamicWalk, mut pick: impl FnMut(usize) -> usize) -> Vec<Vec<TileRef>> {
        let mut counter = 0usize;
        let mut cursors = vec![w.first_cursor(); w.grid];
        let mut last: Vec<Option<usize>> = (0..w.grid).map(Some).collect();
        let mut walks: Vec<Vec<TileRef>> = vec![Vec::new(); w.grid];
        for cta in 0..w.grid {
            walks[cta].push(w.tile_at(cta, &mut cursors[cta]));
        }
        let mut running: Vec<usize> = if w.grid < w.total() {
            (0..w.grid).collect()
        } else {
            Vec::new()
        };
        let mut claims = 0;
        while !running.is_empty() {
            let i = pick(running.len());
            let cta = running[i];
            claims += 1;
            match w.claim(&mut counter) {
                Some(t) => {
                    assert!(Some(t) > last[cta], "CTA {cta}: {t} after {:?}", last[cta]);
                    last[cta] = Some(t);
                    walks[cta].push(w.tile_at(t, &mut cursors[cta]));
                }
                None => {
                    running.swap_remove(i);
                    if !running.is_empty() {
                        assert_ne!(counter, 0, "reset before the last claim");
                    }
                }
            }
        }
        assert_eq!(counter, 0, "the next launch starts at zero");
        if w.grid < w.total() {
            assert_eq!(
                claims,
                w.total(),
                "one claim per tile past the grid and one per CTA"
            );
        }
        let mut seen = HashSet::new();
        for t in walks.iter().flatten() {
            assert!(seen.insert(*t), "{t:?} twice in {w:?}");
        }
        let want: HashSet<TileRef> = w
            .q_blocks
            .iter()
            .enumerate()
            .flat_map(|(batch, &mb)| {
                (0..w.heads).flat_map(move |head| {
                    (0..mb).map(move |m_block| TileRef {
                        m_block,
                        head,
                        batch,
                    })
                })
            })
            .collect();
        assert_eq!(seen, want, "{w:?}");
        walks
    }

    #[test]
    fn the_dynamic_schedule_hands_out_every_tile_once_and_resets_its_counter() {
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut rng = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for (q_blocks, heads, grid) in [
            (vec![31, 0, 3, 1, 17, 0], 4, 132),
            (vec![8; 3], 5, 132),
            (vec![8; 3], 5, 120),
            (vec![2, 1], 3, 9),
            (vec![0, 0, 1], 1, 1),
            (vec![40, 1, 1, 1, 1, 1, 1, 1, 1, 1], 7, 16),
        ] {
            let w = DynamicWalk {
                grid: grid.min(heads * q_blocks.iter().sum::<usize>()),
                heads,
                q_blocks,
            };
            dynamic_launch(&w, &mut rng);
            dynamic_launch(&w, |_| 0);
            dynamic_launch(&w, |n| n - 1);
        }
        // Equal blocks: the cursor gives the fixed-length numbering (`(mb − 1 − t % mb, …)`),
        // a (sequence, head)'s last query block first.
        let w = DynamicWalk {
            grid: 4,
            heads: 3,
            q_blocks: vec![5; 2],
        };
        let mut c = w.first_cursor();
        for t in 0..w.total() {
            let (mb, hb) = (5, t / 5);
            let want = TileRef {
                m_block: mb - 1 - t % mb,
                head: hb % 3,
                batch: hb / 3,
            };
            assert_eq!(w.tile_at(t, &mut c), want);
        }
    }
}
