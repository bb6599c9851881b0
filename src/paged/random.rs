//! Random paged problems, as a serving engine would hold them: shuffled page tables, ragged
//! lengths, spare pages and stale table entries. Used by `fa4 run --paged`, `fa4 bench
//! --decode` and the tests.
//!
//! Every cache element a correct backend must not read (slots past a sequence's length in its
//! last page, and the spare pages) is NaN, and table entries past the used pages are −1, so a
//! wrong page, slot or length shows up as a NaN in O rather than a small error.

use rand::seq::SliceRandom;
use rand::Rng;

use super::{PagedCache, PagedKv, PagedProblem};
use crate::check::random_fill;
use crate::check::KEY_OUTLIER_SCALE;
use crate::error::{Error, Result};
use crate::problem::Options;
use crate::tensor::{Element, Layout, Tensor};

/// The shape of a random paged problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedSpec {
    /// Query rows of each sequence; with `varlen` false all must be equal.
    pub seqlens_q: Vec<usize>,
    /// Keys of each sequence.
    pub seqlens_k: Vec<usize>,
    /// Query heads.
    pub heads_q: usize,
    /// KV heads.
    pub heads_kv: usize,
    /// Head dim of Q and K.
    pub head_dim: usize,
    /// Head dim of V and O.
    pub head_dim_v: usize,
    /// Keys per page.
    pub page_size: usize,
    /// Packed `[total_q, heads_q, head_dim]` queries with `cu_seqlens_q`.
    pub varlen: bool,
}

/// The host data of a paged problem.
#[derive(Debug, Clone)]
pub struct PagedInputs<T> {
    /// Queries, contiguous in `q_shape`.
    pub q: Vec<T>,
    /// `[batch, seqlen_q, heads_q, head_dim]` or `[total_q, heads_q, head_dim]`.
    pub q_shape: Vec<usize>,
    /// `[num_pages, page_size, heads_kv, head_dim]`.
    pub k_cache: Vec<T>,
    /// `[num_pages, page_size, heads_kv, head_dim_v]`.
    pub v_cache: Vec<T>,
    /// `[num_pages, page_size, heads_kv, head_dim]`.
    pub k_shape: [usize; 4],
    /// `[num_pages, page_size, heads_kv, head_dim_v]`.
    pub v_shape: [usize; 4],
    /// `[batch, max_pages_per_seq]`.
    pub page_table: Vec<i32>,
    /// Entries per table row.
    pub max_pages_per_seq: usize,
    /// `[batch]`.
    pub seqlens_k: Vec<i32>,
    /// `[batch + 1]` when varlen.
    pub cu_seqlens_q: Option<Vec<i32>>,
}

impl<T: Element> PagedInputs<T> {
    /// The validated cache over these inputs.
    pub fn kv(&self) -> Result<PagedKv<'_, T>> {
        PagedKv::new(
            Tensor::with_name("k_cache", &self.k_cache, &self.k_shape, None)?,
            Tensor::with_name("v_cache", &self.v_cache, &self.v_shape, None)?,
            &self.page_table,
            self.max_pages_per_seq,
            &self.seqlens_k,
        )
    }

    /// The validated problem with a contiguous O of Q's shape (with `head_dim_v`).
    pub fn problem(&self, opts: &Options) -> Result<PagedProblem> {
        let cache = PagedCache::new(
            &Layout::new("k_cache", &self.k_shape, None)?,
            &Layout::new("v_cache", &self.v_shape, None)?,
            &self.page_table,
            self.max_pages_per_seq,
            &self.seqlens_k,
        )?;
        let q = Layout::new("q", &self.q_shape, None)?;
        let mut o_shape = self.q_shape.clone();
        *o_shape.last_mut().expect("rank ≥ 3") = self.v_shape[3];
        let o = Layout::new("out", &o_shape, None)?;
        PagedProblem::new(T::DTYPE, &q, &o, &cache, self.cu_seqlens_q.as_deref(), opts)
    }
}

fn to_i32(name: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::invalid(name, format!("{x} exceeds int32")))
}

