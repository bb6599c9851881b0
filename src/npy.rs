//! NumPy `.npy` files: the arrays `fa4 run` reads (Q, K, V, `cu_seqlens`) and writes (O, LSE).
//!
//! The format (`numpy.lib.format`, versions 1.0, 2.0 and 3.0):
//!
//! ```text
//! \x93NUMPY  major minor  header_len (u16 LE for 1.0, u32 LE for 2.0 and 3.0)
//! {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }   padded with spaces and '\n'
//! raw elements, C (row-major) order
//! ```
//!
//! Supported element types are the ones attention needs: little-endian float32 (`'<f4'`),
//! float16 (`'<f2'`), int32 (`'<i4'`) and uint8 (`'|u1'`, the bytes of fp8 e4m3 tensors). Big-endian data, other dtypes, structured dtypes and
//! Fortran-ordered arrays of rank ≥ 2 are rejected with an error naming the argument the file
//! came from (`--q`, say) and the file. So is every malformation: a bad magic, a truncated
//! header, a shape whose size overflows, data shorter or longer than the shape says.
//!
//! ```
//! use fa4::npy::{self, Data};
//!
//! let bytes = npy::encode(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! let a = npy::decode(&bytes, "--q")?;
//! assert_eq!(a.shape, vec![2, 3]);
//! assert_eq!(a.data, Data::F32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
//! # Ok::<(), fa4::Error>(())
//! ```

use std::fmt;
use std::path::Path;

use half::f16;

use crate::error::{Error, Result};

const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// Header plus preamble is padded to this many bytes, as NumPy writes it, so the data is aligned.
const ALIGN: usize = 64;

/// The element type of an array in a `.npy` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NpyDType {
    /// float32, `'<f4'`.
    F32,
    /// float16, `'<f2'`.
    F16,
    /// int32, `'<i4'`.
    I32,
    /// uint8, `'|u1'` (fp8 e4m3 bit patterns).
    U8,
}

impl NpyDType {
    /// The `descr` string NumPy writes for this type.
    pub const fn descr(self) -> &'static str {
        match self {
            NpyDType::F32 => "<f4",
            NpyDType::F16 => "<f2",
            NpyDType::I32 => "<i4",
            NpyDType::U8 => "|u1",
        }
    }

    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            NpyDType::F32 | NpyDType::I32 => 4,
            NpyDType::F16 => 2,
            NpyDType::U8 => 1,
        }
    }

    /// NumPy's name for the type.
    pub const fn name(self) -> &'static str {
        match self {
            NpyDType::F32 => "float32",
            NpyDType::F16 => "float16",
            NpyDType::I32 => "int32",
            NpyDType::U8 => "uint8",
        }
    }

    /// Every supported type.
    pub const ALL: [NpyDType; 4] = [NpyDType::F32, NpyDType::F16, NpyDType::I32, NpyDType::U8];

    /// The type of `descr` if it is one of `allowed`; else why not, naming what is allowed.
    fn from_descr(descr: &str, allowed: &[NpyDType]) -> std::result::Result<Self, String> {
        if let Some(&t) = allowed.iter().find(|t| t.descr() == descr) {
            return Ok(t);
        }
        let expected = allowed
            .iter()
            .map(|t| format!("{} ('{}')", t.name(), t.descr()))
            .collect::<Vec<_>>()
            .join(" or ");
        if descr.starts_with('>') {
            return Err(format!(
                "holds big-endian data ('{descr}'); expected little-endian {expected} \
                 (convert with arr.astype(arr.dtype.newbyteorder('<')))"
            ));
        }
        let known = match descr.trim_start_matches(['<', '|', '=']) {
            "f8" => " (float64)",
            "f4" => " (float32)",
            "f2" => " (float16)",
            "i8" => " (int64)",
            "i4" => " (int32)",
            "i2" => " (int16)",
            "i1" => " (int8)",
            "u8" => " (uint64)",
            "u4" => " (uint32)",
            "u2" => " (uint16)",
            "u1" => " (uint8)",
            "b1" => " (bool)",
            _ => "",
        };
        Err(format!("has dtype '{descr}'{known}; expected {expected}"))
    }
}

