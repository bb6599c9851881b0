//! The GPU decode kernels over an fp8 e4m3 cache (the kernels' `KV_FP8` variants, planned for a
//! problem made `with_fp8_cache`) against the float64 oracle (`paged::reference::check_fp8`):
//! page sizes 1, 3, 16 and 64 over shuffled tables (NaN bytes in every unused slot), ragged
//! lengths (0, page boundaries, a few blocks), GQA 1/4/8, causal/window/softcap/negative scale,
//! seqlen_q 1 and 4 and varlen queries, forced split counts from 1 past the key blocks, fp16 and
//! bf16 queries at head dims 64/128/256, outputs poisoned with NaN before each call; the heads'
//! magnitudes (and so their scales) spread apart, so a scale applied to the wrong head fails.
//! Also every kernel variant in one process, every finite byte (subnormals included) widened to
//! its value in K and in V, NaN bytes in V where some rows mask the key, the GPU append against
//! the CPU's `paged::append_fp8` byte for byte, and the refusals. Every test
//! is ignored unless run with `--include-ignored`, and fails, not passes, where no GPU works.
//!
//! As tests/cuda_decode.rs, the tests run the variant `FA4_DECODE_VARIANT` names (`auto` when
//! unset), and `bench/device_check.sh DIR decode` runs this binary once per variant;
//! `fp8_runs_the_environments_variant` proves which ran.

use std::collections::BTreeMap;

use cudarc::driver::CudaSlice;
use fa4::config::decode::DecodeTiles;
use fa4::config::decode_gpu::DecodeVariant;
use fa4::cuda::compile::{compile, KernelSource};
use fa4::cuda::decode::DeviceKvScales;
use fa4::cuda::CudaBackend;
use fa4::paged::random::{random_paged, PagedInputs, PagedSpec};
use fa4::paged::{self, quantize_cache, reference, KvScales, PagedCache, PagedKv, PagedOptions};
use fa4::tensor::Layout;
use fa4::{Backend, Element, Error, Options, Tensor, TensorMut, F8E4M3};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("needs a CUDA GPU (run with --include-ignored only where one works): {e}"),
    }
}

fn arg_of(e: Error) -> String {
    match e {
        Error::InvalidArgument { name, .. } => name,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// A random paged problem whose cache is quantized to e4m3 per KV head (amax / 448).
#[derive(Clone)]
struct Fp8Inputs<T> {
    x: PagedInputs<T>,
    k8: Vec<F8E4M3>,
    v8: Vec<F8E4M3>,
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
}

impl<T: Element> Fp8Inputs<T> {
    fn kv(&self) -> PagedKv<'_, F8E4M3> {
        let x = &self.x;
        PagedKv::new(
            Tensor::new(&self.k8, &x.k_shape).unwrap(),
            Tensor::new(&self.v8, &x.v_shape).unwrap(),
            &x.page_table,
            x.max_pages_per_seq,
            &x.seqlens_k,
        )
        .unwrap()
    }
    fn scales(&self) -> KvScales<'_> {
        KvScales {
            k: &self.k_scale,
            v: &self.v_scale,
        }
    }
    fn o_shape(&self) -> Vec<usize> {
        let mut s = self.x.q_shape.clone();
        *s.last_mut().unwrap() = self.x.v_shape[3];
        s
    }
    /// Sets the byte of element `c` of key `j` of sequence `b`, KV head `h` (the test's own
    /// indexing of `[num_pages, page_size, heads_kv, dim]`).
    fn set_byte(&mut self, v: bool, b: usize, j: usize, h: usize, c: usize, byte: u8) {
        let x = &self.x;
        let [_, ps, hkv, dim] = if v { x.v_shape } else { x.k_shape };
        let page = x.page_table[b * x.max_pages_per_seq + j / ps] as usize;
        let at = ((page * ps + j % ps) * hkv + h) * dim + c;
        let cache = if v { &mut self.v8 } else { &mut self.k8 };
        cache[at] = F8E4M3::from_bits(byte);
    }
}

/// [`random_paged`], each KV head's K and V scaled by a factor of its own (1, 3, 5, …) before
/// the quantization, so that the heads' scales differ.
fn fp8_inputs<T: Element>(rng: &mut StdRng, spec: &PagedSpec) -> Fp8Inputs<T> {
    let mut x = random_paged::<T, _>(rng, spec).unwrap();
    let spread = |cache: &mut [T], dim: usize| {
        for (i, e) in cache.iter_mut().enumerate() {
            let h = (i / dim) % spec.heads_kv;
            *e = T::from_f32(e.to_f32() * (1 + 2 * h) as f32);
        }
    };
    spread(&mut x.k_cache, spec.head_dim);
    spread(&mut x.v_cache, spec.head_dim_v);
    let (k8, k_scale) = quantize_cache(&x.k_cache, spec.heads_kv, spec.head_dim);
    let (v8, v_scale) = quantize_cache(&x.v_cache, spec.heads_kv, spec.head_dim_v);
    Fp8Inputs {
        x,
        k8,
        v8,
        k_scale,
        v_scale,
    }
}

