//! The GPU backward (`kernels/bwd/`, and the Hopper main kernel `kernels/bwd_sm90/` forced or
//! by default where it covers the problem) against the float64 gradient oracle under the gradient
//! rule (docs/backward.md): the gradient matrix (masks, GQA/MQA, seqlens 1, 17, block ± 1, sq ≠
//! sk both ways, ragged varlen batches with zero-length sequences, softcap, custom and negative
//! scales, strided views, a NaN key) in fp16 and bf16 at head dims 64, 128 and 256, on
//! NaN-poisoned gradients; the deterministic mode bit for bit; the device-buffer form; bad input.
//! Every test is ignored unless run with `--include-ignored`, and fails, not passes, where no
//! GPU works.

use fa4::check::grad::{check_grads, grad_matrix, run_backward, run_grad_case, GradsView};
use fa4::check::random_fill;
use fa4::cuda::backward::{BwdDeviceInputs, BwdDeviceOutputs};
use fa4::cuda::{CudaBackend, KernelChoice};
use fa4::tensor::Layout;
use fa4::{Backend, BackwardOptions, DType, Element, Error, Mask, Options, Problem};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

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

/// The start of the reason a forced Hopper backward gives for a problem it does not cover
/// (`cuda::backward_sm90`).
const HOPPER_UNCOVERED: &str = "the Hopper backward (sm90 forced) does not cover";

