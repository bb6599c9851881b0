//! Kernel compilation with NVRTC at run time, and the on-disk cache of the results.
//!
//! A kernel's source is the planner's prelude (a pure function of the spec, a
//! [`KernelSource`]), the params header and the kernel file, all embedded in the binary. NVRTC compiles it for the
//! device's exact architecture into a cubin. Cubins are cached under
//! `$FA4_CACHE_DIR` (default `$XDG_CACHE_HOME/fa4` or `~/.cache/fa4`), keyed by a hash of the
//! spec, the full source, the options and the NVRTC version; a cache file is written to a
//! temporary name and renamed into place, so two processes compiling at once both end with a
//! whole file.
//!
//! An entry is a [`ENTRY_HEADER_BYTES`]-byte header (magic, format version, image length,
//! FNV-1a hash of the image) and the cubin. An entry that does not verify (empty, truncated,
//! overwritten, written by an older fa4 without the header) is a miss: the kernel is compiled
//! again, the entry replaced, and one line on stderr names the file and why. An entry that
//! verifies but that the driver will not load (written for another driver, say) is replaced the
//! same way by [`recompile_refused`], which the backend calls when `cuModuleLoadData` fails on
//! a cached image.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::libs;
use crate::config::{sm100_kernel, sm80, sm90};
use crate::error::{Error, Result};

/// The shared device layer every kernel family includes, in order: types and small PTX wrappers
/// (`kernels/common/base.cuh`), the params struct and sequence bounds (`params.cuh`), the mask
/// (`mask.cuh`) and the online softmax (`softmax.cuh`).
pub const COMMON_SRCS: [&str; 4] = [
    include_str!("../kernels/common/base.cuh"),
    PARAMS_SRC,
    include_str!("../kernels/common/mask.cuh"),
    include_str!("../kernels/common/softmax.cuh"),
];
/// The params header, shared by every kernel family.
pub const PARAMS_SRC: &str = include_str!("../kernels/common/params.cuh");
/// The forward kernels' exact path for rows the fast one may get wrong: the epilogue's marks and
/// the fixup kernel (issue 12).
pub const EXACT_SRC: &str = include_str!("../kernels/common/exact.cuh");
/// The Ampere-class kernel's PTX wrappers.
pub const SM80_PTX_SRC: &str = include_str!("../kernels/sm80/ptx.cuh");
/// The register-tile steps the Ampere-class forward and the decode kernel share.
pub const SM80_TILE_OPS_SRC: &str = include_str!("../kernels/sm80/tile_ops.cuh");
/// The Ampere-class forward kernel.
pub const SM80_FWD_SRC: &str = include_str!("../kernels/sm80/fwd.cu");
/// The Hopper kernels' params (TMA maps around [`PARAMS_SRC`]'s struct).
pub const SM90_PARAMS_SRC: &str = include_str!("../kernels/sm90/params.cuh");
/// mbarrier, proxy-fence and 1-D bulk-copy wrappers (sm_90 and later): the Hopper and Blackwell
/// kernels, the decode all-heads kernel's bulk path.
pub const MBARRIER_SRC: &str = include_str!("../kernels/common/mbarrier.cuh");
/// The Hopper kernels' PTX wrappers (after [`MBARRIER_SRC`]).
pub const SM90_PTX_SRC: &str = include_str!("../kernels/sm90/ptx.cuh");
/// The Hopper kernels' pipelines (barrier arrays, pipeline state, pipeline).
pub const SM90_PIPELINE_SRC: &str = include_str!("../kernels/sm90/pipeline.cuh");
/// The Hopper forward kernel's tile scheduler.
pub const SM90_TILES_SRC: &str = include_str!("../kernels/sm90/tiles.cuh");
/// The Hopper forward kernel.
pub const SM90_FWD_SRC: &str = include_str!("../kernels/sm90/fwd.cu");
/// The e4m3 Hopper kernel's Vᵀ pass.
pub const SM90_VT_FP8_SRC: &str = include_str!("../kernels/sm90/vt_fp8.cu");
/// The Blackwell kernel's tcgen05 wrappers.
pub const SM100_TCGEN05_SRC: &str = include_str!("../kernels/sm100/tcgen05.cuh");
/// The Blackwell forward kernel (not run on hardware: see `config::sm100_kernel`).
pub const SM100_FWD_SRC: &str = include_str!("../kernels/sm100/fwd.cu");
/// Environment variable naming the cache folder.
pub const CACHE_DIR_ENV: &str = "FA4_CACHE_DIR";

