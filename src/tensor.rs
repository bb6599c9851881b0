//! Element types and strided host tensor views.
//!
//! Attention tensors are `[batch, seqlen, heads, dim]` (fixed-length batches) or
//! `[total, heads, dim]` (packed variable-length batches). The last dimension is contiguous;
//! every other stride is free, so a view can be a slice of a larger tensor (a fused QKV buffer,
//! say). Views check at construction that every element they describe lies inside the slice.

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for float8::F8E4M3 {}
}

/// A type a tensor may hold: the [`Element`] types and [`float8::F8E4M3`] (fp8 inputs, which
/// have their own calls: `Backend::forward_fp8`).
pub trait Storage:
    Copy
    + Send
    + Sync
    + PartialEq
    + std::fmt::Debug
    + 'static
    + sealed::Sealed
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
{
}

impl Storage for float8::F8E4M3 {}

/// A storage element type fa4 computes with: `f32`, [`half::f16`], [`half::bf16`].
pub trait Element: Storage {
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widens exactly to f32.
    fn to_f32(self) -> f32;
    /// Rounds to nearest even.
    fn from_f32(x: f32) -> Self;
    /// Rounds an f64 to this type (through f32 for the 16-bit types: exact for the 16-bit
    /// formats apart from double-rounding ties, which the tolerance rule allows for).
    fn from_f64(x: f64) -> Self {
        Self::from_f32(x as f32)
    }
    /// A quiet NaN, used to poison outputs in tests.
    const NAN: Self;
}

impl Storage for f32 {}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    const NAN: Self = f32::NAN;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Storage for f16 {}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    const NAN: Self = f16::NAN;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
}

impl Storage for bf16 {}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    const NAN: Self = bf16::NAN;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

/// The shape and strides of an attention tensor, independent of its storage.
///
/// `dims` is `[batch, seqlen, heads, dim]`; a packed varlen tensor `[total, heads, dim]` is held
/// as batch 1. `strides` are in elements for the first three dims; the last dim is contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    /// `[batch, seqlen, heads, dim]`.
    pub dims: [usize; 4],
    /// Element strides of batch, sequence row and head.
    pub strides: [usize; 3],
    /// Whether the caller gave three dims (packed varlen form).
    pub packed: bool,
}

impl Layout {
    /// Builds a layout from a shape of rank 3 (`[total, heads, dim]`) or 4
    /// (`[batch, seqlen, heads, dim]`) and, optionally, strides of the same rank whose last
    /// entry is 1. `None` means contiguous (row-major).
    pub fn new(name: &str, shape: &[usize], strides: Option<&[usize]>) -> Result<Self> {
        let (dims, packed) = match *shape {
            [b, s, h, d] => ([b, s, h, d], false),
            [t, h, d] => ([1, t, h, d], true),
            _ => {
                return Err(Error::invalid(
                    name,
                    format!(
                        "expected shape [batch, seqlen, heads, dim] or [total, heads, dim], got {shape:?}"
                    ),
                ))
            }
        };
        // Every later size product (`numel`, buffer lengths) is bounded by this one.
        if dims
            .iter()
            .try_fold(1usize, |acc, &n| acc.checked_mul(n))
            .is_none()
        {
            return Err(Error::invalid(
                name,
                format!("shape {shape:?} overflows: more elements than usize holds"),
            ));
        }
        let [_, s, h, d] = dims;
        let strides = match strides {
            None => {
                let sh = d;
                let ss = h.checked_mul(d);
                let sb = ss.and_then(|ss| ss.checked_mul(s));
                match (ss, sb) {
                    // A packed tensor's batch axis has extent 1: its stride is 0, as with
                    // explicit strides, so kernels that index it by sequence stay in bounds.
                    (Some(ss), Some(_)) if packed => [0, ss, sh],
                    (Some(ss), Some(sb)) => [sb, ss, sh],
                    _ => return Err(Error::invalid(name, format!("shape {shape:?} overflows"))),
                }
            }
            Some(st) => {
                if st.len() != shape.len() {
                    return Err(Error::invalid(
                        name,
                        format!("strides {st:?} must have the rank of shape {shape:?}"),
                    ));
                }
                if st[st.len() - 1] != 1 && dims[3] > 1 {
                    return Err(Error::invalid(
                        name,
                        format!(
                            "the last dimension must be contiguous (stride 1), strides are {st:?}"
                        ),
                    ));
                }
                if packed {
                    [0, st[0], st[1]]
                } else {
                    [st[0], st[1], st[2]]
                }
            }
        };
        Ok(Layout {
            dims,
            strides,
            packed,
        })
    }

