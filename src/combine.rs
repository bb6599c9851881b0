//! The exact merge of partial attention results computed over disjoint key sets.
//!
//! Split-KV decode, context parallelism and cascade attention all compute one query row's
//! attention in parts: part `s` sees only the keys `K_s` (the `K_s` disjoint, their union the
//! row's allowed keys) and returns its normalised output `O_s` and its log-sum-exp
//! `LSE_s = ln Σ_{j ∈ K_s} exp(x_j)` (natural log, the convention of the whole API; `x_j` the
//! scaled, soft-capped score). The whole row is then exactly
//!
//! ```text
//! LSE = ln Σ_s exp(LSE_s)
//! O   = Σ_s exp(LSE_s − LSE) · O_s
//! ```
//!
//! evaluated stably (the maximum `LSE_s` is subtracted before exponentiating, so LSEs of ±1e4
//! are fine). Edge cases, chosen so that a merge of parts equals the evaluation of the union:
//!
//! - A part with `LSE_s = −inf` saw no allowed key: it contributes nothing, and its `O_s` is not
//!   read (it may hold garbage or NaN). All parts `−inf` (or no parts): `O = 0`, `LSE = −inf`,
//!   the output of a row with no allowed key.
//! - A part with `LSE_s = +inf` (its sum overflowed) dominates: `LSE = +inf` and `O` is the mean
//!   of the `O_s` of the `+inf` parts (the only finite choice; their relative sizes are lost).
//! - A NaN `LSE_s` makes `LSE` and every element of `O` NaN; a NaN in the `O_s` of a
//!   contributing part propagates into those elements of `O`.
//!
//! Two entry points:
//!
//! - [`Partials`] + [`Partials::combine_into`]: many rows at once from the dense layout split
//!   kernels write, `o` `[n_splits][rows][dv]` and `lse` `[n_splits][rows]`, into `out`
//!   `[rows][dv]` and `lse` `[rows]` (rows in parallel).
//! - [`combine_row`]: one row from parts stored anywhere (a slice per part), for callers whose
//!   partials live in their own layouts (context parallelism over devices, cascade attention's
//!   shared-prefix and suffix results).
//!
//! Weights are computed in f64 and O accumulated in f32: the merge adds at most `n_splits`
//! rounding errors of f32 to each element.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Dense partial results of `n_splits` parts over `rows` rows of `dv` values.
///
/// - `o`: `[n_splits][rows][dv]` f32, part `s` row `r` at `(s·rows + r)·dv`
/// - `lse`: `[n_splits][rows]` f32, natural log, part `s` row `r` at `s·rows + r`
#[derive(Debug, Clone, Copy)]
pub struct Partials<'a> {
    o: &'a [f32],
    lse: &'a [f32],
    n_splits: usize,
    rows: usize,
    dv: usize,
}

fn product(name: &str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| Error::invalid(name, format!("shape {dims:?} overflows")))
    })
}