/// A kernel NVRTC can build: its full source and target are pure functions of the spec, and
/// `Debug` names everything it is specialised on (part of the cache key).
pub trait KernelSource: std::fmt::Debug + std::fmt::Display {
    /// NVRTC target (`sm_90`, `sm_90a`, …): an exact architecture, so a cubin comes out.
    fn target(&self) -> &'static str;
    /// The generated prelude ([`crate::config::prelude::Prelude`]).
    fn prelude(&self) -> String;
    /// The family's own parts, in include order after the shared layer ([`COMMON_SRCS`]):
    /// headers, generated wrappers, then the kernel file.
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>>;
    /// The full source: prelude, the shared layer, the family's parts.
    fn source(&self) -> String {
        let mut parts: Vec<std::borrow::Cow<'static, str>> = vec![self.prelude().into()];
        parts.extend(COMMON_SRCS.iter().map(|s| std::borrow::Cow::Borrowed(*s)));
        parts.extend(self.family_sources());
        parts.join("\n")
    }
    /// The entry point.
    fn entry(&self) -> &'static str;
    /// Dynamic shared memory of a launch.
    fn smem_bytes(&self) -> usize;
    /// Registers per thread that the kernel's `setmaxnreg` split needs the CTA to be launched
    /// with (warp-specialised kernels: with fewer, a warpgroup's `setmaxnreg.inc` waits
    /// forever); `None` for kernels without `setmaxnreg`. Checked against what ptxas gave when
    /// the kernel is loaded ([`crate::cuda::CudaBackend::kernel`]).
    fn setmaxnreg_launch_regs(&self) -> Option<u32> {
        None
    }
    /// Whether the module holds the exact fixup kernel that the backend launches after each
    /// launch of its entry ([`crate::cuda::family::ExactFixup`]).
    fn exact_fixup(&self) -> bool {
        false
    }
    /// The module's entry points beside [`KernelSource::entry`].
    fn extra_entries(&self) -> &'static [&'static str] {
        if self.exact_fixup() {
            &[super::family::EXACT_FIXUP_ENTRY]
        } else {
            &[]
        }
    }
}

impl KernelSource for sm80::KernelSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        sm80::KernelSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        vec![
            SM80_PTX_SRC.into(),
            SM80_TILE_OPS_SRC.into(),
            EXACT_SRC.into(),
            SM80_FWD_SRC.into(),
        ]
    }
    fn exact_fixup(&self) -> bool {
        true
    }
    fn entry(&self) -> &'static str {
        sm80::KernelSpec::entry(self)
    }
    fn smem_bytes(&self) -> usize {
        sm80::KernelSpec::smem_bytes(self)
    }
}

impl KernelSource for sm90::KernelSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        sm90::KernelSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        let mut v: Vec<std::borrow::Cow<'static, str>> = vec![
            SM90_PARAMS_SRC.into(),
            MBARRIER_SRC.into(),
            SM90_PTX_SRC.into(),
            self.wgmma_wrappers().into(),
            SM90_PIPELINE_SRC.into(),
            SM90_TILES_SRC.into(),
            EXACT_SRC.into(),
            SM90_FWD_SRC.into(),
        ];
        if self.fp8 {
            // The e4m3 kernel's Vᵀ pass, a second entry of its module.
            v.push(SM90_VT_FP8_SRC.into());
        }
        v
    }
    fn exact_fixup(&self) -> bool {
        true
    }
    fn extra_entries(&self) -> &'static [&'static str] {
        sm90::KernelSpec::extra_entries(self)
    }
    fn entry(&self) -> &'static str {
        sm90::KernelSpec::entry(self)
    }
    fn smem_bytes(&self) -> usize {
        sm90::KernelSpec::smem_bytes(self)
    }
    fn setmaxnreg_launch_regs(&self) -> Option<u32> {
        Some(self.tiles.registers().div_ceil(self.tiles.threads() as u32))
    }
}

