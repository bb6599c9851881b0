//! The candle custom op: candle layouts to an fa4 [`Problem`], and the CPU forward.
//!
//! Everything fa4 validates (head counts, head dims, strides, lengths, scale, softcap) is
//! validated once by [`Problem::new`], whose errors name the argument (`q`, `k`, `v`); this
//! module adds what only the candle side knows (the varlen boundaries as tensors, the LSE
//! hand-back) and turns fa4 errors into candle errors.

use std::sync::{Arc, Mutex};

use candle::backend::BackendStorage;
use candle::op::BackpropOp;
use candle::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

use fa4::problem::Problem;
use fa4::tensor::Layout as Fa4Layout;
use fa4::{Backend, Mask, Options};

use crate::{AttnOptions, Varlen};

/// An fa4 error as a candle error, keeping fa4's message (which names the argument).
pub(crate) fn fa4_err(e: fa4::Error) -> candle::Error {
    candle::Error::Msg(format!("fa4-candle: {e}"))
}

/// The fa4 options of a call, with `softmax_scale` and `softcap` checked (errors name them).
pub(crate) fn fa4_options(opts: &AttnOptions) -> Result<Options> {
    if !opts.softmax_scale.is_finite() {
        candle::bail!(
            "fa4-candle: `softmax_scale` must be finite, got {}",
            opts.softmax_scale
        );
    }
    let mask = match (opts.window_size_left, opts.window_size_right) {
        (None, None) => Mask::None,
        (None, Some(0)) => Mask::Causal,
        (left, right) => Mask::Window { left, right },
    };
    let mut o = Options::new().mask(mask).scale(opts.softmax_scale);
    if let Some(c) = opts.softcap {
        if !(c.is_finite() && c > 0.0) {
            candle::bail!("fa4-candle: `softcap` must be finite and > 0, got {c}");
        }
        o = o.softcap(c);
    }
    Ok(o)
}

/// An fa4 view of a candle layout (from its offset on), strides passed through; the last
/// dimension must be contiguous.
pub(crate) fn fa4_layout(name: &str, l: &Layout) -> Result<Fa4Layout> {
    let dims = l.dims();
    let strides = l.stride();
    if dims.last().copied().unwrap_or(0) > 1 && strides.last() != Some(&1) {
        candle::bail!(
            "fa4-candle: `{name}` must have a contiguous last dimension (strides {strides:?}); call .contiguous() on it"
        );
    }
    Fa4Layout::new(name, dims, Some(strides)).map_err(fa4_err)
}

/// fa4 views of Q, K and V, and O's contiguous layout (Q's shape with V's last dimension), the
/// four layouts of a problem on candle's buffers.
pub(crate) struct Fa4Views {
    pub(crate) q: Fa4Layout,
    pub(crate) k: Fa4Layout,
    pub(crate) v: Fa4Layout,
    pub(crate) o: Fa4Layout,
    pub(crate) o_shape: Shape,
}

impl Fa4Views {
    pub(crate) fn new(ql: &Layout, kl: &Layout, vl: &Layout) -> Result<Self> {
        let mut out_dims = ql.dims().to_vec();
        let last = out_dims.len() - 1;
        out_dims[last] = *vl.dims().last().unwrap_or(&0);
        Ok(Self {
            q: fa4_layout("q", ql)?,
            k: fa4_layout("k", kl)?,
            v: fa4_layout("v", vl)?,
            o: Fa4Layout::new("out", &out_dims, None).map_err(fa4_err)?,
            o_shape: Shape::from(out_dims),
        })
    }
}

/// The varlen boundaries, read to the host and checked against the packed tensors.
#[derive(Debug, Clone)]
pub(crate) struct HostSeqlens {
    pub(crate) q: Vec<i32>,
    pub(crate) k: Vec<i32>,
}

