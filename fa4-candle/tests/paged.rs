//! fa4-candle's paged attention on the CPU against candle's own attention over the gathered
//! (contiguous) keys, under the repository's tolerance rule (docs/attention.md): the reference
//! is `softmax(q·kᵀ·scale + mask)·v` evaluated by candle in f64 (and, for 16-bit inputs, in the
//! storage dtype for the error budget). The gather and the mask predicate are this file's own.

use candle::{DType, Device, IndexOp, Tensor, D};
use fa4_candle::{
    attention_paged, attention_paged_with_lse, flash_attn_paged, flash_attn_paged_with_lse,
    AttnOptions,
};

type R<T> = candle::Result<T>;

/// One paged case: a cache of `page_size`-key pages, per-sequence key counts, a query block.
#[derive(Debug, Clone)]
struct Case {
    dtype: DType,
    page_size: usize,
    seqlens_k: Vec<usize>,
    sq: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    num_splits: Option<usize>,
}

fn cases() -> Vec<Case> {
    let c = |dtype, page_size, seqlens_k: &[usize], sq, hq, hkv, causal| Case {
        dtype,
        page_size,
        seqlens_k: seqlens_k.to_vec(),
        sq,
        hq,
        hkv,
        d: 32,
        causal,
        num_splits: None,
    };
    vec![
        c(DType::F32, 1, &[5, 0, 9], 1, 4, 4, false),
        c(DType::F32, 3, &[7, 1, 0, 12], 1, 8, 2, true),
        c(DType::F32, 3, &[10, 4], 4, 4, 1, true),
        c(DType::F32, 16, &[40, 0, 16, 17], 4, 6, 3, true),
        c(DType::F32, 16, &[33, 2], 1, 4, 2, false),
        Case {
            num_splits: Some(3),
            ..c(DType::F32, 16, &[70, 5], 4, 4, 2, true)
        },
        c(DType::F16, 3, &[11, 0, 6], 4, 8, 2, true),
        c(DType::BF16, 16, &[35, 18], 1, 4, 1, false),
        Case {
            d: 64,
            ..c(DType::BF16, 1, &[9, 3], 4, 2, 2, true)
        },
    ]
}

/// A shuffled page table: every page used once, sequences interleaved and reversed, unused
/// entries −1. Returns the table `[batch, max_pages]` and the page count.
fn shuffled_table(seqlens: &[usize], page_size: usize) -> (Vec<i64>, usize, usize) {
    let max_pages = seqlens
        .iter()
        .map(|l| l.div_ceil(page_size))
        .max()
        .unwrap_or(0)
        .max(1);
    let batch = seqlens.len();
    let num_pages = batch * max_pages + 2; // two pages nobody uses
    let mut table = vec![-1i64; batch * max_pages];
    for (b, &len) in seqlens.iter().enumerate() {
        for j in 0..len.div_ceil(page_size) {
            table[b * max_pages + j] = (num_pages - 1 - (j * batch + b)) as i64;
        }
    }
    (table, max_pages, num_pages)
}