impl fmt::Display for NpyDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The elements of an array, in C order.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    /// float32 elements.
    F32(Vec<f32>),
    /// float16 elements.
    F16(Vec<f16>),
    /// int32 elements.
    I32(Vec<i32>),
    /// uint8 elements.
    U8(Vec<u8>),
}

/// An array read from a `.npy` file.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    /// The shape (empty for a 0-d array, which holds one element).
    pub shape: Vec<usize>,
    /// The elements, C order; their count is the product of `shape`.
    pub data: Data,
}

impl Array {
    /// The element type.
    pub fn dtype(&self) -> NpyDType {
        match self.data {
            Data::F32(_) => NpyDType::F32,
            Data::F16(_) => NpyDType::F16,
            Data::I32(_) => NpyDType::I32,
            Data::U8(_) => NpyDType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            Data::F32(x) => x.len(),
            Data::F16(x) => x.len(),
            Data::I32(x) => x.len(),
            Data::U8(x) => x.len(),
        }
    }

    /// Whether the array holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for i32 {}
    impl Sealed for u8 {}
}

/// An element type that can be written to a `.npy` file: `f32`, [`half::f16`], `i32`, `u8`.
pub trait NpyElement: Copy + sealed::Sealed {
    /// The type tag.
    const DTYPE: NpyDType;
    /// Appends the little-endian bytes of `self`.
    fn put(self, out: &mut Vec<u8>);
}