impl HostSeqlens {
    /// Reads and checks `seqlens_q`/`seqlens_k` (rank 1, integers, `batch + 1` entries from 0,
    /// non-decreasing, ending at the packed totals) and the `max_seqlen_*` bounds.
    pub(crate) fn read(vl: &Varlen<'_>, total_q: usize, total_k: usize) -> Result<Self> {
        let q = read_cumulative("seqlens_q", vl.seqlens_q, total_q, "q")?;
        let k = read_cumulative("seqlens_k", vl.seqlens_k, total_k, "k")?;
        if q.len() != k.len() {
            candle::bail!(
                "fa4-candle: `seqlens_k` has {} entries but `seqlens_q` has {}: both are batch + 1",
                k.len(),
                q.len()
            );
        }
        for (name, cu, bound) in [
            ("max_seqlen_q", &q, vl.max_seqlen_q),
            ("max_seqlen_k", &k, vl.max_seqlen_k),
        ] {
            let longest = cu.windows(2).map(|w| (w[1] - w[0]) as usize).max();
            if let Some(longest) = longest.filter(|&l| l > bound) {
                candle::bail!(
                    "fa4-candle: `{name}` is {bound} but a sequence has {longest} rows; it must bound every sequence's length"
                );
            }
        }
        Ok(HostSeqlens { q, k })
    }
}

fn read_cumulative(name: &str, t: &Tensor, total: usize, of: &str) -> Result<Vec<i32>> {
    if t.rank() != 1 {
        candle::bail!(
            "fa4-candle: `{name}` must have rank 1 ([batch + 1] cumulative lengths), got shape {:?}",
            t.dims()
        );
    }
    if !t.dtype().is_int() {
        candle::bail!(
            "fa4-candle: `{name}` has dtype {:?}; cumulative lengths are integers (u32 as in candle-flash-attn)",
            t.dtype()
        );
    }
    let values = host_ints(t)?;
    if values.first() != Some(&0) {
        candle::bail!(
            "fa4-candle: `{name}` must start at 0 and hold batch + 1 entries, got {values:?}"
        );
    }
    if let Some(w) = values.windows(2).find(|w| w[1] < w[0]) {
        candle::bail!(
            "fa4-candle: `{name}` must be non-decreasing, but {} follows {}",
            w[1],
            w[0]
        );
    }
    let last = *values.last().unwrap_or(&0);
    if last != total as i64 {
        candle::bail!(
            "fa4-candle: `{name}` ends at {last} but `{of}` has {total} rows; the last entry is the packed total"
        );
    }
    values
        .iter()
        .map(|&x| i32::try_from(x))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| candle::Error::Msg(format!("fa4-candle: `{name}` exceeds i32")))
}

/// Where the op leaves its LSE for the caller: candle's op API returns one tensor.
pub(crate) type LseSlot = Arc<Mutex<Option<(Storage, Shape)>>>;

/// The LSE's length and shape of a validated problem (dense or paged).
pub(crate) trait LseOf {
    fn lse_len(&self) -> usize;
    fn lse_shape(&self) -> Vec<usize>;
}

impl LseOf for Problem {
    fn lse_len(&self) -> usize {
        Problem::lse_len(self)
    }
    fn lse_shape(&self) -> Vec<usize> {
        Problem::lse_shape(self)
    }
}

impl LseOf for fa4::paged::PagedProblem {
    fn lse_len(&self) -> usize {
        fa4::paged::PagedProblem::lse_len(self)
    }
    fn lse_shape(&self) -> Vec<usize> {
        fa4::paged::PagedProblem::lse_shape(self)
    }
}

/// What the dense and the paged op share: one validation step from candle layouts to an fa4
/// problem, one run per backend, and the LSE hand-back. The candle entry points
/// ([`cpu_forward`], `cuda::forward`) are written once over it.
pub(crate) trait AttnOp {
    type Problem: LseOf;