    /// One past the largest element offset the layout reaches (0 when it is empty).
    pub fn extent(&self) -> Option<usize> {
        if self.dims.contains(&0) {
            return Some(0);
        }
        let mut last = self.dims[3] - 1;
        for axis in 0..3 {
            last = last.checked_add((self.dims[axis] - 1).checked_mul(self.strides[axis])?)?;
        }
        last.checked_add(1)
    }

    /// Elements a contiguous tensor of this shape holds (checked not to overflow when the
    /// layout was built; saturates for a layout whose public fields were edited since).
    pub fn numel(&self) -> usize {
        self.dims
            .iter()
            .try_fold(1usize, |acc, &n| acc.checked_mul(n))
            .unwrap_or(usize::MAX)
    }

    /// Element offset of `(batch, row, head, 0)`.
    #[inline]
    pub fn offset(&self, batch: usize, row: usize, head: usize) -> usize {
        batch * self.strides[0] + row * self.strides[1] + head * self.strides[2]
    }

    /// Checks that a buffer of `len` elements holds every element of the layout.
    pub fn check_fits(&self, name: &str, len: usize) -> Result<()> {
        match self.extent() {
            Some(e) if e <= len => Ok(()),
            Some(e) => Err(Error::invalid(
                name,
                format!(
                    "shape {:?} with strides {:?} reaches element {}, but the buffer holds {len}",
                    self.dims,
                    self.strides,
                    e - 1
                ),
            )),
            None => Err(Error::invalid(name, "shape and strides overflow usize")),
        }
    }
}

/// A read-only strided view of a host tensor.
#[derive(Debug, Clone, Copy)]
pub struct Tensor<'a, T> {
    data: &'a [T],
    layout: Layout,
}

impl<'a, T: Storage> Tensor<'a, T> {
    /// A contiguous (row-major) tensor of `shape` (rank 3 or 4) over `data`.
    pub fn new(data: &'a [T], shape: &[usize]) -> Result<Self> {
        Self::strided(data, shape, None)
    }

    /// A tensor with explicit element strides (last stride 1); `None` means contiguous.
    pub fn strided(data: &'a [T], shape: &[usize], strides: Option<&[usize]>) -> Result<Self> {
        Self::with_name("tensor", data, shape, strides)
    }

    /// Like [`Tensor::strided`], naming the argument in errors.
    pub fn with_name(
        name: &str,
        data: &'a [T],
        shape: &[usize],
        strides: Option<&[usize]>,
    ) -> Result<Self> {
        let layout = Layout::new(name, shape, strides)?;
        layout.check_fits(name, data.len())?;
        Ok(Tensor { data, layout })
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The underlying slice.
    pub fn data(&self) -> &'a [T] {
        self.data
    }
}

/// A writable strided view of a host tensor.
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    data: &'a mut [T],
    layout: Layout,
}

impl<'a, T: Storage> TensorMut<'a, T> {
    /// A contiguous (row-major) tensor of `shape` (rank 3 or 4) over `data`.
    pub fn new(data: &'a mut [T], shape: &[usize]) -> Result<Self> {
        Self::strided(data, shape, None)
    }

    /// A tensor with explicit element strides (last stride 1); `None` means contiguous.
    pub fn strided(data: &'a mut [T], shape: &[usize], strides: Option<&[usize]>) -> Result<Self> {
        Self::with_name("tensor", data, shape, strides)
    }

    /// Like [`TensorMut::strided`], naming the argument in errors.
    pub fn with_name(
        name: &str,
        data: &'a mut [T],
        shape: &[usize],
        strides: Option<&[usize]>,
    ) -> Result<Self> {
        let layout = Layout::new(name, shape, strides)?;
        layout.check_fits(name, data.len())?;
        Ok(TensorMut { data, layout })
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The underlying slice.
    pub fn data_mut(&mut self) -> &mut [T] {
        self.data
    }

    /// Splits into slice and layout (for backends).
    pub(crate) fn parts(&mut self) -> (&mut [T], Layout) {
        (self.data, self.layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_layouts_have_batch_stride_zero() {
        // Kernels index the batch axis by sequence: a packed tensor's must not move.
        let implicit = Layout::new("q", &[40, 2, 64], None).unwrap();
        let explicit = Layout::new("q", &[40, 2, 64], Some(&[128, 64, 1])).unwrap();
        assert!(implicit.packed);
        assert_eq!(implicit.dims, [1, 40, 2, 64]);
        assert_eq!(implicit.strides, [0, 128, 64]);
        assert_eq!(implicit, explicit);
        assert_eq!(implicit.extent(), Some(40 * 128));
        let fixed = Layout::new("q", &[3, 40, 2, 64], None).unwrap();
        assert_eq!(fixed.strides, [40 * 128, 128, 64]);
    }
}
