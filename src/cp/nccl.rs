//! NCCL between GPUs: finding the library, communicators, and the ring's send/recv.
//!
//! # Finding NCCL
//!
//! cudarc's `nccl` module (feature `nccl`, with `dynamic-loading`) opens the library by name
//! only, from a fixed list (`libnccl.so`, `libnccl.so.13`, `.12`, …, `.1`) that has no
//! `libnccl.so.2`, the one name every NCCL 2 install provides (the `nvidia-nccl-cu12/13` wheels
//! and PyTorch ship only `libnccl.so.2`), and it panics when none opens. fa4 therefore uses
//! cudarc's NCCL types (`ncclUniqueId`, `ncclComm_t`, `ncclDataType_t`) but opens the library
//! itself, by absolute path where it finds one (no symlink needed), and resolves the dozen
//! functions the ring uses from that handle. It tries, in order:
//!
//! 1. `$FA4_NCCL_LIB`: a path to the library file, or a folder holding `libnccl.so.2`;
//! 2. `libnccl.so.2` and `libnccl.so` through the loader's path (`LD_LIBRARY_PATH`, the system
//!    folders: a distribution's `libnccl2` package);
//! 3. `nvidia/nccl/lib/libnccl.so.2` under the Python package folders of `$VIRTUAL_ENV`,
//!    `$CONDA_PREFIX`, `~/.local` and `/usr(/local)/lib/python3*/{site,dist}-packages` (the pip
//!    wheels `nvidia-nccl-cu12`/`-cu13`, which PyTorch depends on).
//!
//! A missing library is [`Error::CudaUnavailable`] listing every path tried.
//!
//! # Communicators
//!
//! [`NcclRing::all`]: one process driving every GPU, all communicators created by one
//! `ncclCommInitAll` (one group). [`NcclRing::rank`]: one process per GPU, the caller handing
//! the [`UniqueId`] from [`unique_id`] on rank 0 to the others (its 128 bytes, by any means).
//!
//! NVLink multicast (NVLS) is never asked for: the ring uses only send/recv, and the device
//! scripts set `NCCL_NVLS_ENABLE=0` so that NCCL does not create multicast objects either.

use std::ffi::{c_int, c_void, CStr};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclUniqueId};
use libloading::os::unix::{Library, Symbol, RTLD_LOCAL, RTLD_NOW};

use crate::error::{Error, Result};
use crate::tensor::Element;

use super::transport::Transport;

/// Environment variable: the NCCL library file, or a folder holding `libnccl.so.2`.
pub const NCCL_LIB_ENV: &str = "FA4_NCCL_LIB";

/// The first NCCL with point-to-point send/recv (2.7.0, version code 2700).
const MIN_VERSION: c_int = 2700;

// NCCL's C signatures. Results are read as plain ints (an enum would be undefined behaviour for
// a code this build does not know).
type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitAllFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type CommDestroyFn = unsafe extern "C" fn(ncclComm_t) -> c_int;
type GroupFn = unsafe extern "C" fn() -> c_int;
type SendFn = unsafe extern "C" fn(
    *const c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    *mut c_void,
) -> c_int;
type RecvFn = unsafe extern "C" fn(
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    *mut c_void,
) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const std::ffi::c_char;

/// The loaded library and the functions the ring uses.
pub struct Nccl {
    path: String,
    version: c_int,
    get_unique_id: GetUniqueIdFn,
    comm_init_all: CommInitAllFn,
    comm_init_rank: CommInitRankFn,
    comm_destroy: CommDestroyFn,
    group_start: GroupFn,
    group_end: GroupFn,
    send: SendFn,
    recv: RecvFn,
    error_string: ErrorStringFn,
    // Keeps the functions above valid: the library is never unloaded.
    _lib: Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({} {})", self.path, self.version_string())
    }
}

fn python_lib_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    roots.push("/usr/local/lib".into());
    roots.push("/usr/lib".into());
    let mut dirs = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pys.sort();
        for py in pys {
            for pk in ["site-packages", "dist-packages"] {
                dirs.push(py.join(pk).join("nvidia/nccl/lib"));
            }
        }
    }
    dirs
}

/// The candidates, in the order the module docs give.
fn candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(v) = std::env::var_os(NCCL_LIB_ENV) {
        let p = PathBuf::from(v);
        if p.is_dir() {
            c.push(p.join("libnccl.so.2"));
            c.push(p.join("libnccl.so"));
        } else {
            c.push(p);
        }
    }
    c.push("libnccl.so.2".into());
    c.push("libnccl.so".into());
    for d in python_lib_dirs() {
        c.push(d.join("libnccl.so.2"));
    }
    c
}

