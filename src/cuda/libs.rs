//! Finding the CUDA driver and NVRTC before cudarc touches them.
//!
//! cudarc loads both libraries lazily and panics when one is missing; fa4 looks first and turns
//! absence into [`Error::CudaUnavailable`] naming the library and every name and place tried.
//! NVRTC may also live outside the loader's path (a pip wheel `nvidia-cuda-nvrtc`, a toolkit
//! under `/usr/local/cuda`): a library found in one of the known folders is opened by absolute
//! path, together with its `libnvrtc-builtins`, so that cudarc's later open by name finds it
//! already loaded.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::error::{Error, Result};

/// Environment variable naming an extra folder that holds `libnvrtc.so.*`.
pub const NVRTC_DIR_ENV: &str = "FA4_NVRTC_DIR";

fn try_open(name: &Path) -> Option<Library> {
    // SAFETY: loading a shared library runs its initialisers; the CUDA driver and NVRTC are
    // vendor libraries whose initialisers have no preconditions.
    unsafe { Library::open(Some(name), RTLD_NOW | RTLD_GLOBAL) }.ok()
}

/// Folders searched for NVRTC beyond the loader's own path.
fn nvrtc_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os(NVRTC_DIR_ENV) {
        dirs.push(PathBuf::from(d));
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// The file names a CUDA library goes by on Linux, unversioned first. fa4 keeps its own list
/// rather than cudarc's `get_lib_name_candidates`, which exists only when cudarc loads
/// libraries itself: a program that also links candle's CUDA backend builds cudarc with
/// `dynamic-linking` instead (see the `fallback-dynamic-loading` note in Cargo.toml).
fn lib_name_candidates(library: &str) -> Vec<String> {
    let mut names = vec![format!("lib{library}.so")];
    names.extend(["13", "12", "11", "10", "9", "1"].map(|v| format!("lib{library}.so.{v}")));
    names
}

fn load(library: &str, extra_dirs: &[PathBuf], hint: &str) -> Result<()> {
    let names = lib_name_candidates(library);
    let mut tried = Vec::new();
    for n in &names {
        if let Some(lib) = try_open(Path::new(n)) {
            std::mem::forget(lib);
            return Ok(());
        }
        tried.push(n.clone());
    }
    for dir in extra_dirs {
        for n in &names {
            let path = dir.join(n);
            if !path.is_file() {
                continue;
            }
            // NVRTC opens its builtins library by name at compile time; open it by path first.
            if let Ok(entries) = std::fs::read_dir(dir) {
                for e in entries.flatten() {
                    let f = e.file_name();
                    let f = f.to_string_lossy();
                    if f.starts_with("libnvrtc-builtins.so") && !f.contains(".alt.") {
                        if let Some(b) = try_open(&e.path()) {
                            std::mem::forget(b);
                        }
                    }
                }
            }
            if let Some(lib) = try_open(&path) {
                std::mem::forget(lib);
                return Ok(());
            }
            tried.push(path.display().to_string());
        }
        tried.push(format!("{}/*", dir.display()));
    }
    Err(Error::CudaUnavailable {
        library: format!("lib{library}"),
        tried: tried.join(", "),
        hint: hint.to_string(),
    })
}

/// Makes sure the driver library can be loaded (once per process).
pub fn driver() -> Result<()> {
    static DRIVER: OnceLock<Result<()>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            load(
                "cuda",
                &[],
                "install the NVIDIA driver, or use the CPU backend",
            )
        })
        .clone()
}

/// Makes sure NVRTC can be loaded (once per process).
pub fn nvrtc() -> Result<()> {
    static NVRTC: OnceLock<Result<()>> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            load(
                "nvrtc",
                &nvrtc_dirs(),
                "install NVRTC (e.g. `pip install nvidia-cuda-nvrtc`) and put its lib folder on \
                 LD_LIBRARY_PATH or in FA4_NVRTC_DIR",
            )
        })
        .clone()
}