fn randn(shape: &[usize], dtype: DType) -> R<Tensor> {
    // Rounded to the storage dtype first: the reference sees exactly what fa4 sees.
    Tensor::randn(0f64, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// Keys of sequence `b` gathered from the cache, `[len, hkv, d]`, by this file's own indexing.
fn gather(cache: &Tensor, table: &[i64], max_pages: usize, b: usize, len: usize) -> R<Tensor> {
    let (np, ps, h, d) = cache.dims4()?;
    let rows: Vec<u32> = (0..len)
        .map(|j| (table[b * max_pages + j / ps] as usize * ps + j % ps) as u32)
        .collect();
    let idx = Tensor::from_vec(rows, len, &Device::Cpu)?;
    cache.reshape((np * ps, h, d))?.index_select(&idx, 0)
}

/// candle's attention for one sequence in `compute`: `q` `[sq, hq, d]`, `k`/`v` `[sk, hkv, d]`
/// → (`[sq, hq, d]`, LSE `[hq, sq]` f64); rows without keys give zeros and `-inf`.
fn candle_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    compute: DType,
) -> R<(Tensor, Tensor)> {
    let (sq, hq, d) = q.dims3()?;
    let (sk, hkv, _) = k.dims3()?;
    if sk == 0 {
        let lse = Tensor::full(f64::NEG_INFINITY, (hq, sq), &Device::Cpu)?;
        return Ok((Tensor::zeros((sq, hq, d), compute, &Device::Cpu)?, lse));
    }
    let group = hq / hkv;
    let heads: Vec<u32> = (0..hq).map(|h| (h / group) as u32).collect();
    let heads = Tensor::from_vec(heads, hq, &Device::Cpu)?;
    let q = q.to_dtype(compute)?.transpose(0, 1)?.contiguous()?; // [hq, sq, d]
    let expand = |t: &Tensor| -> R<Tensor> {
        t.to_dtype(compute)?
            .index_select(&heads, 1)?
            .transpose(0, 1)?
            .contiguous()
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let s = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
    // Bottom-right causal: query i sits at key position i + sk - sq.
    let mask: Vec<f64> = (0..sq)
        .flat_map(|i| {
            (0..sk).map(move |j| {
                if !causal || j + sq <= i + sk {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (sq, sk), &Device::Cpu)?.to_dtype(compute)?;
    let s = s.broadcast_add(&mask)?;
    let m = s.max_keepdim(D::Minus1)?;
    let m = m.eq(f64::NEG_INFINITY)?.where_cond(&m.zeros_like()?, &m)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let empty = sum.eq(0.0)?.to_dtype(compute)?;
    let p = e.broadcast_div(&(&sum + &empty)?)?;
    let o = p.matmul(&v)?.transpose(0, 1)?.contiguous()?;
    let lse = (sum.to_dtype(DType::F64)?.log()? + m.to_dtype(DType::F64)?)?.squeeze(D::Minus1)?;
    Ok((o, lse))
}

fn flat(t: &Tensor) -> R<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Runs one case through `attention_paged_with_lse` on `dev` (inputs made on the CPU; the
/// table and lengths on `index_dev`) and judges O and LSE on the CPU against candle.
fn check(n: usize, c: &Case, dev: &Device, index_dev: &Device) -> R<()> {
    let what = format!("case {n} {c:?}");
    let batch = c.seqlens_k.len();
    let (table, max_pages, num_pages) = shuffled_table(&c.seqlens_k, c.page_size);
    let q = randn(&[batch, c.sq, c.hq, c.d], c.dtype)?;
    let kc = randn(&[num_pages, c.page_size, c.hkv, c.d], c.dtype)?;
    let vc = randn(&[num_pages, c.page_size, c.hkv, c.d], c.dtype)?;
    let pt = Tensor::from_vec(table.clone(), (batch, max_pages), &Device::Cpu)?;
    let lens: Vec<u32> = c.seqlens_k.iter().map(|&l| l as u32).collect();
    let sk = Tensor::from_vec(lens, batch, &Device::Cpu)?;
    let scale = 1.0 / (c.d as f32).sqrt();
    let opts = AttnOptions::new(scale);
    let opts = if c.causal { opts.causal() } else { opts };
    let on = |t: &Tensor| t.to_device(dev);
    let (out, lse) = attention_paged_with_lse(
        &on(&q)?,
        &on(&kc)?,
        &on(&vc)?,
        &pt.to_device(index_dev)?,
        &sk.to_device(index_dev)?,
        &opts,
        c.num_splits,
    )?;
    let (out, lse) = (out.to_device(&Device::Cpu)?, lse.to_device(&Device::Cpu)?);
    assert_eq!(
        out.dims(),
        &[batch, c.sq, c.hq, c.d],
        "{what}: output shape"
    );
    assert_eq!(out.dtype(), c.dtype, "{what}: output dtype");
    assert_eq!(lse.dims(), &[batch, c.hq, c.sq], "{what}: LSE shape");
    for (b, &len) in c.seqlens_k.iter().enumerate() {
        let k = gather(&kc, &table, max_pages, b, len)?;
        let v = gather(&vc, &table, max_pages, b, len)?;
        let qb = q.i(b)?;
        let (o_ref, lse_ref) = candle_attention(&qb, &k, &v, c.causal, DType::F64)?;
        let (o, r) = (flat(&out.i(b)?)?, flat(&o_ref)?);
        let r_max = r.iter().fold(0f64, |a, x| a.max(x.abs()));
        let bound = if c.dtype == DType::F32 {
            2e-5 * r_max.max(1.0)
        } else {
            let (lowp, _) = candle_attention(&qb, &k, &v, c.causal, c.dtype)?;
            let rounded = flat(&o_ref.to_dtype(c.dtype)?)?;
            2.0 * max_abs_diff(&flat(&lowp)?, &r) + max_abs_diff(&rounded, &r)
        };
        for (i, (x, y)) in o.iter().zip(&r).enumerate() {
            assert!(
                (x - y).abs() <= bound,
                "{what}: sequence {b}: O[{i}] = {x}, reference {y}; max error {:.3e} > bound {bound:.3e}",
                max_abs_diff(&o, &r)
            );
        }
        let a = if c.dtype == DType::F32 { 1e-5 } else { 1e-3 };
        for (i, (x, y)) in flat(&lse.i(b)?)?.iter().zip(flat(&lse_ref)?).enumerate() {
            let ok = if y.is_finite() {
                (x - y).abs() <= a + 8e-7 * y.abs()
            } else {
                *x == y
            };
            assert!(ok, "{what}: sequence {b}: LSE[{i}] = {x}, reference {y}");
        }
    }
    Ok(())
}

#[test]
fn paged_matches_candle_attention_on_gathered_keys() -> R<()> {
    for (n, c) in cases().iter().enumerate() {
        check(n, c, &Device::Cpu, &Device::Cpu)?;
    }
    Ok(())
}

/// The 16-bit cases on the GPU, through fa4's paged decode kernels on candle's stream (head
/// dims 64, 128 and 256 there: the cases' 32 becomes 64), with the table and lengths once on
/// the GPU and once on the host. Run with
/// `cargo test --release -p fa4-candle --features cuda --test paged -- --include-ignored`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_paged_matches_candle_attention() -> R<()> {
    let dev = Device::new_cuda(0)?;
    for (n, c) in cases().iter().enumerate() {
        if c.dtype != DType::F32 {
            let c = Case { d: 64, ..c.clone() };
            check(n, &c, &dev, &dev)?;
            check(n, &c, &dev, &Device::Cpu)?;
        }
    }
    Ok(())
}

/// On the GPU, a `q` that starts inside its storage (a view into a fused QKV row) gives what a
/// `q` of its own gives; a cache that starts inside its storage is an error naming it.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_paged_views() -> R<()> {
    let dev = Device::new_cuda(0)?;
    let (batch, hq, hkv, d, page_size) = (2, 4, 2, 64, 16);
    let seqlens = [40usize, 7];
    let (table, max_pages, num_pages) = shuffled_table(&seqlens, page_size);
    let qkv = randn(&[batch, 1, 3 * hq, d], DType::BF16)?.to_device(&dev)?;
    let q_view = qkv.narrow(2, hq, hq)?;
    let q_own = q_view.contiguous()?;
    let pool = randn(&[2, num_pages, page_size, hkv, d], DType::BF16)?.to_device(&dev)?;
    // Caches of their own (`contiguous` and `copy` would keep the view's offset).
    let (kc, vc) = (
        pool.i(0)?.force_contiguous()?,
        pool.i(1)?.force_contiguous()?,
    );
    let pt = Tensor::from_vec(table, (batch, max_pages), &Device::Cpu)?;
    let lens: Vec<u32> = seqlens.iter().map(|&l| l as u32).collect();
    let sk = Tensor::from_vec(lens, batch, &Device::Cpu)?;
    let run = |q: &Tensor, k: &Tensor, v: &Tensor| flash_attn_paged(q, k, v, &pt, &sk, 0.125, true);
    let want = flat(&run(&q_own, &kc, &vc)?)?;
    let got = flat(&run(&q_view, &kc, &vc)?)?;
    assert_eq!(got, want, "q as a view into a fused projection");
    expect_err(
        run(&q_own, &kc, &pool.i(1)?),
        &["flash_attn_paged", "`v_cache`", "starts at element"],
    );
    Ok(())
}

/// The candle-flash-attn-style entries give what the options entry gives, for every integer
/// dtype of the table and lengths, and unused table entries may hold anything.
#[test]
fn entries_and_index_dtypes_agree() -> R<()> {
    let dev = Device::Cpu;
    let (seqlens, ps) = ([6usize, 2], 4);
    let (table, max_pages, num_pages) = shuffled_table(&seqlens, ps);
    let q = randn(&[2, 1, 4, 16], DType::F32)?;
    let kc = randn(&[num_pages, ps, 2, 16], DType::F32)?;
    let vc = randn(&[num_pages, ps, 2, 16], DType::F32)?;
    let opts = AttnOptions::new(0.25).causal();
    let pt = Tensor::from_vec(table.clone(), (2, max_pages), &dev)?;
    let sk = Tensor::from_vec(vec![6i64, 2], 2, &dev)?;
    let want = attention_paged(&q, &kc, &vc, &pt, &sk, &opts, None)?;
    // u32 with u32::MAX in the unused entry, i32 lengths.
    let pt_u32: Vec<u32> = table.iter().map(|&p| p as u32).collect();
    assert!(pt_u32.contains(&u32::MAX));
    let pt_u32 = Tensor::from_vec(pt_u32, (2, max_pages), &dev)?;
    let sk_i32 = Tensor::from_vec(vec![6i32, 2], 2, &dev)?;
    let got = flash_attn_paged(&q, &kc, &vc, &pt_u32, &sk_i32, 0.25, true)?;
    assert_eq!(flat(&got)?, flat(&want)?);
    let (got, lse) = flash_attn_paged_with_lse(&q, &kc, &vc, &pt, &sk, 0.25, true)?;
    assert_eq!(flat(&got)?, flat(&want)?);
    assert_eq!(lse.dims(), &[2, 4, 1]);
    // A forced split count changes the order of the sums only.
    let split = attention_paged(&q, &kc, &vc, &pt, &sk, &opts, Some(2))?;
    assert!(max_abs_diff(&flat(&split)?, &flat(&want)?) < 1e-5);
    Ok(())
}

fn expect_err(r: R<impl std::fmt::Debug>, needles: &[&str]) {
    let msg = match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

#[test]
fn bad_paged_calls_are_errors_naming_the_argument() -> R<()> {
    let dev = Device::Cpu;
    let z = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &dev).unwrap();
    let ints = |v: Vec<i64>, shape: &[usize]| Tensor::from_vec(v, shape, &dev).unwrap();
    // Two sequences of 5 and 3 keys in pages of 4; 4 pages.
    let q = z(&[2, 1, 4, 8], DType::F32);
    let kc = z(&[4, 4, 2, 8], DType::F32);
    let vc = z(&[4, 4, 2, 8], DType::F32);
    let pt = ints(vec![0, 1, 2, -1], &[2, 2]);
    let sk = ints(vec![5, 3], &[2]);
    let f = "flash_attn_paged";
    flash_attn_paged(&q, &kc, &vc, &pt, &sk, 0.5, true)?;

    let call = |q: &Tensor, kc: &Tensor, vc: &Tensor, pt: &Tensor, sk: &Tensor| {
        flash_attn_paged(q, kc, vc, pt, sk, 0.5, true)
    };
    // Ranks.
    expect_err(
        call(&z(&[2, 4, 8], DType::F32), &kc, &vc, &pt, &sk),
        &[f, "`q`", "rank 4"],
    );
    expect_err(
        call(&q, &z(&[16, 2, 8], DType::F32), &vc, &pt, &sk),
        &[f, "`k_cache`"],
    );
    expect_err(
        call(&q, &kc, &z(&[16, 2, 8], DType::F32), &pt, &sk),
        &[f, "`v_cache`"],
    );
    expect_err(
        call(&q, &kc, &vc, &ints(vec![0, 1], &[2]), &sk),
        &[f, "`page_table`", "rank 2"],
    );
    expect_err(
        call(&q, &kc, &vc, &pt, &ints(vec![5, 3], &[1, 2])),
        &[f, "`seqlens_k`"],
    );
    // Dtypes.
    expect_err(
        call(&q.to_dtype(DType::U32)?, &kc, &vc, &pt, &sk),
        &[f, "`q`", "dtype"],
    );
    expect_err(
        call(&q, &kc.to_dtype(DType::F16)?, &vc, &pt, &sk),
        &[f, "`k_cache`"],
    );
    expect_err(
        call(&q, &kc, &vc, &pt.to_dtype(DType::F32)?, &sk),
        &[f, "`page_table`"],
    );
    expect_err(
        call(&q, &kc, &vc, &pt, &sk.to_dtype(DType::F32)?),
        &[f, "`seqlens_k`"],
    );
    // Shapes against each other.
    expect_err(
        call(&q, &kc, &z(&[4, 4, 1, 8], DType::F32), &pt, &sk),
        &[f, "v_cache"],
    );
    expect_err(
        call(&z(&[2, 1, 3, 8], DType::F32), &kc, &vc, &pt, &sk),
        &[f, "heads_q"],
    );
    expect_err(
        call(&z(&[2, 1, 4, 16], DType::F32), &kc, &vc, &pt, &sk),
        &[f, "head_dim"],
    );
    expect_err(
        call(&z(&[3, 1, 4, 8], DType::F32), &kc, &vc, &pt, &sk),
        &[f, "batch"],
    );
    expect_err(
        call(&q, &kc, &vc, &ints(vec![0, 1, 2, -1, 3, 3], &[3, 2]), &sk),
        &[f, "`page_table`", "rows"],
    );
    // Pages out of range, used or not fitting i32; lengths past the table or negative.
    expect_err(
        call(&q, &kc, &vc, &ints(vec![0, 4, 2, -1], &[2, 2]), &sk),
        &[f, "page_table", "[0, 1]"],
    );
    expect_err(
        call(&q, &kc, &vc, &ints(vec![0, 1, -1, 0], &[2, 2]), &sk),
        &[f, "page_table", "[1, 0]"],
    );
    expect_err(
        call(&q, &kc, &vc, &ints(vec![0, 1 << 40, 2, -1], &[2, 2]), &sk),
        &[f, "page_table", "[0, 1]"],
    );
    expect_err(
        call(&q, &kc, &vc, &pt, &ints(vec![5, 9], &[2])),
        &[f, "seqlens_k"],
    );
    expect_err(
        call(&q, &kc, &vc, &pt, &ints(vec![5, -1], &[2])),
        &[f, "seqlens_k", "-1"],
    );
    // Options.
    expect_err(
        flash_attn_paged(&q, &kc, &vc, &pt, &sk, f32::NAN, false),
        &["softmax_scale"],
    );
    let opts = AttnOptions::new(0.5);
    expect_err(
        attention_paged(&q, &kc, &vc, &pt, &sk, &opts, Some(0)),
        &["attention_paged", "num_splits"],
    );
    // Backward through the op is an error, not a zero gradient.
    let qv = candle::Var::from_tensor(&q)?;
    let out = flash_attn_paged(qv.as_tensor(), &kc, &vc, &pt, &sk, 0.5, true)?;
    assert!(out.sum_all()?.backward().is_err());
    Ok(())
}