/// The gradient matrix on one backward family (`KernelChoice::Sm80` or `Sm90`, forced). With
/// Sm90, the cases the Hopper kernel does not cover (head_dim_v above head_dim or not a multiple
/// of 8) are errors that say so, and are counted, not run; at least `min_run` cases run.
fn matrix_for(choice: KernelChoice, head_dims: &[usize], min_run: usize) {
    let backend = Backend::Cuda(gpu().with_kernel(choice));
    let cases = grad_matrix(&[DType::F16, DType::Bf16], head_dims);
    let (mut run, mut uncovered, mut failures) = (0, 0, Vec::new());
    for (i, case) in cases.iter().enumerate() {
        let result = run_grad_case(&backend, case, 1000 + i as u64);
        if let Err(Error::InvalidArgument { reason, .. }) = &result {
            if choice == KernelChoice::Sm90 && reason.starts_with(HOPPER_UNCOVERED) {
                uncovered += 1;
                continue;
            }
        }
        if case.head_dim_v != case.head_dim
            && (choice != KernelChoice::Sm90 || case.head_dim_v > case.head_dim)
        {
            // The Ampere-class kernels need head_dim_v == head_dim (the Hopper one at most
            // head_dim, checked below with the rest): an error naming `v`.
            match result {
                Err(e) => assert_eq!(arg_of(e), "v", "{case}"),
                Ok(_) => failures.push(format!("{case}: ran with head_dim_v ≠ head_dim")),
            }
            continue;
        }
        run += 1;
        match result {
            Ok(r) if r.passed() => {}
            Ok(r) => failures.push(format!("{case}: {r}")),
            Err(e) => failures.push(format!("{case}: error {e}")),
        }
    }
    eprintln!(
        "{choice:?}: {run} cases run, {uncovered} not covered, {} failed",
        failures.len()
    );
    assert!(run >= min_run, "{run} cases");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// The Ampere-class kernels, forced: on a Hopper GPU the default picks the Hopper kernel where
// it covers the problem.

#[test]
#[ignore = "needs a CUDA GPU"]
fn gradient_matrix_d64_passes_the_rule() {
    matrix_for(KernelChoice::Sm80, &[64], 20);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gradient_matrix_d128_passes_the_rule() {
    matrix_for(KernelChoice::Sm80, &[128], 20);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gradient_matrix_d256_and_odd_head_dims_pass_the_rule() {
    matrix_for(KernelChoice::Sm80, &[256, 40, 96], 20);
}

/// The Hopper kernel, forced, on the matrix's fixed-length cases at d64, d128 and d256 (the
/// shared-keys form; 11 per dtype and head dim: masks, GQA/MQA, sq ≠ sk both ways, block ± 1,
/// softcap, scales, strided views, a NaN key).
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_gradient_matrix_passes_the_rule() {
    matrix_for(KernelChoice::Sm90, &[64, 128, 256], 60);
}

/// The Hopper kernel, forced, at head dims narrower than its tiles (8, 40 in tiles of 64; 80,
/// 96, 112 in tiles of 128; 136, 192, 248 in tiles of 256): the slab maps' zero fill, Sᵀ/dPᵀ
/// over the head dim rounded to 16, the clipped dK/dV stores and the padded dQ accumulator, on
/// the same 11 cases per dtype.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_gradient_matrix_at_narrower_head_dims_passes_the_rule() {
    matrix_for(
        KernelChoice::Sm90,
        &[8, 40, 80, 96, 112, 136, 192, 248],
        160,
    );
}

/// A fixed-length problem with random inputs, its forward on the CPU (O, LSE) and dO.
fn fixed_inputs<T: Element>(
    [b, sq, sk, hq, hk, d]: [usize; 6],
    mask: Mask,
    softcap: Option<f32>,
    seed: u64,
) -> Inputs<T> {
    let ql = Layout::new("q", &[b, sq, hq, d], None).unwrap();
    let kl = Layout::new("k", &[b, sk, hk, d], None).unwrap();
    let mut opts = Options::new().mask(mask);
    if let Some(c) = softcap {
        opts = opts.softcap(c);
    }
    let p = Problem::new(T::DTYPE, &ql, &kl, &kl, &ql, None, None, &opts).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut fill = |n: usize| {
        let mut x = vec![T::from_f32(0.0); n];
        random_fill(&mut rng, &mut x, d, 1.0);
        x
    };
    let (q, k, v, d_out) = (
        fill(b * sq * hq * d),
        fill(b * sk * hk * d),
        fill(b * sk * hk * d),
        fill(b * sq * hq * d),
    );
    let mut o = vec![T::NAN; q.len()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    Backend::Cpu
        .run(&p, &q, &k, &v, &mut o, Some(&mut lse))
        .unwrap();
    Inputs {
        p,
        cu: (Vec::new(), Vec::new()),
        q,
        k,
        v,
        o,
        lse,
        d_out,
    }
}

/// The backward of a fixed-length problem on `backend` into NaN-poisoned gradients.
fn backward_fixed<T: Element>(backend: &Backend, x: &Inputs<T>) -> [Vec<T>; 3] {
    let mut dq = vec![T::NAN; x.q.len()];
    let mut dk = vec![T::NAN; x.k.len()];
    let mut dv = vec![T::NAN; x.v.len()];
    let mut attention = Options::new().mask(x.p.mask()).scale(x.p.scale());
    if let Some(c) = x.p.softcap() {
        attention = attention.softcap(c);
    }
    run_backward(
        backend,
        &x.p,
        None,
        [&x.q, &x.k, &x.v, &x.o],
        &x.lse,
        &x.d_out,
        [&mut dq, &mut dk, &mut dv],
        &BackwardOptions::new(attention),
    )
    .unwrap();
    [dq, dk, dv]
}

/// Problems with many key and query blocks per CTA (the matrix's have at most two): the Hopper
/// kernel's Q/dO ring wraps many times, GQA walks several query heads per CTA, causal and
/// window masks leave partial diagonal blocks, and the lengths are off the block sizes. Both
/// backward families pass the rule on each.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_backward_on_long_problems_passes_the_rule_as_the_ampere_one() {
    let hopper = Backend::Cuda(gpu().with_kernel(KernelChoice::Sm90));
    let ampere = Backend::Cuda(gpu().with_kernel(KernelChoice::Sm80));
    let window = Mask::Window {
        left: Some(200),
        right: Some(50),
    };
    for (shape, mask, cap, bf) in [
        ([2, 700, 650, 4, 2, 128], Mask::Causal, None, true),
        ([1, 1000, 1000, 4, 1, 64], Mask::Causal, None, false),
        ([1, 513, 777, 2, 2, 128], window, Some(10.0), true),
        ([2, 300, 300, 6, 3, 64], Mask::None, None, true),
        ([1, 900, 333, 2, 1, 64], window, None, true),
        ([1, 700, 700, 4, 2, 96], Mask::Causal, None, true),
        ([1, 513, 600, 4, 1, 40], window, Some(10.0), false),
        ([1, 700, 700, 4, 2, 256], Mask::Causal, None, true),
        ([2, 513, 600, 2, 1, 192], window, Some(10.0), false),
        ([1, 300, 900, 2, 2, 256], Mask::None, None, false),
    ] {
        let what = format!("{shape:?} {mask:?} softcap {cap:?}");
        if bf {
            let x = fixed_inputs::<bf16>(shape, mask, cap, shape[1] as u64);
            let h = backward_fixed(&hopper, &x);
            judge(&x, &h, &format!("sm90 {what}"));
            judge(&x, &backward_fixed(&ampere, &x), &format!("sm80 {what}"));
        } else {
            let x = fixed_inputs::<f16>(shape, mask, cap, shape[1] as u64);
            let h = backward_fixed(&hopper, &x);
            judge(&x, &h, &format!("sm90 {what}"));
            judge(&x, &backward_fixed(&ampere, &x), &format!("sm80 {what}"));
        }
    }
}

/// The Hopper backward covers d256 (the shared-keys form), varlen batches and the deterministic
/// mode, by default and forced; what it does not cover (fp8) is an error naming the argument
/// when it is forced.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_backward_refusals_name_the_argument_and_auto_falls_back() {
    let cuda = gpu();
    let forced = cuda.with_kernel(KernelChoice::Sm90);
    let fixed = fixed_inputs::<bf16>([1, 64, 64, 2, 2, 256], Mask::Causal, None, 1);
    let plan = cuda.plan_backward_sm90(&fixed.p, false).unwrap().unwrap();
    assert_eq!((plan.spec.head_dim, plan.spec.block_n()), (256, 64));
    let det = forced.plan_backward_sm90(&fixed.p, true).unwrap().unwrap();
    assert!(det.spec.tiles.deterministic);
    let d128 = fixed_inputs::<bf16>([1, 64, 64, 2, 2, 128], Mask::Causal, None, 1);
    assert!(cuda.plan_backward_sm90(&d128.p, false).unwrap().is_some());
    let det = cuda.plan_backward_sm90(&d128.p, true).unwrap().unwrap();
    assert!(det.spec.tiles.deterministic && det.spec.tiles.producer_regs == 40);
    let varlen = inputs::<bf16>(128, Mask::Causal, None, 2);
    assert!(
        cuda.plan_backward_sm90(&varlen.p, false)
            .unwrap()
            .unwrap()
            .spec
            .varlen
    );
    assert!(cuda.plan_backward_sm90(&varlen.p, true).unwrap().is_some());
    let g = backward(&Backend::Cuda(cuda.clone()), &varlen, false);
    judge(&varlen, &g, "auto on varlen (Hopper)");
    let g = backward(&Backend::Cuda(cuda.clone()), &varlen, true);
    judge(&varlen, &g, "auto on varlen, deterministic (Hopper)");
}

/// The Hopper kernel, forced, on ragged varlen batches (GQA 8/2, a sequence without queries,
/// lengths off the block sizes) at both tile widths and a head dim narrower than each, with
/// each mask and the softcap; the Ampere-class backward on the same inputs passes too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_backward_on_varlen_batches_passes_the_rule() {
    let hopper = Backend::Cuda(gpu().with_kernel(KernelChoice::Sm90));
    let ampere = Backend::Cuda(gpu().with_kernel(KernelChoice::Sm80));
    let window = Mask::Window {
        left: Some(90),
        right: Some(20),
    };
    for (d, mask, cap, bf) in [
        (64, Mask::Causal, None, true),
        (64, window, Some(6.0), false),
        (128, Mask::None, None, false),
        (128, Mask::Causal, Some(8.0), true),
        (40, Mask::Causal, None, true),
        (96, window, None, true),
        (256, Mask::Causal, None, true),
        (192, window, Some(6.0), false),
    ] {
        let what = format!("varlen d{d} {mask:?} softcap {cap:?}");
        if bf {
            let x = inputs::<bf16>(d, mask, cap, 40 + d as u64);
            judge(&x, &backward(&hopper, &x, false), &format!("sm90 {what}"));
            judge(&x, &backward(&ampere, &x, false), &format!("sm80 {what}"));
        } else {
            let x = inputs::<f16>(d, mask, cap, 40 + d as u64);
            judge(&x, &backward(&hopper, &x, false), &format!("sm90 {what}"));
            judge(&x, &backward(&ampere, &x, false), &format!("sm80 {what}"));
        }
    }
}