/// Runs the GPU (host entry) with `splits` on NaN-poisoned outputs and judges it against the
/// fp8 oracle; returns the splits run.
fn run_and_check<T: Element>(
    cuda: &CudaBackend,
    c: &Fp8Inputs<T>,
    opts: Options,
    splits: Option<usize>,
    what: &str,
) -> usize {
    let x = &c.x;
    let p = x.problem(&opts).unwrap();
    let o_shape = c.o_shape();
    let mut o = vec![T::NAN; o_shape.iter().product()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    let mut popts = PagedOptions::new(opts);
    popts.num_splits = splits;
    let plan = Backend::Cuda(cuda.clone())
        .forward_paged_fp8(
            &Tensor::new(&x.q, &x.q_shape).unwrap(),
            &c.kv(),
            &c.scales(),
            x.cu_seqlens_q.as_deref(),
            &mut TensorMut::new(&mut o, &o_shape).unwrap(),
            Some(&mut lse),
            &popts,
        )
        .unwrap_or_else(|e| panic!("{what} splits {splits:?}: {e}"));
    let r = reference::check_fp8(&p, &x.q, &c.k8, &c.v8, &c.scales(), &o, Some(&lse)).unwrap();
    assert!(r.passed(), "{what} splits {splits:?}: {r}");
    plan.num_splits
}

fn masks() -> Vec<(&'static str, Options)> {
    vec![
        ("none", Options::new()),
        ("causal", Options::new().causal()),
        ("window 5,0", Options::new().window(Some(5), Some(0))),
        (
            "window 170,3 softcap",
            Options::new().window(Some(170), Some(3)).softcap(5.0),
        ),
        ("softcap", Options::new().softcap(2.0)),
        ("negative scale", Options::new().scale(-0.07)),
    ]
}

/// Empty, exactly one and two pages, a page and one key, and a random length of a few blocks.
fn ragged(rng: &mut StdRng, page_size: usize) -> Vec<usize> {
    vec![
        0,
        page_size,
        2 * page_size,
        page_size + 1,
        rng.random_range(1..700),
    ]
}

fn matrix_case<T: Element>(cuda: &CudaBackend, rng: &mut StdRng, spec: &PagedSpec, case: usize) {
    let all = masks();
    let (name, opts) = all[case % all.len()];
    let c = fp8_inputs::<T>(rng, spec);
    let what = format!(
        "{} queries, e4m3 cache, d{} page {} heads {}/{} sq {:?} varlen {} {name}",
        T::DTYPE,
        spec.head_dim,
        spec.page_size,
        spec.heads_q,
        spec.heads_kv,
        spec.seqlens_q,
        spec.varlen
    );
    run_and_check(cuda, &c, opts, None, &what);
    let blocks = spec
        .seqlens_k
        .iter()
        .max()
        .unwrap()
        .div_ceil(DecodeTiles::gpu(spec.head_dim).block_n);
    for s in [1, blocks.div_ceil(2).max(1), blocks + 1] {
        assert_eq!(run_and_check(cuda, &c, opts, Some(s), &what), s);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_cache_matrix_against_the_oracle() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(41);
    let mut case = 0;
    for page_size in [1, 3, 16, 64] {
        for (hq, hkv) in [(2, 2), (8, 2), (8, 1)] {
            for (seqlen_q, varlen) in [(1, false), (4, false), (0, true)] {
                let seqlens_k = ragged(&mut rng, page_size);
                let seqlens_q = if varlen {
                    vec![1, 0, 4, 3, 2]
                } else {
                    vec![seqlen_q; seqlens_k.len()]
                };
                let head_dim = [64, 128, 256][case % 3];
                let spec = PagedSpec {
                    seqlens_q,
                    seqlens_k,
                    heads_q: hq,
                    heads_kv: hkv,
                    head_dim,
                    head_dim_v: head_dim,
                    page_size,
                    varlen,
                };
                if case % 2 == 0 {
                    matrix_case::<bf16>(&cuda, &mut rng, &spec, case);
                } else {
                    matrix_case::<f16>(&cuda, &mut rng, &spec, case);
                }
                case += 1;
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_every_split_count_and_two_row_tiles() {
    // 8 query heads on 1 KV head at seqlen_q 8: 64 packed rows, two tiles of 32 at d128.
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(43);
    let spec = PagedSpec {
        seqlens_q: vec![8, 8, 8],
        seqlens_k: vec![1029, 300, 0],
        heads_q: 8,
        heads_kv: 1,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    };
    let c = fp8_inputs::<bf16>(&mut rng, &spec);
    let blocks = 1029usize.div_ceil(128);
    for s in 1..=blocks + 1 {
        run_and_check(&cuda, &c, Options::new().causal(), Some(s), "causal");
        run_and_check(&cuda, &c, Options::new(), Some(s), "none");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_a_long_decode_splits_and_matches_the_oracle() {
    // The head layout (32/8, d128) at 20k keys in pages of 16: the planner splits.
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(47);
    let spec = PagedSpec {
        seqlens_q: vec![1],
        seqlens_k: vec![20000],
        heads_q: 32,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    };
    let c = fp8_inputs::<bf16>(&mut rng, &spec);
    let s = run_and_check(&cuda, &c, Options::new(), None, "20k");
    assert!(s > 1, "the planner should split one sequence, gave {s}");
}

/// Device buffers of an fp8 problem: queries, the two caches, the scales, NaN-poisoned O and LSE.
struct Device<T> {
    q: CudaSlice<T>,
    k: CudaSlice<F8E4M3>,
    v: CudaSlice<F8E4M3>,
    ks: CudaSlice<f32>,
    vs: CudaSlice<f32>,
    o: CudaSlice<T>,
    lse: CudaSlice<f32>,
}

fn upload_fp8(cuda: &CudaBackend, x: &[F8E4M3]) -> CudaSlice<F8E4M3> {
    cuda.stream().clone_htod(x).unwrap()
}

impl<T: Element> Device<T> {
    fn new(cuda: &CudaBackend, c: &Fp8Inputs<T>, lse_len: usize) -> Device<T> {
        Device {
            q: cuda.upload(&c.x.q).unwrap(),
            k: upload_fp8(cuda, &c.k8),
            v: upload_fp8(cuda, &c.v8),
            ks: cuda.upload(&c.k_scale).unwrap(),
            vs: cuda.upload(&c.v_scale).unwrap(),
            o: cuda
                .upload(&vec![T::NAN; c.o_shape().iter().product()])
                .unwrap(),
            lse: cuda.upload(&vec![f32::NAN; lse_len.max(1)]).unwrap(),
        }
    }
    /// O and LSE poisoned again, so that a call that writes nothing cannot pass on the last
    /// one's output.
    fn poison(&mut self, cuda: &CudaBackend) {
        let (on, ln) = (self.o.len(), self.lse.len());
        self.o = cuda.upload(&vec![T::NAN; on]).unwrap();
        self.lse = cuda.upload(&vec![f32::NAN; ln]).unwrap();
    }
    fn run(
        &mut self,
        cuda: &CudaBackend,
        p: &paged::PagedProblem,
        tables: &mut fa4::cuda::decode::PagedTables,
        splits: Option<usize>,
    ) -> fa4::Result<fa4::config::decode::DecodePlan> {
        cuda.forward_paged_fp8_device(
            p,
            tables,
            &self.q,
            &self.k,
            &self.v,
            &DeviceKvScales {
                k: &self.ks,
                v: &self.vs,
            },
            &mut self.o,
            Some(&mut self.lse),
            splits,
        )
    }
    fn check(
        &self,
        cuda: &CudaBackend,
        c: &Fp8Inputs<T>,
        p: &paged::PagedProblem,
    ) -> fa4::check::Report {
        let oracle = reference::oracle_fp8(p, &c.x.q, &c.k8, &c.v8, &c.scales()).unwrap();
        self.judge(cuda, &oracle, p)
    }
    /// [`Device::check`] with the oracle of `p` computed beforehand.
    fn judge(
        &self,
        cuda: &CudaBackend,
        oracle: &reference::Fp8Oracle<T>,
        p: &paged::PagedProblem,
    ) -> fa4::check::Report {
        let (o, l) = (
            cuda.download(&self.o).unwrap(),
            cuda.download(&self.lse).unwrap(),
        );
        oracle.check(p, &o, Some(&l)).unwrap()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_runs_the_environments_variant() {
    let cuda = gpu();
    let v = DecodeVariant::from_env().unwrap();
    eprintln!("FA4_DECODE_VARIANT: {v}");
    let mut rng = StdRng::seed_from_u64(51);
    let spec = PagedSpec {
        seqlens_q: vec![1, 1, 1, 1],
        seqlens_k: vec![5000, 777, 0, 33],
        heads_q: 32,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    };
    let c = fp8_inputs::<bf16>(&mut rng, &spec);
    let p = c.x.problem(&Options::new()).unwrap();
    let p8 = p.clone().with_fp8_cache();
    let plan = cuda.plan_paged(&p8, None).unwrap();
    assert!(
        plan.spec.fp8 && plan.heads.is_none_or(|h| h.fp8),
        "{plan:?}"
    );
    if !v.auto {
        assert_eq!(plan.variant, v);
        assert_eq!(plan.heads.is_some(), v.heads.is_some(), "{plan:?}");
    }
    let mut tables = cuda.paged_tables(&p8).unwrap();
    let mut d = Device::new(&cuda, &c, p.lse_len());
    for splits in [None, Some(1), Some(3)] {
        let ran = d.run(&cuda, &p8, &mut tables, splits).unwrap();
        let r = d.check(&cuda, &c, &p);
        assert!(
            r.passed(),
            "{v} splits {splits:?} ({}): {r}",
            ran.num_splits
        );
        d.poison(&cuda);
    }
}

/// Every variant on one set of device tables (switched with `set_variant`), against the oracle:
/// the layout with ragged lengths, plain and causal speculative decode, the planner's
/// and forced split counts; then a GQA-1 d256 case over pages of 3 and a d64 one over pages of 1.
/// The oracle of each problem is computed once for its 36 runs (the first case's takes 7–10 s on
/// 2 CPU cores), and the kernels (69 on Hopper, about 1 s of NVRTC each) are compiled up front
/// in parallel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_every_variant_matches_the_oracle_in_one_process() {
    let cuda = gpu();
    let hopper = !cuda.info().target.starts_with("sm_8");
    let mut variants = vec![
        "auto",
        "plain",
        "best",
        "heads",
        "heads4",
        "heads2+best",
        "best+fuse",
        "heads4+fuse",
    ];
    if hopper {
        variants.extend([
            "heads+bulk",
            "heads4+bulk",
            "heads+bulk+best",
            "heads+bulk+best+fuse",
        ]);
    }
    let variants: Vec<DecodeVariant> = variants
        .iter()
        .map(|v| DecodeVariant::parse(v).unwrap())
        .collect();
    let splits = [None, Some(1), Some(5)];
    let mut rng = StdRng::seed_from_u64(53);
    let cases = [
        PagedSpec {
            seqlens_q: vec![4, 4, 4, 4],
            seqlens_k: vec![0, 64, 3001, 9000],
            heads_q: 32,
            heads_kv: 8,
            head_dim: 128,
            head_dim_v: 128,
            page_size: 16,
            varlen: false,
        },
        PagedSpec {
            seqlens_q: vec![1, 1],
            seqlens_k: vec![700, 33],
            heads_q: 4,
            heads_kv: 4,
            head_dim: 256,
            head_dim_v: 256,
            page_size: 3,
            varlen: false,
        },
        PagedSpec {
            seqlens_q: vec![2, 2, 2],
            seqlens_k: vec![1, 400, 129],
            heads_q: 8,
            heads_kv: 2,
            head_dim: 64,
            head_dim_v: 64,
            page_size: 1,
            varlen: false,
        },
    ];
    let masks = [
        Options::new(),
        Options::new().causal(),
        Options::new().window(Some(100), Some(0)).softcap(4.0),
    ];
    let inputs: Vec<Fp8Inputs<bf16>> = cases.iter().map(|s| fp8_inputs(&mut rng, s)).collect();
    let problems: Vec<paged::PagedProblem> = inputs
        .iter()
        .flat_map(|c| masks.iter().map(|o| c.x.problem(o).unwrap()))
        .collect();
    let fp8_problems: Vec<_> = problems
        .iter()
        .map(|p| p.clone().with_fp8_cache())
        .collect();
    compile_ahead(&cuda, &fp8_problems, &variants, &splits);
    for (n, (p, p8)) in problems.iter().zip(&fp8_problems).enumerate() {
        let (i, c) = (n / masks.len(), &inputs[n / masks.len()]);
        let opts = p.options();
        let oracle = reference::oracle_fp8(p, &c.x.q, &c.k8, &c.v8, &c.scales()).unwrap();
        let mut tables = cuda.paged_tables(p8).unwrap();
        let mut d = Device::new(&cuda, c, p.lse_len());
        for &v in &variants {
            tables.set_variant(v);
            for s in splits {
                d.run(&cuda, p8, &mut tables, s)
                    .unwrap_or_else(|e| panic!("case {i} {v} {s:?}: {e}"));
                let r = d.judge(&cuda, &oracle, p);
                assert!(r.passed(), "case {i} {opts:?} {v} splits {s:?}: {r}");
                d.poison(&cuda);
            }
        }
    }
}

/// Compiles the kernels that `variants` × `splits` run on `problems` (the split or all-heads
/// kernel, and the combine where there is one) in parallel, into the disk cache that their
/// launches then read instead of compiling them one at a time.
fn compile_ahead(
    cuda: &CudaBackend,
    problems: &[paged::PagedProblem],
    variants: &[DecodeVariant],
    splits: &[Option<usize>],
) {
    let mut kernels: BTreeMap<String, Box<dyn KernelSource + Send + Sync>> = BTreeMap::new();
    for p in problems {
        for &v in variants {
            for &s in splits {
                let plan = cuda.plan_paged_variant(p, s, v).unwrap();
                match plan.heads {
                    Some(h) => kernels.insert(format!("{h:?}"), Box::new(h)),
                    None => kernels.insert(format!("{:?}", plan.spec), Box::new(plan.spec)),
                };
                if plan.grid.2 > 1 && !plan.fused() {
                    kernels.insert(format!("{:?}", plan.combine), Box::new(plan.combine));
                }
            }
        }
    }
    kernels.par_iter().for_each(|(name, k)| {
        compile(k.as_ref()).unwrap_or_else(|e| panic!("{name}: {e}"));
    });
}

/// Fixed-length sequences of 8 query heads on 2 KV heads, d128, pages of 16 keys.
fn gqa_d128(seqlens_q: Vec<usize>, seqlens_k: Vec<usize>) -> PagedSpec {
    PagedSpec {
        seqlens_q,
        seqlens_k,
        heads_q: 8,
        heads_kv: 2,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    }
}

/// The non-finite rule over an fp8 cache: a NaN byte (S.1111.111) in V at a key that some rows
/// mask reaches exactly the rows that allow it (0·NaN must not leak through a masked P = 0), in
/// a causal speculative decode and a window; a NaN byte in K makes the rows that allow that key
/// NaN. At several split counts and under the all-heads kernel too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_nan_bytes_reach_only_the_rows_that_allow_them() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(57);
    let spec = gqa_d128(vec![4, 4], vec![300, 129]);
    let mut c = fp8_inputs::<bf16>(&mut rng, &spec);
    // Causal bottom-right: key 299 is seen by query row 3 only, key 127 of the second sequence
    // by rows 2 and 3.
    c.set_byte(true, 0, 299, 0, 5, 0x7f);
    c.set_byte(true, 1, 127, 1, 70, 0xff);
    for s in [1, 2, 3] {
        run_and_check(
            &cuda,
            &c,
            Options::new().causal(),
            Some(s),
            "causal NaN in V",
        );
    }
    // Window (5, 0): key 290 of the first sequence is inside no row's window.
    c.set_byte(true, 0, 290, 1, 9, 0x7f);
    run_and_check(
        &cuda,
        &c,
        Options::new().window(Some(5), Some(0)),
        Some(1),
        "window NaN in V",
    );
    // A NaN in K at a key every row allows (no mask): those rows' O and LSE are NaN.
    let mut k = fp8_inputs::<bf16>(&mut rng, &spec);
    k.set_byte(false, 0, 5, 0, 0, 0x7f);
    for s in [1, 3] {
        run_and_check(&cuda, &k, Options::new(), Some(s), "NaN in K");
    }
    // The same under the all-heads kernel (device entry).
    let p = c.x.problem(&Options::new().causal()).unwrap();
    let p8 = p.clone().with_fp8_cache();
    let mut tables = cuda.paged_tables(&p8).unwrap();
    tables.set_variant(DecodeVariant::parse("heads").unwrap());
    let mut d = Device::new(&cuda, &c, p.lse_len());
    for splits in [Some(1), Some(3)] {
        d.run(&cuda, &p8, &mut tables, splits).unwrap();
        let r = d.check(&cuda, &c, &p);
        assert!(r.passed(), "heads, causal NaN in V, splits {splits:?}: {r}");
        d.poison(&cuda);
    }
}

/// One sequence of a key per byte of `bytes`: K holds the byte at dim 0 (0 elsewhere), V at
/// every dim, both scales 1; the query is `lambda` at dim 0. The scores are then the bytes'
/// values times lambda / 8, so a byte widened to the wrong value moves the LSE, and V's bytes are
/// O's only values.
fn byte_case<T: Element>(rng: &mut StdRng, bytes: &[u8], lambda: f32) -> Fp8Inputs<T> {
    let spec = PagedSpec {
        seqlens_q: vec![1],
        seqlens_k: vec![bytes.len()],
        heads_q: 1,
        heads_kv: 1,
        head_dim: 64,
        head_dim_v: 64,
        page_size: 16,
        varlen: false,
    };
    let mut c = fp8_inputs::<T>(rng, &spec);
    for (j, &b) in bytes.iter().enumerate() {
        for dim in 0..64 {
            c.set_byte(false, 0, j, 0, dim, if dim == 0 { b } else { 0 });
            c.set_byte(true, 0, j, 0, dim, b);
        }
    }
    for (i, q) in c.x.q.iter_mut().enumerate() {
        *q = T::from_f32(if i % 64 == 0 { lambda } else { 0.0 });
    }
    c.k_scale = vec![1.0];
    c.v_scale = vec![1.0];
    c
}

/// Every finite e4m3 byte widens to its value on the GPU, in K (to the queries' type) and in V
/// (to f16), subnormals included (bytes 0x01..0x07: a flush to zero would equalise their
/// scores and zero O), under the split and the all-heads kernel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_every_byte_widens_to_its_value() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(71);
    let subnormal: Vec<u8> = (0u8..8).chain(0x80..0x88).collect();
    let normal: Vec<u8> = (0u8..=255)
        .filter(|&b| b & 0x78 != 0 && b & 0x7f != 0x7f)
        .collect();
    assert_eq!(normal.len(), 238);
    // Subnormal scores in [-4, 4] (2336 · 7/512 / 8); normal ones up to ±8 (448 · 0.143 / 8).
    for (bytes, lambda) in [(&subnormal, 2336.0), (&normal, 0.143)] {
        for bf in [true, false] {
            let what = format!(
                "{} bytes, {} queries",
                bytes.len(),
                if bf { "bf16" } else { "fp16" }
            );
            if bf {
                let c = byte_case::<bf16>(&mut rng, bytes, lambda);
                run_variants(&cuda, &c, &Options::new(), &what);
            } else {
                let c = byte_case::<f16>(&mut rng, bytes, lambda);
                run_variants(&cuda, &c, &Options::new(), &what);
            }
        }
    }
}

/// bf16 queries outside f16's range, and rows of one tile whose magnitudes differ by up to
/// 2^6: Q·Kᵀ runs in f16 on a copy of each query row scaled by a power of two of its own
/// (`kernels/decode/fp8.cuh`), so a row left unscaled flushes to zero (queries of 2^-30) or
/// overflows (2^24), and a factor applied to the wrong row moves its scores by a power of two.
/// Each problem's softmax scale brings the scores back to a few units, where those errors show
/// in O and the LSE. The split and the all-heads kernel, one split and the planner's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_bf16_queries_of_any_magnitude_match_the_oracle() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(83);
    let spec = gqa_d128(vec![2, 2], vec![300, 45]);
    for (mag, scale) in [
        (2f32.powi(-30), 2f32.powi(27)),
        (2f32.powi(24), 2f32.powi(-27)),
        (1.0, 0.088),
    ] {
        let mut c = fp8_inputs::<bf16>(&mut rng, &spec);
        for (i, q) in c.x.q.iter_mut().enumerate() {
            // The four query heads of a KV head at 2^-3, 2^-1, 2^1 and 2^3 times mag.
            let head = (i / spec.head_dim) % spec.heads_q;
            let f = mag * 2f32.powi(2 * (head % 4) as i32 - 3);
            *q = bf16::from_f32(q.to_f32() * f);
        }
        let what = format!("bf16 queries of about {mag:e}, scale {scale:e}");
        run_variants(&cuda, &c, &Options::new().scale(scale), &what);
    }
}

/// The split kernel (`plain`) and the all-heads kernel (`heads`) on one problem under `opts`,
/// one split and the planner's, device entry.
fn run_variants<T: Element>(cuda: &CudaBackend, c: &Fp8Inputs<T>, opts: &Options, what: &str) {
    let p = c.x.problem(opts).unwrap();
    let p8 = p.clone().with_fp8_cache();
    let mut tables = cuda.paged_tables(&p8).unwrap();
    let mut d = Device::new(cuda, c, p.lse_len());
    for v in ["plain", "heads"] {
        tables.set_variant(DecodeVariant::parse(v).unwrap());
        for splits in [Some(1), None] {
            d.run(cuda, &p8, &mut tables, splits).unwrap();
            let r = d.check(cuda, c, &p);
            assert!(r.passed(), "{what} {v} splits {splits:?}: {r}");
            d.poison(cuda);
        }
    }
}

/// New rows spanning e4m3's range after the scale: some past ±448 (they saturate), some below
/// the smallest subnormal (0), the rest across the normal and subnormal ranges.
fn new_rows<T: Element>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            let mag = 2f32.powf(rng.random_range(-20.0..11.0));
            let sign = if rng.random::<bool>() { -1.0 } else { 1.0 };
            T::from_f32(sign * mag)
        })
        .collect()
}

fn append_case<T: Element>(cuda: &CudaBackend, rng: &mut StdRng, page_size: usize) {
    let spec = PagedSpec {
        seqlens_q: vec![1, 1, 1],
        seqlens_k: vec![5, 0, 2 * page_size],
        heads_q: 4,
        heads_kv: 2,
        head_dim: 64,
        head_dim_v: 64,
        page_size,
        varlen: false,
    };
    let c = fp8_inputs::<T>(rng, &spec);
    let x = &c.x;
    let k_l = Layout::new("k_cache", &x.k_shape, None).unwrap();
    let v_l = Layout::new("v_cache", &x.v_shape, None).unwrap();
    let num_pages = x.k_shape[0];
    let batch = 3;
    let max_pages = num_pages.div_ceil(batch) + 8;
    // Each sequence its own pages of the pool (by stride), room for the new rows.
    let mut table = vec![-1i32; batch * max_pages];
    for b in 0..batch {
        for j in 0..max_pages {
            let page = b + batch * j;
            if page < num_pages {
                table[b * max_pages + j] = page as i32;
            }
        }
    }
    let counts = [3usize, 1, page_size + 2];
    let mut seqlens = vec![0i32; batch];
    for b in 0..batch {
        let pages = (0..max_pages)
            .filter(|&j| table[b * max_pages + j] >= 0)
            .count();
        seqlens[b] = ((pages * page_size).saturating_sub(counts[b]) as i32).min(7);
    }
    let cache = PagedCache::new(&k_l, &v_l, &table, max_pages, &seqlens).unwrap();
    let mut cu = vec![0i32];
    for n in counts {
        cu.push(cu.last().unwrap() + n as i32);
    }
    let total = *cu.last().unwrap() as usize;
    let row = spec.heads_kv * spec.head_dim;
    let k_new: Vec<T> = new_rows(rng, total * row);
    let v_new: Vec<T> = new_rows(rng, total * row);
    let (mut k_cpu, mut v_cpu) = (c.k8.clone(), c.v8.clone());
    let want = paged::append_fp8(
        &cache,
        &mut k_cpu,
        &mut v_cpu,
        &k_new,
        &v_new,
        &cu,
        &c.scales(),
    )
    .unwrap();
    let mut dk = upload_fp8(cuda, &c.k8);
    let mut dv = upload_fp8(cuda, &c.v8);
    let (dkn, dvn) = (cuda.upload(&k_new).unwrap(), cuda.upload(&v_new).unwrap());
    let (dks, dvs) = (
        cuda.upload(&c.k_scale).unwrap(),
        cuda.upload(&c.v_scale).unwrap(),
    );
    let scales = DeviceKvScales { k: &dks, v: &dvs };
    let got = cuda
        .append_paged_fp8(&cache, &mut dk, &mut dv, &dkn, &dvn, &cu, &scales)
        .unwrap();
    assert_eq!(got, want);
    let bits = |x: &[F8E4M3]| x.iter().map(|e| e.to_bits()).collect::<Vec<u8>>();
    let what = format!("{} rows, page {page_size}", T::DTYPE);
    let (gk, gv) = (
        cuda.stream().clone_dtoh(&dk).unwrap(),
        cuda.stream().clone_dtoh(&dv).unwrap(),
    );
    // Byte for byte, the untouched slots (NaN bytes in the unused ones) included.
    assert_eq!(bits(&gk), bits(&k_cpu), "{what}: k_cache");
    assert_eq!(bits(&gv), bits(&v_cpu), "{what}: v_cache");
    // Saturated, zero and subnormal bytes were all written.
    let written: Vec<u8> = bits(&k_cpu)
        .into_iter()
        .zip(bits(&c.k8))
        .filter(|(a, b)| a != b)
        .map(|(a, _)| a & 0x7f)
        .collect();
    assert!(
        written.contains(&0x7e)
            && written.contains(&0)
            && written.iter().any(|&b| (1..8).contains(&b)),
        "{what}"
    );
    // The host validation is the CPU's: a page missing from the table, nothing written.
    let mut short = table.clone();
    short[max_pages - 1] = -1;
    short[0] = -1;
    let cache2 = PagedCache::new(&k_l, &v_l, &short, max_pages, &[0, 0, 0]).unwrap();
    let e = cuda
        .append_paged_fp8(&cache2, &mut dk, &mut dv, &dkn, &dvn, &cu, &scales)
        .unwrap_err();
    assert_eq!(arg_of(e), "page_table");
    // Scales of the wrong length are refused by name.
    let one = cuda.upload(&[1.0f32]).unwrap();
    let e = cuda
        .append_paged_fp8(
            &cache,
            &mut dk,
            &mut dv,
            &dkn,
            &dvn,
            &cu,
            &DeviceKvScales { k: &one, v: &dvs },
        )
        .unwrap_err();
    assert_eq!(arg_of(e), "k_scale");
    assert_eq!(
        bits(&cuda.stream().clone_dtoh(&dk).unwrap()),
        bits(&k_cpu),
        "{what}: a refused append wrote"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_gpu_fp8_append_writes_what_the_cpu_append_writes() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(61);
    for page_size in [1, 3, 16] {
        append_case::<bf16>(&cuda, &mut rng, page_size);
        append_case::<f16>(&cuda, &mut rng, page_size);
        append_case::<f32>(&cuda, &mut rng, page_size);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_problems_the_kernels_do_not_cover_are_refused_by_name() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(67);
    let mut spec = PagedSpec {
        seqlens_q: vec![1],
        seqlens_k: vec![40],
        heads_q: 2,
        heads_kv: 1,
        head_dim: 96,
        head_dim_v: 96,
        page_size: 16,
        varlen: false,
    };
    let refuse = |c: &Fp8Inputs<bf16>| {
        let mut o = vec![bf16::ZERO; c.o_shape().iter().product()];
        Backend::Cuda(cuda.clone())
            .forward_paged_fp8(
                &Tensor::new(&c.x.q, &c.x.q_shape).unwrap(),
                &c.kv(),
                &c.scales(),
                None,
                &mut TensorMut::new(&mut o, &c.o_shape()).unwrap(),
                None,
                &PagedOptions::new(Options::new()),
            )
            .unwrap_err()
    };
    assert_eq!(arg_of(refuse(&fp8_inputs(&mut rng, &spec))), "k_cache");
    spec.head_dim = 64;
    spec.head_dim_v = 64;
    // f32 queries: the GPU kernels take 16-bit ones.
    let c32 = fp8_inputs::<f32>(&mut rng, &spec);
    let mut o = vec![0f32; c32.o_shape().iter().product()];
    let e = Backend::Cuda(cuda.clone())
        .forward_paged_fp8(
            &Tensor::new(&c32.x.q, &c32.x.q_shape).unwrap(),
            &c32.kv(),
            &c32.scales(),
            None,
            &mut TensorMut::new(&mut o, &c32.o_shape()).unwrap(),
            None,
            &PagedOptions::new(Options::new()),
        )
        .unwrap_err();
    assert_eq!(arg_of(e), "dtype");
    // The 16-bit and fp8 device entries refuse each other's problems; scales are counted.
    let c = fp8_inputs::<bf16>(&mut rng, &spec);
    let p = c.x.problem(&Options::new()).unwrap();
    let p8 = p.clone().with_fp8_cache();
    let mut d = Device::new(&cuda, &c, p.lse_len());
    let mut tables = cuda.paged_tables(&p8).unwrap();
    assert_eq!(
        arg_of(d.run(&cuda, &p, &mut tables, None).unwrap_err()),
        "k_cache"
    );
    let (dk16, dv16) = (
        cuda.upload(&c.x.k_cache).unwrap(),
        cuda.upload(&c.x.v_cache).unwrap(),
    );
    let e = cuda
        .forward_paged_device(&p8, &mut tables, &d.q, &dk16, &dv16, &mut d.o, None, None)
        .unwrap_err();
    assert_eq!(arg_of(e), "k_cache");
    let two = cuda.upload(&[1.0f32, 1.0]).unwrap();
    let e = cuda
        .forward_paged_fp8_device(
            &p8,
            &mut tables,
            &d.q,
            &d.k,
            &d.v,
            &DeviceKvScales { k: &d.ks, v: &two },
            &mut d.o,
            None::<&mut CudaSlice<f32>>,
            None,
        )
        .unwrap_err();
    assert_eq!(arg_of(e), "v_scale");
}