impl KernelSource for sm100_kernel::KernelSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        sm100_kernel::KernelSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        // The Hopper layer's TMA map, mbarrier and TMA wrappers run unchanged on sm_100a.
        vec![
            SM90_PARAMS_SRC.into(),
            MBARRIER_SRC.into(),
            SM90_PTX_SRC.into(),
            SM100_TCGEN05_SRC.into(),
            SM100_FWD_SRC.into(),
        ]
    }
    fn entry(&self) -> &'static str {
        sm100_kernel::KernelSpec::entry(self)
    }
    fn smem_bytes(&self) -> usize {
        sm100_kernel::KernelSpec::smem_bytes(self)
    }
}

/// The full source of a kernel.
pub fn source<S: KernelSource + ?Sized>(spec: &S) -> String {
    spec.source()
}

/// NVRTC options: a pure function of the spec.
pub fn options<S: KernelSource + ?Sized>(spec: &S) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", spec.target()),
        "--std=c++17".into(),
        "--device-as-default-execution-space".into(),
        "--fmad=true".into(),
    ]
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    libs::nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); both pointers are to live locals.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::cuda("nvrtcVersion", format!("{e:?}")))?;
    Ok((major, minor))
}

/// A compiled kernel and where it came from.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The cubin.
    pub cubin: Vec<u8>,
    /// Whether it came from the disk cache.
    pub cached: bool,
    /// Seconds spent (compiling, or reading the cache).
    pub seconds: f64,
}

/// Compiles with NVRTC, returning the cubin or the compiler's log.
pub fn compile_uncached<S: KernelSource + ?Sized>(spec: &S) -> Result<Vec<u8>> {
    compile_with_log(spec, &[]).map(|(cubin, _)| cubin)
}

/// Compiles with NVRTC and `extra` options after the spec's own (e.g. `--ptxas-options=-v` in
/// tests that check register use), returning the cubin and the compiler's log.
pub fn compile_with_log<S: KernelSource + ?Sized>(
    spec: &S,
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    libs::nvrtc()?;
    let src = source(spec);
    let mut opts = options(spec);
    opts.extend(extra.iter().map(|o| o.to_string()));
    let c_src = CString::new(src).map_err(|e| Error::invalid("kernel source", e.to_string()))?;
    let name = CString::new(format!("{}.cu", spec.entry())).expect("no NUL");
    let prog = nvrtc::create_program(&c_src, Some(&name))
        .map_err(|e| Error::cuda("nvrtcCreateProgram", format!("{e:?}")))?;
    // SAFETY: `prog` was created above and is destroyed once, below.
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let result = match compiled {
        Err(_) => Err(Error::Compile {
            spec: spec.to_string(),
            options: opts.clone(),
            log: log.clone(),
        }),
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; `size` and the buffer are live and sized by NVRTC.
            unsafe {
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| Error::cuda("nvrtcGetCUBINSize", format!("{e:?}")))
                    .and_then(|()| {
                        let mut buf = vec![0u8; size];
                        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                            .result()
                            .map_err(|e| Error::cuda("nvrtcGetCUBIN", format!("{e:?}")))
                            .map(|()| buf)
                    })
            }
        }
    };
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    match result {
        Ok(buf) if buf.is_empty() => Err(Error::Compile {
            spec: spec.to_string(),
            options: opts,
            log: format!(
                "NVRTC produced no cubin for {} (is it a real architecture?)",
                spec.target()
            ),
        }),
        r => r.map(|buf| (buf, log)),
    }
}