/// V narrower than Q and K (head_dim_v < head_dim, e.g. 192/128) on the Hopper kernel, forced:
/// ragged varlen GQA batches with each mask and the softcap, in the shared-keys tiles and in the
/// tiles of 128 and 64; the deterministic mode the same bits twice; the default takes the Hopper
/// kernel for them, and the Ampere-class backward refuses them naming `v`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_backward_with_a_narrower_v_passes_the_rule() {
    let cuda = gpu();
    let forced = cuda.with_kernel(KernelChoice::Sm90);
    let hopper = Backend::Cuda(forced.clone());
    let window = Mask::Window {
        left: Some(90),
        right: Some(20),
    };
    for (d, dv, mask, cap, bf) in [
        (192, 128, Mask::Causal, None, true),
        (192, 128, window, Some(6.0), false),
        (256, 128, Mask::None, None, true),
        (128, 64, Mask::Causal, None, true),
        (128, 96, window, Some(6.0), false),
        (64, 32, Mask::None, None, true),
    ] {
        let what = format!("sm90 varlen d{d}/{dv} {mask:?} softcap {cap:?}");
        if bf {
            let x = inputs_v::<bf16>(d, dv, mask, cap, 60 + dv as u64);
            judge(&x, &backward(&hopper, &x, false), &what);
        } else {
            let x = inputs_v::<f16>(d, dv, mask, cap, 60 + dv as u64);
            judge(&x, &backward(&hopper, &x, false), &what);
        }
    }
    for (d, dv, mask) in [
        (192, 128, Mask::Causal),
        (128, 64, window),
        (64, 32, Mask::Causal),
    ] {
        let x = inputs_v::<bf16>(d, dv, mask, None, 90 + d as u64);
        deterministic_twice(
            &hopper,
            &x,
            &format!("sm90 deterministic d{d}/{dv} {mask:?}"),
        );
    }
    let x = inputs_v::<bf16>(192, 128, Mask::Causal, None, 3);
    let plan = forced.plan_backward_sm90(&x.p, false).unwrap().unwrap();
    assert_eq!(
        (plan.spec.dim, plan.spec.dim_v, plan.spec.head_dim),
        (192, 128, 256)
    );
    let refused = |backend: &Backend| try_backward(backend, &x, false).map(drop);
    let ampere = refused(&Backend::Cuda(cuda.with_kernel(KernelChoice::Sm80)));
    assert_eq!(arg_of(ampere.unwrap_err()), "v");
    refused(&Backend::Cuda(cuda.clone())).unwrap();
}