fn open(path: &Path) -> std::result::Result<Library, String> {
    // SAFETY: opening NCCL runs its initialisers, which have no preconditions.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| e.to_string())
}

fn symbol<F: Copy>(lib: &Library, path: &str, name: &str) -> Result<F> {
    // SAFETY: `F` is the C signature of `name` in nccl.h (NCCL ≥ 2.7, checked by the caller
    // through ncclGetVersion before any other function is called).
    let s: Symbol<F> = unsafe { lib.get(name.as_bytes()) }.map_err(|e| Error::CudaUnavailable {
        library: "libnccl".into(),
        tried: path.to_string(),
        hint: format!("it has no `{name}` ({e}); NCCL ≥ 2.7 is needed"),
    })?;
    Ok(*s)
}

impl Nccl {
    /// The process's NCCL, loaded on first use (see the module docs for where it looks).
    pub fn get() -> Result<&'static Nccl> {
        static NCCL: OnceLock<std::result::Result<Nccl, Error>> = OnceLock::new();
        NCCL.get_or_init(Nccl::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Nccl> {
        let mut tried = Vec::new();
        for path in candidates() {
            // Paths with a folder must exist; bare names go to the loader's search.
            if path.components().count() > 1 && !path.is_file() {
                tried.push(format!("{} (absent)", path.display()));
                continue;
            }
            match open(&path) {
                Ok(lib) => return Nccl::from_library(lib, &path.display().to_string()),
                Err(e) => tried.push(format!("{} ({e})", path.display())),
            }
        }
        Err(Error::CudaUnavailable {
            library: "libnccl".into(),
            tried: tried.join("; "),
            hint: format!(
                "install NCCL (`pip install nvidia-nccl-cu13`, or the system's libnccl2) and set \
                 {NCCL_LIB_ENV} to its libnccl.so.2 or put its folder on LD_LIBRARY_PATH"
            ),
        })
    }

    fn from_library(lib: Library, path: &str) -> Result<Nccl> {
        let get_version: GetVersionFn = symbol(&lib, path, "ncclGetVersion")?;
        let mut version: c_int = 0;
        // SAFETY: ncclGetVersion writes one int through a valid pointer.
        let rc = unsafe { get_version(&mut version) };
        if rc != 0 || version < MIN_VERSION {
            return Err(Error::CudaUnavailable {
                library: "libnccl".into(),
                tried: path.into(),
                hint: format!(
                    "it reports version code {version} (status {rc}); the ring needs send/recv, \
                     NCCL ≥ 2.7"
                ),
            });
        }
        Ok(Nccl {
            path: path.into(),
            version,
            get_unique_id: symbol(&lib, path, "ncclGetUniqueId")?,
            comm_init_all: symbol(&lib, path, "ncclCommInitAll")?,
            comm_init_rank: symbol(&lib, path, "ncclCommInitRank")?,
            comm_destroy: symbol(&lib, path, "ncclCommDestroy")?,
            group_start: symbol(&lib, path, "ncclGroupStart")?,
            group_end: symbol(&lib, path, "ncclGroupEnd")?,
            send: symbol(&lib, path, "ncclSend")?,
            recv: symbol(&lib, path, "ncclRecv")?,
            error_string: symbol(&lib, path, "ncclGetErrorString")?,
            _lib: lib,
        })
    }

    /// Where the library was found.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `major.minor.patch`.
    pub fn version_string(&self) -> String {
        let v = self.version;
        // Codes are major·10000 + minor·100 + patch since 2.9, major·1000 + minor·100 + patch
        // before.
        if v >= 20900 {
            format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, v / 100 % 10, v % 100)
        }
    }

    fn check(&self, op: &str, rc: c_int) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static C string for any code.
        let msg = unsafe { CStr::from_ptr((self.error_string)(rc)) }
            .to_string_lossy()
            .into_owned();
        Err(Error::cuda(op, format!("NCCL error {rc}: {msg}")))
    }
}

/// The 128-byte id that names one NCCL communicator: made on one rank ([`unique_id`]) and
/// handed to the others by the caller (a file, a socket, MPI), then [`NcclRing::rank`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}…)", &self.0[..8])
    }
}