/// FNV-1a, 64-bit: a hash that is stable across Rust versions and platforms, for cache names and
/// the entries' checksums (one function for both, and no dependency). Each step
/// `h ← (h ⊕ byte) · prime` is a bijection of `h` and, for a given `h`, of the byte, so two
/// images of one length that differ in one byte always hash differently; other damage goes
/// unseen with probability about 2⁻⁶⁴ (the checksum guards against accidents, not an attacker
/// who can write the cache folder). It hashes about 0.45 GB/s, byte by byte, on the 2-core build
/// machine (2.3 ms per MiB, `rustc -O`, 2026-12-03), and an entry is hashed once per process and
/// kernel: a 68 KB sm_80 cubin in 0.15 ms, beside the seconds of NVRTC it saves. A faster hash
/// (xxh3, from a crate) would save less than a millisecond a kernel.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The cache folder: `$FA4_CACHE_DIR`, else `$XDG_CACHE_HOME/fa4`, else `~/.cache/fa4`, else a
/// folder in the temporary directory.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(CACHE_DIR_ENV) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("fa4");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("fa4");
    }
    std::env::temp_dir().join("fa4-cache")
}

/// The cache key of a spec: spec, options, NVRTC version and the whole source.
pub fn cache_key<S: KernelSource + ?Sized>(spec: &S) -> Result<String> {
    let (major, minor) = nvrtc_version()?;
    let text = format!(
        "{spec:?}|{:?}|nvrtc {major}.{minor}|{}",
        options(spec),
        source(spec)
    );
    Ok(format!("{}-{:016x}", spec.target(), fnv1a(text.as_bytes())))
}

/// The file of a spec's entry in the cache folder `dir`.
pub fn entry_path<S: KernelSource + ?Sized>(dir: &Path, spec: &S) -> Result<PathBuf> {
    Ok(dir.join(format!("{}.cubin", cache_key(spec)?)))
}

/// The first bytes of every cache entry.
pub const ENTRY_MAGIC: [u8; 8] = *b"FA4CUBIN";
/// The entry format this build writes and reads; any other is a miss.
pub const ENTRY_FORMAT: u32 = 1;
/// Header bytes before the image: magic (8), format (u32), reserved zero (u32), image length
/// (u64), FNV-1a of the image (u64), little-endian.
pub const ENTRY_HEADER_BYTES: usize = 32;

/// A cache entry for `image`: the header, then the image.
pub fn encode_entry(image: &[u8]) -> Vec<u8> {
    let mut e = Vec::with_capacity(ENTRY_HEADER_BYTES + image.len());
    e.extend_from_slice(&ENTRY_MAGIC);
    e.extend_from_slice(&ENTRY_FORMAT.to_le_bytes());
    e.extend_from_slice(&0u32.to_le_bytes());
    e.extend_from_slice(&(image.len() as u64).to_le_bytes());
    e.extend_from_slice(&fnv1a(image).to_le_bytes());
    e.extend_from_slice(image);
    e
}

/// The image an entry holds, or why it is not a valid entry.
pub fn decode_entry(entry: &[u8]) -> std::result::Result<&[u8], String> {
    if entry.is_empty() {
        return Err("the file is empty".into());
    }
    let Some((header, image)) = entry.split_at_checked(ENTRY_HEADER_BYTES) else {
        return Err(format!(
            "{} bytes, shorter than the {ENTRY_HEADER_BYTES}-byte header (damaged, or written \
             by an older fa4)",
            entry.len()
        ));
    };
    let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes"));
    if header[..8] != ENTRY_MAGIC {
        return Err("no fa4 cache header (damaged, or written by an older fa4)".into());
    }
    let format = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
    if format != ENTRY_FORMAT {
        return Err(format!(
            "cache format {format}; this fa4 reads format {ENTRY_FORMAT}"
        ));
    }
    let (len, sum) = (word(16), word(24));
    if len != image.len() as u64 {
        return Err(format!(
            "the header says {len} image bytes, the file holds {} (truncated or damaged)",
            image.len()
        ));
    }
    let got = fnv1a(image);
    if got != sum {
        return Err(format!(
            "checksum mismatch: the header says {sum:016x}, the image hashes to {got:016x} \
             (the file is damaged)"
        ));
    }
    Ok(image)
}