/// A varlen query block that crosses its sequence's end loads the next sequence's rows (the
/// packed maps have no zero fill there): an infinite dO row at the start of the last sequence,
/// inside the block that ends the first one, must leave the first one's gradients finite (the
/// oracle's), as it does in a fixed-length batch. No mask: the row sees every key of its own
/// sequence (a masked pair inside a sequence would meet the infinity as 0 · inf in dV += Pᵀ·dO,
/// in fixed-length batches too: `docs/backward.md`, "Not done yet").
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_varlen_blocks_ignore_the_next_sequences_rows() {
    let hopper = Backend::Cuda(gpu().with_kernel(KernelChoice::Sm90));
    for d in [64, 128, 256] {
        let mut x = inputs::<bf16>(d, Mask::None, None, 77);
        // Packed row 310: row 10 of the last sequence (the second one has no queries), in the
        // first sequence's last query block (rows 256 .. 383 at d64, 256 .. 319 at d128, d256).
        let row = 310 * 8 * d;
        for v in &mut x.d_out[row..row + 8 * d] {
            *v = bf16::INFINITY;
        }
        let g = backward(&hopper, &x, false);
        assert!(
            g[2][..317 * 2 * d].iter().all(|v| v.is_finite()),
            "d{d}: the first sequence's dV met the next sequence's infinite dO"
        );
        judge(
            &x,
            &g,
            &format!("sm90 varlen d{d}, an infinite dO row next door"),
        );
    }
}