/// Draws a problem: Q, K and V as [`crate::check::random_qkv`] draws them (standard normal, one
/// key row in 16 scaled up), pages shuffled over a pool with one spare page per sequence, one
/// stale (−1) entry at the end of every table row, and NaN in every cache slot no sequence uses.
pub fn random_paged<T: Element, R: Rng>(rng: &mut R, spec: &PagedSpec) -> Result<PagedInputs<T>> {
    let batch = spec.seqlens_k.len();
    if spec.seqlens_q.len() != batch {
        return Err(Error::invalid(
            "seqlens_q",
            format!("has {} sequences, seqlens_k {batch}", spec.seqlens_q.len()),
        ));
    }
    if spec.page_size == 0 {
        return Err(Error::invalid("--page-size", "must be at least 1"));
    }
    if !spec.varlen && spec.seqlens_q.windows(2).any(|w| w[0] != w[1]) {
        return Err(Error::invalid(
            "seqlens_q",
            "fixed-length queries need equal lengths",
        ));
    }
    let (hq, hkv, d, dv, ps) = (
        spec.heads_q,
        spec.heads_kv,
        spec.head_dim,
        spec.head_dim_v,
        spec.page_size,
    );
    let used: Vec<usize> = spec.seqlens_k.iter().map(|&n| n.div_ceil(ps)).collect();
    let max_pages = used.iter().copied().max().unwrap_or(0) + 1;
    let num_pages = used.iter().sum::<usize>() + batch;
    let mut pool: Vec<usize> = (0..num_pages).collect();
    pool.shuffle(rng);
    let mut page_table = vec![-1i32; batch * max_pages];
    let mut next = 0;
    for b in 0..batch {
        for j in 0..used[b] {
            page_table[b * max_pages + j] = to_i32("--num-pages", pool[next])?;
            next += 1;
        }
    }
    let total_q: usize = spec.seqlens_q.iter().sum();
    let overflow = || Error::invalid("--seqlen-k", "the cache's size overflows usize");
    let row_k = hkv.checked_mul(d).ok_or_else(overflow)?;
    let row_v = hkv.checked_mul(dv).ok_or_else(overflow)?;
    let slots = num_pages.checked_mul(ps).ok_or_else(overflow)?;
    let mut k_cache = vec![T::NAN; slots.checked_mul(row_k).ok_or_else(overflow)?];
    let mut v_cache = vec![T::NAN; slots.checked_mul(row_v).ok_or_else(overflow)?];
    let q_len = total_q
        .checked_mul(hq)
        .and_then(|x| x.checked_mul(d))
        .ok_or_else(|| Error::invalid("--seqlen-q", "Q's size overflows usize"))?;
    let mut q = vec![T::NAN; q_len];
    random_fill(rng, &mut q, d, 1.0);
    // Fill the used slots in sequence order, then scatter them to their pages.
    for (b, &len) in spec.seqlens_k.iter().enumerate() {
        let mut k = vec![T::NAN; len * row_k];
        let mut v = vec![T::NAN; len * row_v];
        random_fill(rng, &mut k, d, KEY_OUTLIER_SCALE);
        random_fill(rng, &mut v, dv, 1.0);
        for j in 0..len {
            let slot = page_table[b * max_pages + j / ps] as usize * ps + j % ps;
            k_cache[slot * row_k..(slot + 1) * row_k]
                .copy_from_slice(&k[j * row_k..(j + 1) * row_k]);
            v_cache[slot * row_v..(slot + 1) * row_v]
                .copy_from_slice(&v[j * row_v..(j + 1) * row_v]);
        }
    }
    let (q_shape, cu_seqlens_q) = if spec.varlen {
        let mut cu = vec![0i32];
        for &n in &spec.seqlens_q {
            cu.push(to_i32(
                "--seqlen-q",
                *cu.last().expect("non-empty") as usize + n,
            )?);
        }
        (vec![total_q, hq, d], Some(cu))
    } else {
        let sq = spec.seqlens_q.first().copied().unwrap_or(0);
        (vec![batch, sq, hq, d], None)
    };
    Ok(PagedInputs {
        q,
        q_shape,
        k_cache,
        v_cache,
        k_shape: [num_pages, ps, hkv, d],
        v_shape: [num_pages, ps, hkv, dv],
        page_table,
        max_pages_per_seq: max_pages,
        seqlens_k: spec
            .seqlens_k
            .iter()
            .map(|&n| to_i32("--seqlen-k", n))
            .collect::<Result<_>>()?,
        cu_seqlens_q,
    })
}