/// A fresh communicator id (call on one rank, hand it to the others).
pub fn unique_id() -> Result<UniqueId> {
    let nccl = Nccl::get()?;
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: ncclGetUniqueId writes one ncclUniqueId through a valid pointer.
    nccl.check("ncclGetUniqueId", unsafe { (nccl.get_unique_id)(&mut id) })?;
    Ok(UniqueId(id.internal.map(|c| c as u8)))
}

/// A ring of `N` ranks over NCCL, driving the local ranks' communicators. Blocks are lists of
/// device buffers (a rank's K and V pieces), sent and received in one group.
///
/// Completion is in stream order: after [`Transport::shift`] the receives are enqueued on the
/// local ranks' communication streams ([`NcclRing::stream`]); work that reads a received block
/// must wait for an event recorded there, and the sent block must not be overwritten before the
/// send completes on that stream.
pub struct NcclRing<T> {
    nccl: &'static Nccl,
    comms: Vec<ncclComm_t>,
    ranks: Vec<usize>,
    world: usize,
    streams: Vec<Arc<CudaStream>>,
    /// Elements of each buffer of each rank's block: `counts[rank][buffer]`.
    counts: Vec<Vec<usize>>,
    _t: PhantomData<T>,
}

impl<T> std::fmt::Debug for NcclRing<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRing")
            .field("ranks", &self.ranks)
            .field("world", &self.world)
            .field("nccl", &self.nccl)
            .finish()
    }
}

// SAFETY: NCCL communicators may be used from any thread, one thread at a time (which `&mut
// self` on every use ensures).
unsafe impl<T> Send for NcclRing<T> {}

fn check_counts(world: usize, counts: &[Vec<usize>]) -> Result<()> {
    if counts.len() != world || counts.iter().any(|c| c.len() != counts[0].len()) {
        return Err(Error::invalid(
            "counts",
            format!("one list of the same number of buffer sizes per rank, {world} ranks"),
        ));
    }
    Ok(())
}

impl<T: Element> NcclRing<T> {
    /// One process driving `streams.len()` GPUs, rank `i` on `streams[i]`'s device; the
    /// streams carry the exchanges (use non-blocking streams apart from the compute streams for
    /// overlap). `counts[r]` are the element counts of rank `r`'s block buffers.
    pub fn all(streams: Vec<Arc<CudaStream>>, counts: Vec<Vec<usize>>) -> Result<Self> {
        let nccl = Nccl::get()?;
        let n = streams.len();
        check_counts(n, &counts)?;
        let devs: Vec<c_int> = streams
            .iter()
            .map(|s| s.context().ordinal() as c_int)
            .collect();
        let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for `n` communicators and `devs` holds `n` device ordinals;
        // ncclCommInitAll creates all of them in one group (it cannot deadlock on itself).
        nccl.check("ncclCommInitAll", unsafe {
            (nccl.comm_init_all)(comms.as_mut_ptr(), n as c_int, devs.as_ptr())
        })?;
        Ok(NcclRing {
            nccl,
            comms,
            ranks: (0..n).collect(),
            world: n,
            streams,
            counts,
            _t: PhantomData,
        })
    }

    /// Rank `rank` of `world`, one process per GPU, on `stream`'s device; `id` is the same on
    /// every rank. Blocks until every rank has joined.
    pub fn rank(
        stream: Arc<CudaStream>,
        id: &UniqueId,
        rank: usize,
        world: usize,
        counts: Vec<Vec<usize>>,
    ) -> Result<Self> {
        if rank >= world {
            return Err(Error::invalid(
                "rank",
                format!("{rank} is not below the world size {world}"),
            ));
        }
        check_counts(world, &counts)?;
        let nccl = Nccl::get()?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let id = ncclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: one communicator is written through a valid pointer; the current device is
        // the stream's (bound above), the one NCCL attaches the communicator to.
        nccl.check("ncclCommInitRank", unsafe {
            (nccl.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int)
        })?;
        Ok(NcclRing {
            nccl,
            comms: vec![comm],
            ranks: vec![rank],
            world,
            streams: vec![stream],
            counts,
            _t: PhantomData,
        })
    }

    /// The communication stream of the `i`-th local rank.
    pub fn stream(&self, i: usize) -> &Arc<CudaStream> {
        &self.streams[i]
    }
}

impl<T: Element> Transport for NcclRing<T> {
    type Block = Vec<CudaSlice<T>>;

    fn world_size(&self) -> usize {
        self.world
    }