impl<'a> Partials<'a> {
    /// Validates the slices against the shape: `o` must hold `n_splits·rows·dv` elements and
    /// `lse` `n_splits·rows`; `n_splits ≥ 1`, `dv ≥ 1`.
    pub fn new(
        o: &'a [f32],
        lse: &'a [f32],
        n_splits: usize,
        rows: usize,
        dv: usize,
    ) -> Result<Partials<'a>> {
        if n_splits == 0 {
            return Err(Error::invalid("n_splits", "must be at least 1, got 0"));
        }
        if dv == 0 {
            return Err(Error::invalid("dv", "must be at least 1, got 0"));
        }
        let want_o = product("o_parts", &[n_splits, rows, dv])?;
        let want_lse = product("lse_parts", &[n_splits, rows])?;
        if o.len() != want_o {
            return Err(Error::invalid(
                "o_parts",
                format!(
                    "expected {want_o} elements ([n_splits {n_splits}][rows {rows}][dv {dv}]), got {}",
                    o.len()
                ),
            ));
        }
        if lse.len() != want_lse {
            return Err(Error::invalid(
                "lse_parts",
                format!(
                    "expected {want_lse} elements ([n_splits {n_splits}][rows {rows}]), got {}",
                    lse.len()
                ),
            ));
        }
        Ok(Partials {
            o,
            lse,
            n_splits,
            rows,
            dv,
        })
    }

    /// Number of parts.
    pub fn n_splits(&self) -> usize {
        self.n_splits
    }
    /// Rows per part.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Values per row.
    pub fn dv(&self) -> usize {
        self.dv
    }

    /// Merges the parts into `out` `[rows][dv]` and, if given, `lse` `[rows]` (see the module
    /// docs for the formula and the edge cases).
    pub fn combine_into(&self, out: &mut [f32], lse: Option<&mut [f32]>) -> Result<()> {
        let (rows, dv, n) = (self.rows, self.dv, self.n_splits);
        if out.len() != rows * dv {
            return Err(Error::invalid(
                "out",
                format!(
                    "expected {} elements ([rows {rows}][dv {dv}]), got {}",
                    rows * dv,
                    out.len()
                ),
            ));
        }
        if let Some(l) = lse.as_deref() {
            if l.len() != rows {
                return Err(Error::invalid(
                    "lse",
                    format!("expected {rows} elements ([rows]), got {}", l.len()),
                ));
            }
        }
        let row = |r: usize, o_row: &mut [f32]| {
            merge(
                n,
                |s| self.lse[s * rows + r],
                |s| &self.o[(s * rows + r) * dv..(s * rows + r + 1) * dv],
                o_row,
            )
        };
        match lse {
            Some(l) => out
                .par_chunks_mut(dv)
                .zip(l.par_iter_mut())
                .enumerate()
                .for_each(|(r, (o_row, l_row))| *l_row = row(r, o_row)),
            None => out.par_chunks_mut(dv).enumerate().for_each(|(r, o_row)| {
                row(r, o_row);
            }),
        }
        Ok(())
    }
}

/// Merges one row from parts stored anywhere: part `s` has log-sum-exp `lse_parts[s]` and output
/// `o_parts[s]` (each `out.len()` long). Writes `O` into `out` and returns `LSE`. See the module
/// docs for the formula and the edge cases.
pub fn combine_row(lse_parts: &[f32], o_parts: &[&[f32]], out: &mut [f32]) -> Result<f32> {
    if lse_parts.len() != o_parts.len() {
        return Err(Error::invalid(
            "o_parts",
            format!(
                "has {} parts but lse_parts has {}",
                o_parts.len(),
                lse_parts.len()
            ),
        ));
    }
    if let Some((s, o)) = o_parts
        .iter()
        .enumerate()
        .find(|(_, o)| o.len() != out.len())
    {
        return Err(Error::invalid(
            "o_parts",
            format!(
                "part {s} holds {} values but out holds {}",
                o.len(),
                out.len()
            ),
        ));
    }
    Ok(merge(
        lse_parts.len(),
        |s| lse_parts[s],
        |s| o_parts[s],
        out,
    ))
}

/// The merge on trusted shapes: `n` parts, `lse_of(s)`, `o_of(s)` of `out.len()` values.
#[inline]
pub(crate) fn merge<'o>(
    n: usize,
    lse_of: impl Fn(usize) -> f32,
    o_of: impl Fn(usize) -> &'o [f32],
    out: &mut [f32],
) -> f32 {
    let mut max = f32::NEG_INFINITY;
    for s in 0..n {
        let l = lse_of(s);
        if l.is_nan() {
            out.fill(f32::NAN);
            return f32::NAN;
        }
        max = max.max(l);
    }
    out.fill(0.0);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    if max == f32::INFINITY {
        let inf_parts = (0..n).filter(|&s| lse_of(s) == f32::INFINITY).count();
        let w = 1.0 / inf_parts as f32;
        for s in (0..n).filter(|&s| lse_of(s) == f32::INFINITY) {
            axpy(w, o_of(s), out);
        }
        return f32::INFINITY;
    }
    let m = f64::from(max);
    let sum: f64 = (0..n).map(|s| (f64::from(lse_of(s)) - m).exp()).sum();
    // sum ≥ 1 (the maximal part contributes exp(0)), so the log is finite.
    let total = m + sum.ln();
    for s in 0..n {
        let l = lse_of(s);
        if l == f32::NEG_INFINITY {
            continue;
        }
        let w = (f64::from(l) - total).exp() as f32;
        axpy(w, o_of(s), out);
    }
    total as f32
}