/// Small problems on the Hopper backward, for the sanitizers (memcheck, racecheck, synccheck):
/// causal GQA 4/2 at d64, a window with softcap at d128, d40 and d96 (narrower than their
/// tiles), d256 and d192 (the shared-keys form), lengths off the block sizes (two key blocks, the second partial; three query
/// blocks); four small varlen batches, two with V narrower than Q (192/128, 128/64).
#[test]
#[ignore = "needs a CUDA GPU"]
fn small_hopper_problem_for_the_sanitizers() {
    let backend = Backend::Cuda(gpu().with_kernel(KernelChoice::Sm90));
    let x = fixed_inputs::<bf16>([2, 150, 190, 4, 2, 64], Mask::Causal, None, 5);
    judge(&x, &backward_fixed(&backend, &x), "small sm90 d64 causal");
    let window = Mask::Window {
        left: Some(40),
        right: Some(10),
    };
    let x = fixed_inputs::<f16>([1, 150, 190, 2, 1, 128], window, Some(8.0), 6);
    judge(
        &x,
        &backward_fixed(&backend, &x),
        "small sm90 d128 window softcap",
    );
    // Narrower than the tiles: slab maps (d40 in tiles of 64, d96 in tiles of 128).
    let x = fixed_inputs::<bf16>([1, 150, 190, 2, 2, 40], Mask::Causal, None, 7);
    judge(&x, &backward_fixed(&backend, &x), "small sm90 d40 causal");
    let x = fixed_inputs::<f16>([2, 150, 190, 4, 2, 96], window, None, 8);
    judge(&x, &backward_fixed(&backend, &x), "small sm90 d96 window");
    // The shared-keys form (tiles of 256): d256 causal GQA, d192 window with softcap.
    let x = fixed_inputs::<bf16>([1, 150, 190, 4, 2, 256], Mask::Causal, None, 11);
    judge(&x, &backward_fixed(&backend, &x), "small sm90 d256 causal");
    let x = fixed_inputs::<f16>([1, 150, 190, 2, 1, 192], window, Some(8.0), 12);
    judge(
        &x,
        &backward_fixed(&backend, &x),
        "small sm90 d192 window softcap",
    );
    // Varlen: packed maps, a sequence without queries, blocks crossing into the next sequence.
    let cu = (vec![0, 150, 150, 290], vec![0, 190, 200, 330]);
    // V narrower than Q: 192/128 in the shared-keys form, 128/64 in tiles of 128.
    let x = varlen_inputs_v::<bf16>(cu.clone(), (4, 2), (192, 128), Mask::Causal, None, 13);
    judge(
        &x,
        &backward(&backend, &x, false),
        "small sm90 varlen d192/128 causal",
    );
    let x = varlen_inputs_v::<f16>(cu.clone(), (2, 1), (128, 64), window, Some(8.0), 14);
    judge(
        &x,
        &backward(&backend, &x, false),
        "small sm90 varlen d128/64 window softcap",
    );
    let x = varlen_inputs::<bf16>(cu.clone(), (4, 2), 64, Mask::Causal, None, 9);
    judge(
        &x,
        &backward(&backend, &x, false),
        "small sm90 varlen d64 causal",
    );
    let x = varlen_inputs::<f16>(cu, (2, 1), 96, window, Some(8.0), 10);
    judge(
        &x,
        &backward(&backend, &x, false),
        "small sm90 varlen d96 window softcap",
    );
}

/// A GQA 8/2 varlen batch with a zero-length sequence, inputs drawn from `seed`.
struct Inputs<T> {
    p: Problem,
    cu: (Vec<i32>, Vec<i32>),
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    o: Vec<T>,
    lse: Vec<f32>,
    d_out: Vec<T>,
}

fn inputs<T: Element>(d: usize, mask: Mask, softcap: Option<f32>, seed: u64) -> Inputs<T> {
    inputs_v(d, d, mask, softcap, seed)
}

/// [`inputs`] with V (and O, dO) `dv` wide.
fn inputs_v<T: Element>(
    d: usize,
    dv: usize,
    mask: Mask,
    softcap: Option<f32>,
    seed: u64,
) -> Inputs<T> {
    let cu = (vec![0, 300, 300, 813], vec![0, 317, 330, 1030]);
    varlen_inputs_v(cu, (8, 2), (d, dv), mask, softcap, seed)
}

/// A varlen batch of the given offsets and (query, KV) heads, inputs drawn from `seed`, its
/// forward on the CPU (O, LSE) and dO.
fn varlen_inputs<T: Element>(
    cu: (Vec<i32>, Vec<i32>),
    heads: (usize, usize),
    d: usize,
    mask: Mask,
    softcap: Option<f32>,
    seed: u64,
) -> Inputs<T> {
    varlen_inputs_v(cu, heads, (d, d), mask, softcap, seed)
}

