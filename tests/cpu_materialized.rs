//! The materialised evaluation (`fa4 bench`'s CPU peer) passes the same tolerance rule as the
//! backends, so that its timings are of a correct computation.

use fa4::check::{check, random_qkv};
use fa4::cpu::materialized::{self, Style};
use fa4::tensor::Layout;
use fa4::{Element, Mask, Options, Problem};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Packed [total, heads, dim] when `cu` is given, else [batch, seqlen, heads, dim].
fn layout(name: &str, batch: usize, s: usize, h: usize, d: usize, packed: bool) -> Layout {
    if packed {
        Layout::new(name, &[s, h, d], None).unwrap()
    } else {
        Layout::new(name, &[batch, s, h, d], None).unwrap()
    }
}

#[allow(clippy::too_many_arguments)]
fn case<T: Element>(
    batch: usize,
    sq: usize,
    sk: usize,
    heads: (usize, usize),
    d: usize,
    cu: Option<(&[i32], &[i32])>,
    opts: Options,
    seed: u64,
) {
    let packed = cu.is_some();
    let ql = layout("q", batch, sq, heads.0, d, packed);
    let kl = layout("k", batch, sk, heads.1, d, packed);
    let p = Problem::new(
        T::DTYPE,
        &ql,
        &kl,
        &kl,
        &ql,
        cu.map(|c| c.0),
        cu.map(|c| c.1),
        &opts,
    )
    .unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut q = vec![T::NAN; ql.numel()];
    let mut k = vec![T::NAN; kl.numel()];
    let mut v = vec![T::NAN; kl.numel()];
    random_qkv(&mut rng, &mut q, &mut k, &mut v, d, d);
    let mut o = vec![T::NAN; ql.numel()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    for style in [Style::Candle, Style::Fused] {
        o.fill(T::NAN);
        lse.fill(f32::NAN);
        materialized::forward_with(style, &p, &q, &k, &v, &mut o, Some(&mut lse)).unwrap();
        let report = check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
        assert!(
            report.passed(),
            "{style:?} {} {opts:?} sq={sq} sk={sk} d={d}: {report}",
            T::DTYPE
        );
    }
}

#[test]
fn materialized_passes_the_tolerance_rule() {
    let causal = Options::new().causal();
    case::<f32>(2, 70, 70, (2, 2), 64, None, Options::new(), 1);
    case::<f32>(1, 97, 130, (4, 2), 128, None, causal, 2);
    case::<f32>(1, 40, 17, (3, 1), 80, None, causal, 3);
    let window = Options::new().mask(Mask::Window {
        left: Some(9),
        right: Some(3),
    });
    case::<f32>(1, 63, 129, (2, 2), 32, None, window.softcap(5.0), 4);
    case::<f16>(1, 65, 65, (2, 1), 96, None, causal, 5);
    case::<bf16>(2, 33, 50, (2, 2), 256, None, Options::new(), 6);
    let (cq, ck) = ([0, 5, 5, 69], [0, 7, 10, 75]);
    case::<f32>(1, 69, 75, (4, 1), 64, Some((&cq, &ck)), causal, 7);
}