#[inline]
fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    for (acc, v) in y.iter_mut().zip(x) {
        *acc += w * v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Direct f64 evaluation of one row over the keys `keys`: (O, LSE), straight from
    /// the definition, sharing nothing with `merge`.
    fn direct(scores: &[f64], values: &[Vec<f64>], keys: &[usize], dv: usize) -> (Vec<f64>, f64) {
        if keys.is_empty() {
            return (vec![0.0; dv], f64::NEG_INFINITY);
        }
        let mx = keys.iter().map(|&j| scores[j]).fold(f64::MIN, f64::max);
        let sum: f64 = keys.iter().map(|&j| (scores[j] - mx).exp()).sum();
        let lse = mx + sum.ln();
        let mut o = vec![0.0; dv];
        for &j in keys {
            let p = (scores[j] - lse).exp();
            for (a, v) in o.iter_mut().zip(&values[j]) {
                *a += p * v;
            }
        }
        (o, lse)
    }

    #[test]
    fn merging_disjoint_key_sets_equals_the_whole_row() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for case in 0..200 {
            let n_keys = rng.random_range(0..64usize);
            let n_splits = rng.random_range(1..9usize);
            let rows = rng.random_range(1..5usize);
            let dv = rng.random_range(1..12usize);
            // Offsets up to ±1e3 would overflow exp() without the max subtraction.
            let offset = [0.0, 1e3, -1e3][case % 3];
            let mut o_parts = vec![0f32; n_splits * rows * dv];
            let mut lse_parts = vec![0f32; n_splits * rows];
            let mut want = Vec::new();
            for r in 0..rows {
                let scores: Vec<f64> = (0..n_keys)
                    .map(|_| offset + rng.random_range(-20.0..20.0))
                    .collect();
                let values: Vec<Vec<f64>> = (0..n_keys)
                    .map(|_| (0..dv).map(|_| rng.random_range(-3.0..3.0)).collect())
                    .collect();
                // Random disjoint assignment of keys to parts; some parts end up empty.
                let owner: Vec<usize> =
                    (0..n_keys).map(|_| rng.random_range(0..n_splits)).collect();
                for s in 0..n_splits {
                    let keys: Vec<usize> = (0..n_keys).filter(|&j| owner[j] == s).collect();
                    let (o, l) = direct(&scores, &values, &keys, dv);
                    let base = (s * rows + r) * dv;
                    for (x, y) in o_parts[base..base + dv].iter_mut().zip(&o) {
                        *x = *y as f32;
                    }
                    lse_parts[s * rows + r] = l as f32;
                }
                let all: Vec<usize> = (0..n_keys).collect();
                want.push(direct(&scores, &values, &all, dv));
            }
            let parts = Partials::new(&o_parts, &lse_parts, n_splits, rows, dv).unwrap();
            let mut out = vec![f32::NAN; rows * dv];
            let mut lse = vec![f32::NAN; rows];
            parts.combine_into(&mut out, Some(&mut lse)).unwrap();
            for (r, (wo, wl)) in want.iter().enumerate() {
                if *wl == f64::NEG_INFINITY {
                    assert_eq!(lse[r], f32::NEG_INFINITY, "case {case} row {r}");
                } else {
                    let tol = 1e-6 * wl.abs().max(1.0);
                    assert!(
                        (f64::from(lse[r]) - wl).abs() <= tol,
                        "case {case} row {r}: lse {} vs {wl}",
                        lse[r]
                    );
                }
                // Each part's LSE is rounded to f32 (an absolute error of |LSE|·2⁻²⁴), which
                // perturbs its weight relatively by as much; values are within ±3.
                let lse_rounding = if wl.is_finite() {
                    2.0 * wl.abs() * f64::from(f32::EPSILON) * 3.0
                } else {
                    0.0
                };
                for c in 0..dv {
                    let got = f64::from(out[r * dv + c]);
                    assert!(
                        (got - wo[c]).abs() <= 1e-5 * (1.0 + wo[c].abs()) + lse_rounding,
                        "case {case} row {r} col {c}: {got} vs {}",
                        wo[c]
                    );
                }
            }
        }
    }

    #[test]
    fn combine_row_agrees_with_the_dense_form() {
        let o0 = [1.0f32, 2.0];
        let o1 = [3.0f32, -4.0];
        let lses = [0.5f32, -1.25];
        let mut a = [0f32; 2];
        let la = combine_row(&lses, &[&o0, &o1], &mut a).unwrap();
        let dense_o = [1.0f32, 2.0, 3.0, -4.0];
        let mut b = [0f32; 2];
        let mut lb = [0f32; 1];
        Partials::new(&dense_o, &lses, 2, 1, 2)
            .unwrap()
            .combine_into(&mut b, Some(&mut lb))
            .unwrap();
        assert_eq!((a, la), (b, lb[0]));
        // By hand: weights e^0.5 and e^-1.25 over their sum.
        let (e0, e1) = (0.5f64.exp(), (-1.25f64).exp());
        let want0 = (e0 * 1.0 + e1 * 3.0) / (e0 + e1);
        assert!((f64::from(a[0]) - want0).abs() < 1e-6);
        assert!((f64::from(la) - (e0 + e1).ln()).abs() < 1e-6);
    }

    #[test]
    fn empty_parts_are_skipped_and_all_empty_gives_zero() {
        let mut out = [7f32; 2];
        // The empty part's O is garbage (NaN) and must not be read.
        let l = combine_row(
            &[f32::NEG_INFINITY, 2.0],
            &[&[f32::NAN, f32::NAN], &[5.0, 6.0]],
            &mut out,
        )
        .unwrap();
        assert_eq!((out, l), ([5.0, 6.0], 2.0));
        let l = combine_row(
            &[f32::NEG_INFINITY, f32::NEG_INFINITY],
            &[&[f32::NAN, 1.0], &[5.0, 6.0]],
            &mut out,
        )
        .unwrap();
        assert_eq!((out, l), ([0.0, 0.0], f32::NEG_INFINITY));
        let l = combine_row(&[], &[], &mut out).unwrap();
        assert_eq!((out, l), ([0.0, 0.0], f32::NEG_INFINITY));
    }

    #[test]
    fn infinite_and_nan_parts() {
        let mut out = [0f32; 2];
        let l = combine_row(
            &[f32::INFINITY, 3.0, f32::INFINITY],
            &[&[1.0, 2.0], &[100.0, 100.0], &[3.0, 4.0]],
            &mut out,
        )
        .unwrap();
        assert_eq!((out, l), ([2.0, 3.0], f32::INFINITY));
        let l = combine_row(&[1.0, f32::NAN], &[&[1.0, 2.0], &[3.0, 4.0]], &mut out).unwrap();
        assert!(l.is_nan() && out.iter().all(|x| x.is_nan()));
        // NaN in a contributing part's O poisons that element only.
        let l = combine_row(&[1.0, 1.0], &[&[f32::NAN, 2.0], &[3.0, 4.0]], &mut out).unwrap();
        assert!(out[0].is_nan());
        assert_eq!(out[1], 3.0);
        assert!((l - (1.0 + 2f32.ln())).abs() < 1e-6);
    }

    #[test]
    fn equal_huge_lses_do_not_overflow() {
        let mut out = [0f32; 1];
        let l = combine_row(&[1e4, 1e4], &[&[2.0], &[4.0]], &mut out).unwrap();
        assert_eq!(out[0], 3.0);
        assert!((f64::from(l) - (1e4 + 2f64.ln())).abs() < 1e-3);
    }

    #[test]
    fn bad_shapes_name_the_argument() {
        let name = |e: Error| match e {
            Error::InvalidArgument { name, .. } => name,
            e => panic!("{e}"),
        };
        assert_eq!(
            name(Partials::new(&[0.0; 4], &[0.0; 2], 0, 2, 2).unwrap_err()),
            "n_splits"
        );
        assert_eq!(
            name(Partials::new(&[0.0; 3], &[0.0; 2], 1, 2, 2).unwrap_err()),
            "o_parts"
        );
        assert_eq!(
            name(Partials::new(&[0.0; 4], &[0.0; 3], 1, 2, 2).unwrap_err()),
            "lse_parts"
        );
        assert_eq!(
            name(Partials::new(&[], &[], usize::MAX, 2, 2).unwrap_err()),
            "o_parts"
        );
        let p = Partials::new(&[0.0; 4], &[0.0; 2], 1, 2, 2).unwrap();
        assert_eq!(
            name(p.combine_into(&mut [0.0; 3], None).unwrap_err()),
            "out"
        );
        assert_eq!(
            name(
                p.combine_into(&mut [0.0; 4], Some(&mut [0.0; 1]))
                    .unwrap_err()
            ),
            "lse"
        );
        assert_eq!(
            name(combine_row(&[0.0], &[], &mut [0.0; 2]).unwrap_err()),
            "o_parts"
        );
        assert_eq!(
            name(combine_row(&[0.0], &[&[1.0]], &mut [0.0; 2]).unwrap_err()),
            "o_parts"
        );
    }
}