/// [`varlen_inputs`] with head dims `(d, dv)` for Q, K and V, O, dO.
fn varlen_inputs_v<T: Element>(
    (cq, ck): (Vec<i32>, Vec<i32>),
    (hq, hk): (usize, usize),
    (d, dv): (usize, usize),
    mask: Mask,
    softcap: Option<f32>,
    seed: u64,
) -> Inputs<T> {
    let (total_q, total_k) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let ql = Layout::new("q", &[total_q, hq, d], None).unwrap();
    let kl = Layout::new("k", &[total_k, hk, d], None).unwrap();
    let vl = Layout::new("v", &[total_k, hk, dv], None).unwrap();
    let ol = Layout::new("out", &[total_q, hq, dv], None).unwrap();
    let mut opts = Options::new().mask(mask);
    if let Some(c) = softcap {
        opts = opts.softcap(c);
    }
    let p = Problem::new(T::DTYPE, &ql, &kl, &vl, &ol, Some(&cq), Some(&ck), &opts).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut fill = |n: usize| {
        let mut x = vec![T::from_f32(0.0); n];
        random_fill(&mut rng, &mut x, d, 1.0);
        x
    };
    let (q, k, v, d_out) = (
        fill(total_q * hq * d),
        fill(total_k * hk * d),
        fill(total_k * hk * dv),
        fill(total_q * hq * dv),
    );
    let mut o = vec![T::NAN; d_out.len()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    Backend::Cpu
        .run(&p, &q, &k, &v, &mut o, Some(&mut lse))
        .unwrap();
    Inputs {
        p,
        cu: (cq, ck),
        q,
        k,
        v,
        o,
        lse,
        d_out,
    }
}

fn backward<T: Element>(backend: &Backend, x: &Inputs<T>, deterministic: bool) -> [Vec<T>; 3] {
    try_backward(backend, x, deterministic).unwrap()
}

/// [`backward`], its error returned.
fn try_backward<T: Element>(
    backend: &Backend,
    x: &Inputs<T>,
    deterministic: bool,
) -> fa4::Result<[Vec<T>; 3]> {
    let mut dq = vec![T::NAN; x.q.len()];
    let mut dk = vec![T::NAN; x.k.len()];
    let mut dv = vec![T::NAN; x.v.len()];
    let opts = BackwardOptions::new(Options::new().mask(x.p.mask())).deterministic(deterministic);
    let opts = BackwardOptions {
        attention: match x.p.softcap() {
            Some(c) => opts.attention.softcap(c),
            None => opts.attention,
        },
        ..opts
    };
    run_backward(
        backend,
        &x.p,
        Some((&x.cu.0, &x.cu.1)),
        [&x.q, &x.k, &x.v, &x.o],
        &x.lse,
        &x.d_out,
        [&mut dq, &mut dk, &mut dv],
        &opts,
    )?;
    Ok([dq, dk, dv])
}

fn judge<T: Element>(x: &Inputs<T>, g: &[Vec<T>; 3], what: &str) {
    let p = &x.p;
    let report = check_grads(
        p,
        &x.q,
        &x.k,
        &x.v,
        &x.o,
        &x.d_out,
        p.o_layout(),
        GradsView {
            dq: (&g[0], p.q_layout()),
            dk: (&g[1], p.k_layout()),
            dv: (&g[2], p.v_layout()),
        },
    );
    assert!(report.passed(), "{what}: {report}");
    eprintln!("{what}: {report}");
}

/// The deterministic backward of `x` twice: the same bits both times, within the rule.
fn deterministic_twice<T: Element>(backend: &Backend, x: &Inputs<T>, what: &str) {
    let a = backward(backend, x, true);
    assert_eq!(
        bits(&a),
        bits(&backward(backend, x, true)),
        "{what}: two runs differ"
    );
    judge(x, &a, what);
}

fn bits<T: Element>(g: &[Vec<T>; 3]) -> Vec<u32> {
    g.iter().flatten().map(|x| x.to_f32().to_bits()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn deterministic_mode_gives_the_same_bits_and_passes_the_rule() {
    let backend = Backend::Cuda(gpu());
    let ampere = Backend::Cuda(gpu().with_kernel(KernelChoice::Sm80));
    for (d, mask, cap) in [
        (128, Mask::Causal, None),
        (64, Mask::None, Some(5.0)),
        (
            256,
            Mask::Window {
                left: Some(100),
                right: Some(30),
            },
            None,
        ),
    ] {
        let x = inputs::<bf16>(d, mask, cap, d as u64);
        let a = backward(&backend, &x, true);
        let b = backward(&backend, &x, true);
        assert_eq!(
            bits(&a),
            bits(&b),
            "d{d} {mask:?}: two deterministic runs differ"
        );
        judge(&x, &a, &format!("deterministic d{d} {mask:?}"));
        let c = backward(&backend, &x, false);
        judge(&x, &c, &format!("atomic d{d} {mask:?}"));
        // dK and dV take no atomics in either mode (the Hopper kernel computes them the same
        // way in both; only the order of dQ's adds differs): the same bits.
        assert_eq!(
            bits(&[a[1].clone(), a[2].clone(), Vec::new()]),
            bits(&[c[1].clone(), c[2].clone(), Vec::new()]),
            "d{d} {mask:?}: dK, dV of the two modes"
        );
        // The Ampere-class deterministic mode passes the rule too.
        judge(
            &x,
            &backward(&ampere, &x, true),
            &format!("sm80 deterministic d{d} {mask:?}"),
        );
    }
    // The Hopper deterministic mode on ragged varlen batches with GQA, at every tile width
    // and narrower head dims, causal and windowed: the same bits twice, within the rule.
    for (d, mask) in [
        (64, Mask::Causal),
        (
            96,
            Mask::Window {
                left: Some(70),
                right: Some(0),
            },
        ),
        (128, Mask::None),
        (192, Mask::Causal),
        (
            256,
            Mask::Window {
                left: Some(40),
                right: Some(90),
            },
        ),
    ] {
        let x = inputs::<bf16>(d, mask, None, 11 + d as u64);
        deterministic_twice(&backend, &x, &format!("deterministic varlen d{d} {mask:?}"));
    }
    let x = inputs::<f16>(128, Mask::Causal, None, 7);
    let a = backward(&backend, &x, true);
    assert_eq!(bits(&a), bits(&backward(&backend, &x, true)), "fp16");
    judge(&x, &a, "deterministic fp16");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_buffers_give_the_host_forms_result_and_bad_buffers_are_named() {
    let cuda = gpu();
    let x = inputs::<bf16>(128, Mask::Causal, None, 3);
    let host = backward(&Backend::Cuda(cuda.clone()), &x, true);
    let p = &x.p;
    let up = |v: &[bf16]| cuda.upload(v).unwrap();
    let (q, k, v, o, d_out) = (up(&x.q), up(&x.k), up(&x.v), up(&x.o), up(&x.d_out));
    let lse = cuda.upload(&x.lse).unwrap();
    let cq = cuda.upload_i32(&x.cu.0).unwrap();
    let ck = cuda.upload_i32(&x.cu.1).unwrap();
    let mut dq = cuda.alloc::<bf16>(x.q.len()).unwrap();
    let mut dk = cuda.alloc::<bf16>(x.k.len()).unwrap();
    let mut dv = cuda.alloc::<bf16>(x.v.len()).unwrap();
    let inputs = BwdDeviceInputs {
        q: &q,
        k: &k,
        v: &v,
        out: &o,
        lse: &lse,
        d_out: &d_out,
        d_out_layout: *p.o_layout(),
        cu_seqlens: Some((&cq, &ck)),
    };
    let mut outputs = BwdDeviceOutputs {
        dq: &mut dq,
        dq_layout: *p.q_layout(),
        dk: &mut dk,
        dk_layout: *p.k_layout(),
        dv: &mut dv,
        dv_layout: *p.v_layout(),
    };
    cuda.backward_device(p, &inputs, &mut outputs, true)
        .unwrap();
    let got = [
        cuda.download(&dq).unwrap(),
        cuda.download(&dk).unwrap(),
        cuda.download(&dv).unwrap(),
    ];
    assert_eq!(bits(&got), bits(&host), "device form vs host form");

    // A gradient buffer too small, a cu_seqlens that is not the problem's: named.
    let mut small = cuda.alloc::<bf16>(x.k.len() - 8).unwrap();
    let mut dq2 = cuda.alloc::<bf16>(x.q.len()).unwrap();
    let mut dv2 = cuda.alloc::<bf16>(x.v.len()).unwrap();
    let mut bad = BwdDeviceOutputs {
        dq: &mut dq2,
        dq_layout: *p.q_layout(),
        dk: &mut small,
        dk_layout: *p.k_layout(),
        dv: &mut dv2,
        dv_layout: *p.v_layout(),
    };
    assert_eq!(
        arg_of(
            cuda.backward_device(p, &inputs, &mut bad, false)
                .unwrap_err()
        ),
        "dk"
    );
    let wrong = cuda.upload_i32(&[0, 300, 301, 813]).unwrap();
    let bad_in = BwdDeviceInputs {
        cu_seqlens: Some((&wrong, &ck)),
        ..inputs
    };
    let mut outputs = BwdDeviceOutputs {
        dq: &mut dq,
        dq_layout: *p.q_layout(),
        dk: &mut dk,
        dk_layout: *p.k_layout(),
        dv: &mut dv,
        dv_layout: *p.v_layout(),
    };
    assert_eq!(
        arg_of(
            cuda.backward_device(p, &bad_in, &mut outputs, false)
                .unwrap_err()
        ),
        "cu_seqlens_q"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unsupported_problems_are_errors_naming_the_argument() {
    let cuda = gpu();
    let plan = |dtype, d: usize, opts: &Options| {
        let l = Layout::new("q", &[1, 64, 2, d], None).unwrap();
        Problem::new(dtype, &l, &l, &l, &l, None, None, opts)
            .and_then(|p| cuda.plan_backward(&p, false).map(drop))
    };
    assert_eq!(
        arg_of(plan(DType::F32, 64, &Options::new()).unwrap_err()),
        "dtype"
    );
    assert_eq!(
        arg_of(plan(DType::Bf16, 512, &Options::new()).unwrap_err()),
        "q"
    );
    assert_eq!(
        arg_of(plan(DType::Bf16, 12, &Options::new()).unwrap_err()),
        "q"
    );
    assert_eq!(
        arg_of(plan(DType::Bf16, 64, &Options::new().scale(0.0)).unwrap_err()),
        "scale"
    );
    plan(DType::Bf16, 64, &Options::new()).unwrap();
}

/// A small problem in both modes, for the sanitizers (memcheck, racecheck, synccheck): causal
/// GQA 4/2 over a varlen batch with a zero-length sequence and lengths off the block sizes, at
/// the three tile widths (run with `FA4_BWD_SM90_CTAS=2`, the CTAs walk several tiles).
#[test]
#[ignore = "needs a CUDA GPU"]
fn small_problem_for_the_sanitizers() {
    let backend = Backend::Cuda(gpu());
    let (cq, ck) = (vec![0, 17, 17, 150], vec![0, 65, 66, 190]);
    for d in [64, 128, 256] {
        let ql = Layout::new("q", &[150, 4, d], None).unwrap();
        let kl = Layout::new("k", &[190, 2, d], None).unwrap();
        let p = Problem::new(
            DType::Bf16,
            &ql,
            &kl,
            &kl,
            &ql,
            Some(&cq),
            Some(&ck),
            &Options::new().causal(),
        )
        .unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        let mut fill = |n: usize| {
            let mut x = vec![bf16::ZERO; n];
            random_fill(&mut rng, &mut x, d, 1.0);
            x
        };
        let (q, k, v, d_out) = (
            fill(150 * 4 * d),
            fill(190 * 2 * d),
            fill(190 * 2 * d),
            fill(150 * 4 * d),
        );
        let mut o = vec![bf16::NAN; q.len()];
        let mut lse = vec![f32::NAN; p.lse_len()];
        Backend::Cpu
            .run(&p, &q, &k, &v, &mut o, Some(&mut lse))
            .unwrap();
        let x = Inputs {
            p,
            cu: (cq.clone(), ck.clone()),
            q,
            k,
            v,
            o,
            lse,
            d_out,
        };
        for det in [false, true] {
            let g = backward(&backend, &x, det);
            judge(&x, &g, &format!("small d{d}, deterministic {det}"));
        }
    }
}
