//! The kernel cache's entries on disk (`src/cuda/compile.rs`): an entry that does not verify
//! (overwritten with random bytes, truncated, one byte changed, empty, written by an older fa4
//! without the header) is a miss, and after the recompile path the entry verifies again. Bytes
//! only: no NVRTC and no GPU (the build is a stand-in closure), so this runs in CI. The real
//! compile path is `tests/nvrtc_compile.rs`'s `a_damaged_cache_entry_is_compiled_again`; the
//! driver's refusal of a cached image, `tests/cuda_kernel_cache.rs` (GPU, ignored elsewhere).

use std::cell::Cell;
use std::path::{Path, PathBuf};

use fa4::cuda::compile::{
    decode_entry, encode_entry, fetch_or_build, read_entry, write_entry, Lookup,
    ENTRY_HEADER_BYTES, ENTRY_MAGIC,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A fresh folder of this test's own (removed when dropped).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let d =
            std::env::temp_dir().join(format!("fa4-kernel-cache-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("a temporary folder");
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A stand-in cubin: an ELF magic and `len` bytes drawn from `seed`.
fn image(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut v = b"\x7fELF".to_vec();
    v.extend((0..len).map(|_| rng.random::<u8>()));
    v
}

/// `fetch_or_build` with a build that returns `img` and counts its calls.
fn fetch(path: &Path, img: &[u8], builds: &Cell<usize>) -> fa4::cuda::compile::Compiled {
    fetch_or_build(path, || {
        builds.set(builds.get() + 1);
        Ok(img.to_vec())
    })
    .expect("the stand-in build does not fail")
}

#[test]
fn an_entry_round_trips_and_is_a_hit() {
    let dir = TempDir::new("round-trip");
    let path = dir.0.join("sm_90a-0000000000000000.cubin");
    let img = image(5000, 1);
    assert_eq!(decode_entry(&encode_entry(&img)), Ok(&img[..]));
    assert_eq!(read_entry(&path), Lookup::Absent);
    let builds = Cell::new(0);
    let first = fetch(&path, &img, &builds);
    assert!(!first.cached && builds.get() == 1);
    let second = fetch(&path, &img, &builds);
    assert!(second.cached, "a written entry is read back");
    assert_eq!(builds.get(), 1, "a hit does not build");
    assert_eq!(second.cubin, img);
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk.len(), ENTRY_HEADER_BYTES + img.len());
    assert_eq!(on_disk[..8], ENTRY_MAGIC);
    // The temporary file the entry was written through is gone.
    let names: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

/// Each way an entry goes bad, as the bytes it leaves on disk.
fn damaged(entry: &[u8], img: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = StdRng::seed_from_u64(30);
    let mut one_byte = entry.to_vec();
    let at = ENTRY_HEADER_BYTES + img.len() / 2;
    one_byte[at] ^= 0x10;
    let mut bad_len = entry.to_vec();
    bad_len[16] ^= 1;
    let mut bad_sum = entry.to_vec();
    bad_sum[24] ^= 1;
    let mut format_2 = entry.to_vec();
    format_2[8] = 2;
    let mut trailing = entry.to_vec();
    trailing.extend_from_slice(b"junk");
    vec![
        // The case: on an H200 this made every call of the variant fail with
        // CUDA_ERROR_INVALID_IMAGE until the file was deleted.
        ("100 random bytes", (0..100).map(|_| rng.random()).collect()),
        (
            "random bytes of the entry's length",
            (0..entry.len()).map(|_| rng.random()).collect(),
        ),
        ("truncated by one byte", entry[..entry.len() - 1].to_vec()),
        ("truncated to half", entry[..entry.len() / 2].to_vec()),
        ("truncated inside the header", entry[..10].to_vec()),
        ("one image byte changed", one_byte),
        ("the length field changed", bad_len),
        ("the checksum field changed", bad_sum),
        ("another format version", format_2),
        ("bytes after the image", trailing),
        ("empty", Vec::new()),
        ("an older fa4's entry: the bare cubin", img.to_vec()),
    ]
}

#[test]
fn a_damaged_entry_is_a_miss_and_verifies_after_the_recompile() {
    let dir = TempDir::new("damaged");
    let path = dir.0.join("sm_80-0123456789abcdef.cubin");
    let img = image(20_000, 2);
    let entry = encode_entry(&img);
    for (what, bytes) in damaged(&entry, &img) {
        std::fs::write(&path, &bytes).unwrap();
        match read_entry(&path) {
            Lookup::Invalid(why) => assert!(!why.is_empty(), "{what}"),
            other => panic!("{what}: read as {other:?}"),
        }
        assert!(decode_entry(&bytes).is_err(), "{what}");
        let builds = Cell::new(0);
        let got = fetch(&path, &img, &builds);
        assert!(!got.cached, "{what}: served from a damaged entry");
        assert_eq!(builds.get(), 1, "{what}: not rebuilt");
        assert_eq!(got.cubin, img, "{what}");
        assert_eq!(
            read_entry(&path),
            Lookup::Hit(img.clone()),
            "{what}: not replaced"
        );
        assert_eq!(std::fs::read(&path).unwrap(), entry, "{what}");
        let again = fetch(&path, &img, &builds);
        assert!(
            again.cached && builds.get() == 1,
            "{what}: the new entry is not a hit"
        );
    }
}

#[test]
fn the_reason_says_what_is_wrong() {
    let img = image(3000, 3);
    let entry = encode_entry(&img);
    let why = |bytes: &[u8]| decode_entry(bytes).unwrap_err();
    assert!(why(&[]).contains("empty"));
    assert!(why(&img).contains("no fa4 cache header"), "{}", why(&img));
    assert!(why(&entry[..entry.len() - 1]).contains("truncated"));
    let mut flipped = entry.clone();
    *flipped.last_mut().unwrap() ^= 1;
    assert!(
        why(&flipped).contains("checksum mismatch"),
        "{}",
        why(&flipped)
    );
    let mut v2 = entry.clone();
    v2[8] = 2;
    assert!(why(&v2).contains("format 2"), "{}", why(&v2));
}

#[test]
fn an_unwritable_cache_is_not_an_error() {
    let dir = TempDir::new("unwritable");
    // A folder where the entry should be: it cannot be read as an entry nor replaced.
    let path = dir.0.join("sm_90a-feedfacefeedface.cubin");
    std::fs::create_dir_all(&path).unwrap();
    assert!(matches!(read_entry(&path), Lookup::Invalid(_)));
    assert!(write_entry(&path, b"x").is_err());
    let img = image(100, 4);
    let builds = Cell::new(0);
    let got = fetch(&path, &img, &builds);
    assert!(!got.cached && got.cubin == img && builds.get() == 1);
    let left: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "a temporary file was left: {left:?}");
}

#[test]
fn a_failed_build_leaves_the_damaged_entry_for_the_next_try() {
    let dir = TempDir::new("failed-build");
    let path = dir.0.join("sm_90a-0000000000000001.cubin");
    std::fs::write(&path, b"garbage").unwrap();
    let r = fetch_or_build(&path, || {
        Err(fa4::Error::invalid("kernel", "stand-in failure"))
    });
    assert!(r.is_err());
    // Still a miss: the next call compiles again.
    assert!(matches!(read_entry(&path), Lookup::Invalid(_)));
}