impl NpyElement for f32 {
    const DTYPE: NpyDType = NpyDType::F32;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl NpyElement for f16 {
    const DTYPE: NpyDType = NpyDType::F16;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
}

impl NpyElement for i32 {
    const DTYPE: NpyDType = NpyDType::I32;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl NpyElement for u8 {
    const DTYPE: NpyDType = NpyDType::U8;
    fn put(self, out: &mut Vec<u8>) {
        out.push(self);
    }
}

/// Reads a `.npy` file of any supported type. `name` is the argument the path came from
/// (`--q`); every error names it and the file.
pub fn read(path: &Path, name: &str) -> Result<Array> {
    read_as(path, name, &NpyDType::ALL)
}

/// Reads a `.npy` file whose element type must be one of `allowed` (an error says which were
/// expected and what the file holds).
///
/// At most the bytes the header declares (and one more, to notice a longer file) are read, so
/// `/dev/zero`, an endless pipe or a huge file is an error, not an unbounded allocation.
pub fn read_as(path: &Path, name: &str, allowed: &[NpyDType]) -> Result<Array> {
    use std::io::Read;
    let shown = one_line(&path.display().to_string());
    let fail = |why: String| Error::invalid(name, format!("`{shown}` {why}"));
    let cannot = |e: std::io::Error| Error::invalid(name, format!("cannot read `{shown}`: {e}"));
    let file = std::fs::File::open(path).map_err(cannot)?;
    let file_len = file
        .metadata()
        .ok()
        .filter(std::fs::Metadata::is_file)
        .and_then(|m| usize::try_from(m.len()).ok());
    let mut r = std::io::BufReader::new(file);
    let mut bytes = Vec::new();
    let mut read_upto = |bytes: &mut Vec<u8>, end: usize| -> Result<()> {
        let more = end.saturating_sub(bytes.len()) as u64;
        (&mut r).take(more).read_to_end(bytes).map_err(cannot)?;
        Ok(())
    };
    read_upto(&mut bytes, 12)?;
    if let Some(end) = header_end(&bytes) {
        read_upto(&mut bytes, end)?;
    }
    let f = frame(&bytes, allowed).map_err(|why| fail(one_line(&why)))?;
    let too_big = || {
        fail(format!(
            "declares {} bytes of data, more than can be allocated",
            f.nbytes
        ))
    };
    let end = f.data_start.checked_add(f.nbytes).ok_or_else(too_big)?;
    if let Some(len) = file_len {
        if len != end {
            return Err(fail(f.wrong_size(len.saturating_sub(f.data_start))));
        }
    }
    // One byte past the declared end: a longer stream is reported, not truncated silently.
    let past = end.checked_add(1).ok_or_else(too_big)?;
    if bytes.try_reserve_exact(past - bytes.len()).is_err() {
        return Err(too_big());
    }
    read_upto(&mut bytes, past)?;
    parse(&bytes, allowed).map_err(fail)
}

/// Parses the bytes of a `.npy` file of any supported type; errors name the argument `name`.
pub fn decode(bytes: &[u8], name: &str) -> Result<Array> {
    parse(bytes, &NpyDType::ALL).map_err(|why| Error::invalid(name, format!("the .npy data {why}")))
}

/// Writes `data` of `shape` (C order) as a version 1.0 `.npy` file (2.0 if the header needs it).
/// `name` is the argument the path came from; errors name it and the file.
///
/// The bytes go to a temporary file beside `path`, renamed over it once complete, so an
/// interrupted write never leaves a half-written `.npy` at `path` (a symbolic link at `path` is
/// replaced, not followed).
pub fn write<T: NpyElement>(path: &Path, name: &str, shape: &[usize], data: &[T]) -> Result<()> {
    stage(path, name, shape, data)?.commit()
}

/// A complete `.npy` file written beside its destination under a temporary name, not yet in
/// place: [`Staged::commit`] renames it over the destination; dropping it removes it. Staging
/// every output before committing any lets a caller write several files all or nothing.
#[derive(Debug)]
pub struct Staged {
    tmp: std::path::PathBuf,
    path: std::path::PathBuf,
    name: String,
    committed: bool,
}

/// Writes `data` of `shape` to a temporary file beside `path` (see [`Staged`]).
pub fn stage<T: NpyElement>(
    path: &Path,
    name: &str,
    shape: &[usize],
    data: &[T],
) -> Result<Staged> {
    let bytes = encode(shape, data).map_err(|e| rename(e, name))?;
    let shown = one_line(&path.display().to_string());
    let file = path
        .file_name()
        .ok_or_else(|| Error::invalid(name, format!("`{shown}` does not name a file")))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file);
    tmp_name.push(format!(".fa4-{}.tmp", std::process::id()));
    let staged = Staged {
        tmp: path.with_file_name(tmp_name),
        path: path.to_path_buf(),
        name: name.to_string(),
        committed: false,
    };
    std::fs::write(&staged.tmp, bytes)
        .map_err(|e| Error::invalid(name, format!("cannot write `{shown}`: {e}")))?;
    Ok(staged)
}

impl Staged {
    /// Renames the temporary file over the destination.
    pub fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.tmp, &self.path).map_err(|e| {
            Error::invalid(
                &self.name,
                format!(
                    "cannot write `{}`: {e}",
                    one_line(&self.path.display().to_string())
                ),
            )
        })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the error that made the caller drop it is the one worth reporting.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// `s` on one line and of bounded length: control characters (a header's newline, raw bytes
/// of a malformed file) are escaped, and text past `max` characters is cut with `…`.
fn one_line_max(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        // Line and paragraph separators end a line in some terminals too.
        if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// [`one_line_max`] with room for a path or a whole error.
fn one_line(s: &str) -> String {
    one_line_max(s, 400)
}

/// The bytes of a `.npy` file holding `data` of `shape` in C order. Errors (naming `shape`) if
/// the element count is not the product of `shape`.
pub fn encode<T: NpyElement>(shape: &[usize], data: &[T]) -> Result<Vec<u8>> {
    let numel = shape.iter().try_fold(1usize, |acc, &n| acc.checked_mul(n));
    if numel != Some(data.len()) {
        return Err(Error::invalid(
            "shape",
            format!(
                "{shape:?} does not describe the {} elements given",
                data.len()
            ),
        ));
    }
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {dims}, }}",
        T::DTYPE.descr()
    );
    // Version 1.0 holds the header length in a u16; 2.0 in a u32 (preamble 12 bytes, not 10).
    let v1_total = (MAGIC.len() + 4 + header.len() + 1).next_multiple_of(ALIGN);
    let (major, preamble) = if v1_total - MAGIC.len() - 4 <= usize::from(u16::MAX) {
        (1u8, MAGIC.len() + 4)
    } else {
        (2u8, MAGIC.len() + 6)
    };
    let total = (preamble + header.len() + 1).next_multiple_of(ALIGN);
    header.extend(std::iter::repeat_n(
        ' ',
        total - preamble - header.len() - 1,
    ));
    header.push('\n');
    let mut out = Vec::with_capacity(total + data.len() * T::DTYPE.size_bytes());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[major, 0]);
    if major == 1 {
        let len = u16::try_from(header.len()).expect("checked above to fit a u16");
        out.extend_from_slice(&len.to_le_bytes());
    } else {
        let len = u32::try_from(header.len()).map_err(|_| {
            Error::invalid("shape", format!("{shape:?}: the .npy header is too long"))
        })?;
        out.extend_from_slice(&len.to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    for &x in data {
        x.put(&mut out);
    }
    Ok(out)
}

fn rename(e: Error, name: &str) -> Error {
    match e {
        Error::InvalidArgument { reason, .. } => Error::invalid(name, reason),
        other => other,
    }
}

/// Parses a whole file; the error is a phrase that follows the file's name ("is truncated …").
fn parse(bytes: &[u8], allowed: &[NpyDType]) -> std::result::Result<Array, String> {
    parse_raw(bytes, allowed).map_err(|why| one_line(&why))
}

/// Where the header ends (`preamble + header_len`), read from the preamble; `None` when the
/// bytes do not start with a supported preamble (then [`parse`] says what is wrong).
fn header_end(bytes: &[u8]) -> Option<usize> {
    if bytes.len() < MAGIC.len() + 2 || &bytes[..MAGIC.len()] != MAGIC {
        return None;
    }
    match bytes[6] {
        1 if bytes.len() >= 10 => Some(10 + usize::from(u16::from_le_bytes([bytes[8], bytes[9]]))),
        2 | 3 if bytes.len() >= 12 => {
            let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
            usize::try_from(len).ok()?.checked_add(12)
        }
        _ => None,
    }
}

/// A parsed header: where the data starts and how many bytes it must hold.
struct Framed {
    header: Header,
    data_start: usize,
    nbytes: usize,
    numel: usize,
}

impl Framed {
    fn wrong_size(&self, got: usize) -> String {
        format!(
            "holds {got} bytes of data, but shape {:?} of {} needs {}",
            self.header.shape, self.header.dtype, self.nbytes
        )
    }
}

fn parse_raw(bytes: &[u8], allowed: &[NpyDType]) -> std::result::Result<Array, String> {
    let f = frame(bytes, allowed)?;
    let body = &bytes[f.data_start..];
    if body.len() != f.nbytes {
        return Err(f.wrong_size(body.len()));
    }
    let (header, numel) = (f.header, f.numel);
    let data = match header.dtype {
        NpyDType::F32 => Data::F32(
            body.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        NpyDType::F16 => Data::F16(
            body.chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        NpyDType::I32 => Data::I32(
            body.chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        NpyDType::U8 => Data::U8(body.to_vec()),
    };
    debug_assert_eq!(
        match &data {
            Data::F32(x) => x.len(),
            Data::F16(x) => x.len(),
            Data::I32(x) => x.len(),
            Data::U8(x) => x.len(),
        },
        numel
    );
    Ok(Array {
        shape: header.shape,
        data,
    })
}

/// Parses the preamble and header (the data need not be there yet).
fn frame(bytes: &[u8], allowed: &[NpyDType]) -> std::result::Result<Framed, String> {
    if bytes.len() < MAGIC.len() + 2 || &bytes[..MAGIC.len()] != MAGIC {
        return Err("is not a .npy file (it does not start with \\x93NUMPY)".into());
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (len_bytes, utf8) = match major {
        1 => (2, false),
        2 => (4, false),
        3 => (4, true),
        _ => {
            return Err(format!(
                "has .npy format version {major}.{minor}; supported are 1.0, 2.0 and 3.0"
            ))
        }
    };
    let start = 8 + len_bytes;
    if bytes.len() < start {
        return Err("is truncated inside its header length".into());
    }
    let header_len = if len_bytes == 2 {
        usize::from(u16::from_le_bytes([bytes[8], bytes[9]]))
    } else {
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize
    };
    let data_start = start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| {
            format!(
                "is truncated: its header claims {header_len} bytes, the file holds {}",
                bytes.len() - start
            )
        })?;
    let raw = &bytes[start..data_start];
    let text = match std::str::from_utf8(raw) {
        Ok(t) if utf8 || t.is_ascii() => t,
        _ => return Err("has a header that is not ASCII text".into()),
    };
    let header = Header::parse(text, allowed)?;
    let numel = header
        .shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n));
    let nbytes = numel.and_then(|n| n.checked_mul(header.dtype.size_bytes()));
    let (Some(numel), Some(nbytes)) = (numel, nbytes) else {
        return Err(format!(
            "has shape {:?}, whose size overflows",
            header.shape
        ));
    };
    if header.fortran_order && header.shape.len() > 1 {
        return Err(format!(
            "is in Fortran order (shape {:?}); save a C-ordered array (np.ascontiguousarray)",
            header.shape
        ));
    }
    Ok(Framed {
        header,
        data_start,
        nbytes,
        numel,
    })
}

/// The header dictionary.
struct Header {
    dtype: NpyDType,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// A value of the header's Python literal.
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

/// A cursor over the header's Python dict literal, e.g.
/// `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`.
struct Lexer<'a> {
    s: &'a str,
}

impl<'a> Lexer<'a> {
    fn skip_ws(&mut self) {
        self.s = self.s.trim_start();
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.s.chars().next()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.s = &self.s[c.len_utf8()..];
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char) -> std::result::Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected '{c}' at `{}`", self.context()))
        }
    }

    fn context(&self) -> String {
        let s: String = self.s.chars().take(20).collect();
        if s.is_empty() {
            "end of header".into()
        } else {
            s
        }
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let q = match self.peek() {
            Some(q @ ('\'' | '"')) => q,
            _ => return Err(format!("expected a quoted string at `{}`", self.context())),
        };
        let rest = &self.s[1..];
        let end = rest
            .find(q)
            .ok_or_else(|| "has an unterminated string".to_string())?;
        let out = rest[..end].to_string();
        self.s = &rest[end + 1..];
        Ok(out)
    }

    fn value(&mut self) -> std::result::Result<Value, String> {
        match self.peek() {
            Some('\'' | '"') => Ok(Value::Str(self.string()?)),
            Some('(') => {
                self.s = &self.s[1..];
                let mut dims = Vec::new();
                loop {
                    if self.eat(')') {
                        break;
                    }
                    self.skip_ws();
                    let end = self
                        .s
                        .find(|c: char| !c.is_ascii_digit())
                        .unwrap_or(self.s.len());
                    if end == 0 {
                        return Err(format!(
                            "expected a non-negative integer in the shape at `{}`",
                            self.context()
                        ));
                    }
                    let n = self.s[..end].parse::<usize>().map_err(|_| {
                        format!("has a shape entry {} that overflows", &self.s[..end])
                    })?;
                    self.s = &self.s[end..];
                    dims.push(n);
                    if !self.eat(',') {
                        self.expect(')')?;
                        break;
                    }
                }
                Ok(Value::Tuple(dims))
            }
            Some('[' | '{') => Err("has a structured dtype, which is not supported".into()),
            _ => {
                for (word, b) in [("True", true), ("False", false)] {
                    if let Some(rest) = self.s.strip_prefix(word) {
                        self.s = rest;
                        return Ok(Value::Bool(b));
                    }
                }
                Err(format!("has an unexpected value at `{}`", self.context()))
            }
        }
    }
}