/// What the cache holds for one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A verified image.
    Hit(Vec<u8>),
    /// No entry.
    Absent,
    /// An entry that does not verify (or cannot be read), and why: a miss to be replaced.
    Invalid(String),
}

/// Reads and verifies the entry at `path`.
pub fn read_entry(path: &Path) -> Lookup {
    match std::fs::read(path) {
        Ok(bytes) => match decode_entry(&bytes) {
            Ok(image) => Lookup::Hit(image.to_vec()),
            Err(why) => Lookup::Invalid(why),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Lookup::Absent,
        Err(e) => Lookup::Invalid(format!("unreadable: {e}")),
    }
}

/// Writes the entry for `image` at `path`: to a temporary name beside it, then renamed into
/// place, so that a reader (another process compiling the same kernel) sees the old entry or
/// the new one, whole.
pub fn write_entry(path: &Path, image: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.{:x}.tmp",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("kernel"),
        std::process::id(),
        fnv1a(format!("{:?}", Instant::now()).as_bytes())
    ));
    std::fs::write(&tmp, encode_entry(image))
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// The one stderr line of an entry that is replaced.
fn say_replaced(path: &Path, why: &str) {
    eprintln!(
        "fa4: kernel cache: {}: {why}; recompiling the kernel and replacing the entry",
        path.display()
    );
}

/// The image of the entry at `path`: the cached one if it verifies, else `build()`'s, which is
/// then written there (an entry that did not verify is named on stderr, with why, and
/// replaced). A cache that cannot be written is not an error: the kernel still runs.
pub fn fetch_or_build(path: &Path, build: impl FnOnce() -> Result<Vec<u8>>) -> Result<Compiled> {
    let start = Instant::now();
    match read_entry(path) {
        Lookup::Hit(cubin) => {
            return Ok(Compiled {
                cubin,
                cached: true,
                seconds: start.elapsed().as_secs_f64(),
            })
        }
        Lookup::Absent => {}
        Lookup::Invalid(why) => say_replaced(path, &why),
    }
    let cubin = build()?;
    let _ = write_entry(path, &cubin);
    Ok(Compiled {
        cubin,
        cached: false,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The cubin of a spec: from the disk cache ([`cache_dir`]), or compiled and then cached.
pub fn compile<S: KernelSource + ?Sized>(spec: &S) -> Result<Compiled> {
    compile_in(&cache_dir(), spec)
}

/// [`compile`] with the cache in `dir`.
pub fn compile_in<S: KernelSource + ?Sized>(dir: &Path, spec: &S) -> Result<Compiled> {
    fetch_or_build(&entry_path(dir, spec)?, || compile_uncached(spec))
}

/// A spec's cubin compiled afresh after the driver refused its cached image (`why`: the
/// driver's error): the entry is removed, one line on stderr says so, and the new image is
/// written in its place.
pub fn recompile_refused<S: KernelSource + ?Sized>(spec: &S, why: &str) -> Result<Compiled> {
    recompile_refused_in(&cache_dir(), spec, why)
}

/// [`recompile_refused`] with the cache in `dir`.
pub fn recompile_refused_in<S: KernelSource + ?Sized>(
    dir: &Path,
    spec: &S,
    why: &str,
) -> Result<Compiled> {
    let path = entry_path(dir, spec)?;
    // Removed first: were the new entry not written (a read-only cache), the refused one
    // must not be read again.
    let _ = std::fs::remove_file(&path);
    say_replaced(
        &path,
        &format!("the CUDA driver refused the cached image ({why})"),
    );
    fetch_or_build(&path, || compile_uncached(spec))
}