    /// The names of the op's three tensors, for error messages (`q`, `k`/`k_cache`, …).
    const ARGS: [&'static str; 3];

    /// Where errors come from: `fa4-candle`, or `fa4-candle: flash_attn_paged`.
    fn context(&self) -> String;

    /// An fa4 error as a candle error, keeping fa4's message (which names the argument).
    fn err(&self, e: fa4::Error) -> candle::Error {
        candle::Error::Msg(format!("{}: {e}", self.context()))
    }

    /// Validates the call as an fa4 problem on views that start at each layout's offset.
    /// Returns the problem and the output's shape (contiguous).
    fn problem(
        &self,
        dtype: fa4::DType,
        ql: &Layout,
        kl: &Layout,
        vl: &Layout,
    ) -> Result<(Self::Problem, Shape)>;

    /// The slot the caller reads the LSE from, if it asked for one.
    fn lse_slot(&self) -> Option<&LseSlot>;

    /// Runs a validated problem on the CPU, on host views from each layout's offset.
    fn run_cpu<T: fa4::Element>(
        &self,
        p: &Self::Problem,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> fa4::Result<()>;

    fn wants_lse(&self) -> bool {
        self.lse_slot().is_some()
    }

    /// Leaves the LSE for [`take_lse`].
    fn store_lse(&self, p: &Self::Problem, storage: Storage) {
        if let Some(slot) = self.lse_slot() {
            let shape = Shape::from(p.lse_shape());
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some((storage, shape));
        }
    }
}

/// The attention op: options, varlen boundaries, and (if asked) a slot for the LSE.
pub(crate) struct Fa4Attn {
    pub(crate) opts: Options,
    pub(crate) seqlens: Option<HostSeqlens>,
    lse: Option<LseSlot>,
}

impl Fa4Attn {
    pub(crate) fn new(
        opts: &AttnOptions,
        seqlens: Option<HostSeqlens>,
        want_lse: bool,
    ) -> Result<Self> {
        Ok(Fa4Attn {
            opts: fa4_options(opts)?,
            seqlens,
            lse: want_lse.then(LseSlot::default),
        })
    }
}

impl AttnOp for Fa4Attn {
    type Problem = Problem;
    const ARGS: [&'static str; 3] = ["q", "k", "v"];

    fn context(&self) -> String {
        "fa4-candle".into()
    }

    fn problem(
        &self,
        dtype: fa4::DType,
        ql: &Layout,
        kl: &Layout,
        vl: &Layout,
    ) -> Result<(Problem, Shape)> {
        let x = Fa4Views::new(ql, kl, vl)?;
        let cu_q = self.seqlens.as_ref().map(|s| s.q.as_slice());
        let cu_k = self.seqlens.as_ref().map(|s| s.k.as_slice());
        let p =
            Problem::new(dtype, &x.q, &x.k, &x.v, &x.o, cu_q, cu_k, &self.opts).map_err(fa4_err)?;
        Ok((p, x.o_shape))
    }

    fn lse_slot(&self) -> Option<&LseSlot> {
        self.lse.as_ref()
    }

    fn run_cpu<T: fa4::Element>(
        &self,
        p: &Problem,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> fa4::Result<()> {
        Backend::Cpu.run(p, q, k, v, out, lse)
    }
}

/// The CPU forward of either op: f32, f16 and bf16 through fa4's CPU backend, on views from
/// each layout's offset (strides go to fa4 as they are, no copy).
pub(crate) fn cpu_forward<O: AttnOp>(
    op: &O,
    q: &CpuStorage,
    ql: &Layout,
    k: &CpuStorage,
    kl: &Layout,
    v: &CpuStorage,
    vl: &Layout,
) -> Result<(CpuStorage, Shape)> {
    fn typed<O: AttnOp, T: fa4::Element + candle::WithDType>(
        op: &O,
        [q, k, v]: [(&CpuStorage, &Layout); 3],
    ) -> Result<(CpuStorage, Shape)> {
        let (p, out_shape) = op.problem(<T as fa4::Element>::DTYPE, q.1, k.1, v.1)?;
        let [qn, kn, vn] = O::ARGS;
        let (qs, ks, vs) = (
            cpu_view::<T>(q.0, q.1, qn)?,
            cpu_view::<T>(k.0, k.1, kn)?,
            cpu_view::<T>(v.0, v.1, vn)?,
        );
        let mut out = vec![T::from_f32(0.0); out_shape.elem_count()];
        let mut lse = op.wants_lse().then(|| vec![0f32; p.lse_len()]);
        op.run_cpu(&p, qs, ks, vs, &mut out, lse.as_deref_mut())
            .map_err(|e| op.err(e))?;
        if let Some(lse) = lse {
            op.store_lse(&p, Storage::Cpu(CpuStorage::F32(lse)));
        }
        Ok((T::to_cpu_storage_owned(out), out_shape))
    }
    let args = [(q, ql), (k, kl), (v, vl)];
    match q.dtype() {
        DType::F32 => typed::<O, f32>(op, args),
        DType::F16 => typed::<O, f16>(op, args),
        DType::BF16 => typed::<O, bf16>(op, args),
        dt => candle::bail!(
            "{}: `q` has dtype {dt:?}; the CPU computes f32, f16 and bf16",
            op.context()
        ),
    }
}

/// The elements of `s` from `l`'s offset on.
pub(crate) fn cpu_view<'a, T: candle::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    name: &str,
) -> Result<&'a [T]> {
    match s.as_slice::<T>()?.get(l.start_offset()..) {
        Some(view) => Ok(view),
        None => candle::bail!("fa4-candle: `{name}` starts past its storage"),
    }
}

/// The LSE the op left, as a tensor on the op's device.
pub(crate) fn take_lse(slot: &LseSlot) -> Result<Tensor> {
    let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    match taken {
        Some((storage, shape)) => Ok(Tensor::from_storage(
            storage,
            shape,
            BackpropOp::none(),
            false,
        )),
        None => candle::bail!("fa4-candle: the attention op returned no LSE"),
    }
}

/// Applies an op to `q`, `k`, `v` and collects the LSE it left, if it was asked for one.
pub(crate) fn apply<O>(
    op: O,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Option<Tensor>)>
where
    O: AttnOp + candle::CustomOp3 + Send + Sync + 'static,
{
    let slot = op.lse_slot().cloned();
    let out = q.apply_op3(k, v, op)?;
    let lse = slot.map(|s| take_lse(&s)).transpose()?;
    Ok((out, lse))
}

/// An integer tensor's values on the host, as i64 (which holds every candle integer dtype's
/// values: u8, u32, i16, i32, i64). A CUDA tensor is copied to the host first (one
/// device-to-host copy, which waits for the stream), then converted there.
pub(crate) fn host_ints(t: &Tensor) -> Result<Vec<i64>> {
    t.to_device(&candle::Device::Cpu)?
        .to_dtype(DType::I64)?
        .flatten_all()?
        .to_vec1::<i64>()
}

/// Makes an [`AttnOp`] a candle op: both forwards go through the shared entries
/// ([`cpu_forward`], `cuda::forward`); there is no backward (candle reports its absence).
macro_rules! custom_op3 {
    ($op:ty, $name:literal) => {
        impl candle::CustomOp3 for $op {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(
                &self,
                q: &candle::CpuStorage,
                ql: &candle::Layout,
                k: &candle::CpuStorage,
                kl: &candle::Layout,
                v: &candle::CpuStorage,
                vl: &candle::Layout,
            ) -> candle::Result<(candle::CpuStorage, candle::Shape)> {
                $crate::op::cpu_forward(self, q, ql, k, kl, v, vl)
            }

            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                q: &candle::CudaStorage,
                ql: &candle::Layout,
                k: &candle::CudaStorage,
                kl: &candle::Layout,
                v: &candle::CudaStorage,
                vl: &candle::Layout,
            ) -> candle::Result<(candle::CudaStorage, candle::Shape)> {
                $crate::cuda::forward(self, q, ql, k, kl, v, vl)
            }
        }
    };
}
pub(crate) use custom_op3;

custom_op3!(Fa4Attn, "fa4-attention");