impl Header {
    fn parse(text: &str, allowed: &[NpyDType]) -> std::result::Result<Header, String> {
        let mut lx = Lexer { s: text };
        let bad = |why: String| {
            format!(
                "has a malformed header ({}): {}",
                one_line_max(&why, 120),
                one_line_max(text.trim_end(), 120)
            )
        };
        let (mut descr, mut fortran, mut shape) = (None, None, None);
        lx.expect('{').map_err(bad)?;
        loop {
            if lx.eat('}') {
                break;
            }
            let key = lx.string().map_err(bad)?;
            lx.expect(':').map_err(bad)?;
            let value = lx.value().map_err(bad)?;
            match (key.as_str(), value) {
                ("descr", Value::Str(s)) => descr = Some(s),
                ("fortran_order", Value::Bool(b)) => fortran = Some(b),
                ("shape", Value::Tuple(t)) => shape = Some(t),
                ("descr" | "fortran_order" | "shape", _) => {
                    return Err(bad(format!("'{key}' has the wrong kind of value")))
                }
                _ => return Err(bad(format!("unexpected key '{key}'"))),
            }
            if !lx.eat(',') {
                lx.expect('}').map_err(bad)?;
                break;
            }
        }
        if !lx.s.trim().is_empty() {
            return Err(bad(format!(
                "text after the dictionary: `{}`",
                lx.context()
            )));
        }
        let (Some(descr), Some(fortran_order), Some(shape)) = (descr, fortran, shape) else {
            return Err(bad(
                "it must hold 'descr', 'fortran_order' and 'shape'".into()
            ));
        };
        Ok(Header {
            dtype: NpyDType::from_descr(&descr, allowed)?,
            fortran_order,
            shape,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(e: Error) -> String {
        match e {
            Error::InvalidArgument { name, reason } => {
                assert_eq!(name, "--x");
                reason
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    /// A file with a hand-written header and `data` bytes, version 1.0.
    fn raw(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn round_trips_every_type_and_rank() {
        let f: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        for shape in [vec![2, 3, 4], vec![24], vec![1, 2, 3, 4], vec![4, 6]] {
            let bytes = encode(&shape, &f).unwrap();
            assert_eq!(
                (MAGIC.len() + 4 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize) % ALIGN,
                0
            );
            let a = decode(&bytes, "--x").unwrap();
            assert_eq!(a.shape, shape);
            assert_eq!(a.data, Data::F32(f.clone()));
        }
        let h: Vec<f16> = f.iter().map(|&x| f16::from_f32(x)).collect();
        let a = decode(&encode(&[3, 8], &h).unwrap(), "--x").unwrap();
        assert_eq!((a.shape, a.data), (vec![3, 8], Data::F16(h)));
        let i = vec![0i32, 5, -7, i32::MAX];
        let a = decode(&encode(&[4], &i).unwrap(), "--x").unwrap();
        assert_eq!((a.shape.clone(), a.dtype()), (vec![4], NpyDType::I32));
        assert_eq!(a.data, Data::I32(i));
        // Empty and 0-d arrays.
        let a = decode(&encode::<f32>(&[0, 5], &[]).unwrap(), "--x").unwrap();
        assert_eq!((a.shape.clone(), a.len()), (vec![0, 5], 0));
        let a = decode(&encode(&[], &[7.0f32]).unwrap(), "--x").unwrap();
        assert_eq!((a.shape, a.data), (vec![], Data::F32(vec![7.0])));
    }

    #[test]
    fn writes_the_header_numpy_writes() {
        let bytes = encode(&[3], &[1i32, 2, 3]).unwrap();
        let hl = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        let header = std::str::from_utf8(&bytes[10..10 + hl]).unwrap();
        assert_eq!(
            header.trim_end(),
            "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }"
        );
        assert!(header.ends_with('\n'));
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        assert!(encode(&[2, 2], &[1.0f32; 3]).is_err());
    }

    #[test]
    fn reads_versions_2_and_3_and_numpy_spellings() {
        let header = "{\"descr\":\"<f4\",\"fortran_order\":False,\"shape\":(2,)}\n";
        for major in [2u8, 3] {
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&[major, 0]);
            b.extend_from_slice(&(header.len() as u32).to_le_bytes());
            b.extend_from_slice(header.as_bytes());
            b.extend_from_slice(&1.5f32.to_le_bytes());
            b.extend_from_slice(&(-2f32).to_le_bytes());
            let a = decode(&b, "--x").unwrap();
            assert_eq!(a.data, Data::F32(vec![1.5, -2.0]));
        }
        // Fortran order is the same layout for rank 1.
        let b = raw(
            "{'descr': '<i4', 'fortran_order': True, 'shape': (1,), }\n",
            &9i32.to_le_bytes(),
        );
        assert_eq!(decode(&b, "--x").unwrap().data, Data::I32(vec![9]));
    }

    #[test]
    fn rejects_malformed_files_with_a_reason() {
        let good = encode(&[2, 3], &[0.5f32; 6]).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (Vec::new(), "not a .npy file"),
            (b"PK\x03\x04 zip archive".to_vec(), "not a .npy file"),
            (good[..9].to_vec(), "truncated"),
            (good[..40].to_vec(), "truncated"),
            (good[..good.len() - 1].to_vec(), "holds 23 bytes of data"),
            ([good.as_slice(), &[0u8; 4]].concat(), "holds 28 bytes"),
            (
                {
                    let mut b = good.clone();
                    b[6] = 4;
                    b
                },
                "version 4.0",
            ),
            (
                raw(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }",
                    &[],
                ),
                "overflows",
            ),
            (
                raw(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,), }",
                    &[],
                ),
                "overflows",
            ),
            (
                raw("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }", &[0; 4]),
                "big-endian",
            ),
            (
                raw("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", &[0; 8]),
                "'<f8' (float64); expected float32",
            ),
            (
                raw("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", &[0; 8]),
                "'<i8' (int64)",
            ),
            (
                raw("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", &[0; 16]),
                "Fortran order",
            ),
            (
                raw("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", &[0; 4]),
                "structured",
            ),
            (raw("{'descr': '<f4', 'shape': (1,), }", &[0; 4]), "must hold"),
            (
                raw("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", &[0; 4]),
                "malformed",
            ),
            (
                raw("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", &[0; 4]),
                "non-negative integer",
            ),
            (
                raw("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)", &[0; 4]),
                "malformed",
            ),
            (
                raw("{'descr': '<f4, 'fortran_order': False, 'shape': (1,)}", &[0; 4]),
                "malformed",
            ),
            (
                raw("{'descr': '<f4', 'fortran_order': 'no', 'shape': (1,)}", &[0; 4]),
                "wrong kind",
            ),
            (
                raw("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} junk", &[0; 4]),
                "text after",
            ),
        ];
        for (bytes, want) in cases {
            let why = reason(decode(&bytes, "--x").expect_err(want));
            assert!(why.contains(want), "expected {want:?} in: {why}");
        }
    }

    #[test]
    fn file_errors_name_the_argument_and_the_path() {
        let dir = std::env::temp_dir().join(format!("fa4-npy-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        write(&p, "--x", &[2], &[1.0f32, 2.0]).unwrap();
        assert_eq!(read(&p, "--x").unwrap().data, Data::F32(vec![1.0, 2.0]));
        let missing = dir.join("missing.npy");
        let why = reason(read(&missing, "--x").unwrap_err());
        assert!(
            why.contains("cannot read") && why.contains("missing.npy"),
            "{why}"
        );
        let why = reason(read_as(&p, "--x", &[NpyDType::I32]).unwrap_err());
        assert!(
            why.contains("'<f4' (float32); expected int32 ('<i4')"),
            "{why}"
        );
        std::fs::write(&p, b"garbage").unwrap();
        let why = reason(read(&p, "--x").unwrap_err());
        assert!(
            why.contains("a.npy") && why.contains("not a .npy file"),
            "{why}"
        );
        let why = reason(write(&dir.join("no/such/dir.npy"), "--x", &[1], &[1.0f32]).unwrap_err());
        assert!(why.contains("cannot write"), "{why}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