    fn local_ranks(&self) -> Vec<usize> {
        self.ranks.clone()
    }

    fn shift(
        &mut self,
        step: usize,
        send: &[Vec<CudaSlice<T>>],
        recv: &mut [Vec<CudaSlice<T>>],
    ) -> Result<()> {
        let (n, local) = (self.world, self.ranks.len());
        if send.len() != local || recv.len() != local {
            return Err(Error::invalid(
                "send",
                format!(
                    "{} send and {} receive blocks for {local} local ranks",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        // Validate every buffer before the group starts, so an error never leaves it open.
        let bytes = std::mem::size_of::<T>();
        for (i, &r) in self.ranks.iter().enumerate() {
            let (from, held) = ((r + n - step) % n, (r + 2 * n - 1 - step % n) % n);
            let (sc, rc) = (&self.counts[from], &self.counts[held]);
            let fits = |bufs: &[CudaSlice<T>], counts: &[usize]| {
                bufs.len() == counts.len() && bufs.iter().zip(counts).all(|(b, &c)| b.len() >= c)
            };
            if !fits(&send[i], sc) || !fits(&recv[i], rc) {
                return Err(Error::invalid(
                    "send",
                    format!("rank {r} step {step}: block buffers smaller than the counts"),
                ));
            }
        }
        let nccl = self.nccl;
        // SAFETY: no buffers or pointers are involved.
        nccl.check("ncclGroupStart", unsafe { (nccl.group_start)() })?;
        let mut result = Ok(());
        for (i, &r) in self.ranks.iter().enumerate() {
            let (from, held) = ((r + n - step) % n, (r + 2 * n - 1 - step % n) % n);
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let stream = &self.streams[i];
            let raw_stream = stream.cu_stream() as *mut c_void;
            for (buf, &count) in send[i].iter().zip(&self.counts[from]) {
                let (ptr, _sync) = buf.device_ptr(stream);
                // SAFETY: `ptr` holds at least `count` elements (checked above) on this comm's
                // device; bytes are sent as uint8 (no arithmetic on them). The buffer outlives
                // the call; the caller orders later writes after this stream (type docs).
                let rc = unsafe {
                    (nccl.send)(
                        ptr as *const c_void,
                        count * bytes,
                        ncclDataType_t::ncclUint8,
                        next as c_int,
                        self.comms[i],
                        raw_stream,
                    )
                };
                result = result.and(nccl.check("ncclSend", rc));
            }
            for (buf, &count) in recv[i].iter_mut().zip(&self.counts[held]) {
                let (ptr, _sync) = buf.device_ptr_mut(stream);
                // SAFETY: as for the send, with room for `count` elements.
                let rc = unsafe {
                    (nccl.recv)(
                        ptr as *mut c_void,
                        count * bytes,
                        ncclDataType_t::ncclUint8,
                        prev as c_int,
                        self.comms[i],
                        raw_stream,
                    )
                };
                result = result.and(nccl.check("ncclRecv", rc));
            }
        }
        // Always close the group, even after an error inside it.
        // SAFETY: matches the ncclGroupStart above.
        let end = nccl.check("ncclGroupEnd", unsafe { (nccl.group_end)() });
        result.and(end)
    }
}

impl<T> Drop for NcclRing<T> {
    fn drop(&mut self) {
        for &c in &self.comms {
            // SAFETY: each communicator was created by this ring and is destroyed once.
            unsafe { (self.nccl.comm_destroy)(c) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nccl_names_every_path_tried() {
        // On a machine without NCCL (CI) the search fails and says what it tried, with a hint
        // naming the variable; where NCCL is installed there is nothing to check here.
        if Nccl::get().is_ok() {
            return;
        }
        match Nccl::get().unwrap_err() {
            Error::CudaUnavailable {
                library,
                tried,
                hint,
            } => {
                assert_eq!(library, "libnccl");
                assert!(tried.contains("libnccl.so.2"), "{tried}");
                assert!(hint.contains(NCCL_LIB_ENV), "{hint}");
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn candidates_start_with_the_variable_and_the_so_2_name() {
        let c = candidates();
        assert!(c.iter().any(|p| p == Path::new("libnccl.so.2")));
        let i2 = c
            .iter()
            .position(|p| p == Path::new("libnccl.so.2"))
            .unwrap();
        let i0 = c.iter().position(|p| p == Path::new("libnccl.so")).unwrap();
        assert!(i2 < i0);
    }
}
