//! The kernel cache on a GPU (issue 30): an entry of a real variant overwritten with 100 random
//! bytes made every later call of that variant fail with `CUDA_ERROR_INVALID_IMAGE` until the
//! file was deleted. Now a forward call still succeeds, with the same output, and the entry is
//! replaced: a damaged entry fails its checksum (a miss), and an entry that verifies but that
//! the driver refuses is dropped, recompiled and loaded once more. Ignored unless run with
//! `--include-ignored` (or `--ignored`), and fails, not passes, where no GPU works. The
//! checksum half runs without a GPU in `tests/kernel_cache.rs` and `tests/nvrtc_compile.rs`.

use fa4::cuda::compile::{entry_path, read_entry, write_entry, Lookup, CACHE_DIR_ENV};
use fa4::cuda::CudaBackend;
use fa4::tensor::Layout;
use fa4::{Backend, DType, Options, Problem, Tensor, TensorMut};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("needs a CUDA GPU (run with --include-ignored only where one works): {e}"),
    }
}

/// The only test of this binary: it sets the cache folder for the process.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_damaged_or_refused_cache_entry_is_recompiled_and_replaced() {
    let dir = std::env::temp_dir().join(format!("fa4-cuda-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Set before any backend exists, in the only test of this binary: nothing else reads the
    // environment meanwhile.
    std::env::set_var(CACHE_DIR_ENV, &dir);

    let shape = [1, 256, 2, 64];
    let n: usize = shape.iter().product();
    let mut rng = StdRng::seed_from_u64(30);
    let mut qkv = vec![bf16::ZERO; 3 * n];
    fa4::check::random_fill(&mut rng, &mut qkv, shape[3], 1.0);
    let l = Layout::new("q", &shape, None).unwrap();
    let p = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &Options::new()).unwrap();
    let path = entry_path(&dir, gpu().plan(&p).unwrap().spec()).unwrap();
    // A new backend each time: a backend keeps the modules it loaded, so only a new one reads
    // the cache again.
    let forward = || -> Result<Vec<u16>, fa4::Error> {
        let backend = Backend::Cuda(gpu());
        let t = |i: usize| Tensor::new(&qkv[i * n..(i + 1) * n], &shape).unwrap();
        let mut o = vec![bf16::NAN; n];
        let mut out = TensorMut::new(&mut o, &shape).unwrap();
        backend.forward(&t(0), &t(1), &t(2), &mut out, None, &Options::new())?;
        Ok(o.iter().map(|x| x.to_bits()).collect())
    };
    let cubin = |what: &str| match read_entry(&path) {
        Lookup::Hit(img) if img.starts_with(b"\x7fELF") => img,
        other => panic!("{what}: the entry at {} is {other:?}", path.display()),
    };

    let clean = forward().expect("the first call compiles and runs");
    let first = cubin("after the first call");

    let random: Vec<u8> = (0..100).map(|_| rng.random()).collect();
    let full = std::fs::read(&path).unwrap();
    let not_loadable: Vec<u8> = (0..first.len()).map(|_| rng.random()).collect();
    for (what, damage) in [
        ("overwritten with 100 random bytes", Some(random)),
        ("truncated", Some(full[..full.len() / 2].to_vec())),
        ("a valid entry the driver refuses", None),
    ] {
        match damage {
            Some(bytes) => std::fs::write(&path, bytes).unwrap(),
            // The checksum is right; the image is not a cubin.
            None => {
                write_entry(&path, &not_loadable).unwrap();
                assert_eq!(read_entry(&path), Lookup::Hit(not_loadable.clone()));
            }
        }
        let out = forward().unwrap_or_else(|e| panic!("{what}: the call failed: {e}"));
        assert!(
            out == clean,
            "{what}: the output differs from the first call's"
        );
        let now = cubin(what);
        assert_eq!(now.len(), first.len(), "{what}: a different cubin");
        assert!(
            forward().is_ok(),
            "{what}: the replaced entry does not load"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
