//! Fuzzing the `.npy` reader: valid files of every supported type and rank, then mutated (bytes
//! flipped, cut, inserted; headers rewritten from the format's own tokens). Loading never panics;
//! a rejection is an error on one line; an accepted file holds exactly what its shape says.
//!
//! Bounded for CI: 10,000 mutated files per run, each decoded, one in four also read back from a
//! file (seconds in release, under 30 s on a heavily loaded 2-core machine). Inputs are fresh each run, as proptest draws them; a failing input is
//! shrunk, printed and saved beside this file to be replayed first by later runs.

use fa4::npy::{self, Array, Data};
use half::f16;
use proptest::prelude::*;

/// A valid file: dtype 0..3 (f32, f16, i32), a shape of rank 0..=4 with small extents.
fn valid_file() -> impl Strategy<Value = Vec<u8>> {
    (0u8..3, prop::collection::vec(0usize..5, 0..=4)).prop_map(|(t, shape)| {
        let n: usize = shape.iter().product();
        match t {
            0 => npy::encode(&shape, &vec![1.5f32; n]),
            1 => npy::encode(&shape, &vec![f16::from_f32(-2.0); n]),
            _ => npy::encode(&shape, &vec![7i32; n]),
        }
        .expect("a consistent shape encodes")
    })
}

/// Tokens the header grammar is made of, and some it is not, to reach every parser branch.
const TOKENS: &[&str] = &[
    "{",
    "}",
    "(",
    ")",
    "[",
    "]",
    ",",
    ":",
    " ",
    "\n",
    "'",
    "\"",
    "'descr'",
    "'shape'",
    "'fortran_order'",
    "'<f4'",
    "'<f2'",
    "'<i4'",
    "'>f4'",
    "'<f8'",
    "'|b1'",
    "True",
    "False",
    "0",
    "1",
    "7",
    "-1",
    "18446744073709551616",
    "4294967296",
    "é",
    "\u{0}",
    "\u{1b}[2J",
    "x",
];

/// One way to damage a file.
#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the byte at (position mod length).
    Set(usize, u8),
    /// Keep only the first (n mod length) bytes.
    Truncate(usize),
    /// Insert bytes at (position mod length).
    Insert(usize, Vec<u8>),
    /// Replace the header text (after the 10-byte v1 preamble) with tokens, keeping the length
    /// field consistent or not.
    Header(Vec<usize>, bool),
    /// Rewrite the 16- or 32-bit header length field.
    HeaderLen(u32),
    /// Set the format version.
    Version(u8, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        3 => (prop::collection::vec(0..TOKENS.len(), 0..24), any::<bool>())
            .prop_map(|(t, fix)| Mutation::Header(t, fix)),
        1 => any::<u32>().prop_map(Mutation::HeaderLen),
        1 => (0u8..5, 0u8..2).prop_map(|(a, b)| Mutation::Version(a, b)),
    ]
}

fn apply(mut b: Vec<u8>, m: &Mutation) -> Vec<u8> {
    match m {
        Mutation::Set(i, x) => {
            if !b.is_empty() {
                let n = b.len();
                b[i % n] = *x;
            }
        }
        Mutation::Truncate(n) => b.truncate(n % (b.len() + 1)),
        Mutation::Insert(i, x) => {
            let at = i % (b.len() + 1);
            b.splice(at..at, x.iter().copied());
        }
        Mutation::Header(tokens, fix_len) => {
            if b.len() >= 10 {
                let old_len = usize::from(u16::from_le_bytes([b[8], b[9]]));
                let data = b.split_off((10 + old_len).min(b.len()));
                b.truncate(10);
                let text: String = tokens.iter().map(|&t| TOKENS[t]).collect();
                b.extend_from_slice(text.as_bytes());
                if *fix_len {
                    let len = u16::try_from(text.len()).unwrap_or(u16::MAX);
                    b[8..10].copy_from_slice(&len.to_le_bytes());
                }
                b.extend_from_slice(&data);
            }
        }
        Mutation::HeaderLen(len) => {
            if b.len() >= 12 {
                if b[6] == 1 {
                    b[8..10].copy_from_slice(&(*len as u16).to_le_bytes());
                } else {
                    b[8..12].copy_from_slice(&len.to_le_bytes());
                }
            }
        }
        Mutation::Version(major, minor) => {
            if b.len() >= 8 {
                b[6] = *major;
                b[7] = *minor;
            }
        }
    }
    b
}

fn len_of(a: &Array) -> usize {
    match &a.data {
        Data::F32(x) => x.len(),
        Data::F16(x) => x.len(),
        Data::I32(x) => x.len(),
        Data::U8(x) => x.len(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_load_or_fail_on_one_line(
        file in valid_file(),
        muts in prop::collection::vec(mutation(), 1..4),
        read_back in prop::bool::weighted(0.25),
    ) {
        let bytes = muts.iter().fold(file, apply);
        let decoded = npy::decode(&bytes, "--q");
        // Reading the same bytes from a file (bounded by what the header declares) agrees. One
        // case in four: file I/O, not parsing, is what takes the time on a busy machine.
        if read_back {
            let path =
                std::env::temp_dir().join(format!("fa4-npy-fuzz-{}.npy", std::process::id()));
            std::fs::write(&path, &bytes).unwrap();
            let read = npy::read(&path, "--q");
            let _ = std::fs::remove_file(&path);
            // Compared as text: NaN ≠ NaN.
            prop_assert_eq!(
                format!("{:?}", read.as_ref().ok()),
                format!("{:?}", decoded.as_ref().ok())
            );
            prop_assert_eq!(read.is_err(), decoded.is_err());
        }
        match decoded {
            Ok(a) => {
                let n = a.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
                prop_assert_eq!(n, Some(len_of(&a)), "shape {:?}", a.shape);
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(!msg.contains('\n') && !msg.contains('\r'), "{:?}", msg);
                prop_assert!(msg.contains("`--q`"), "{}", msg);
                prop_assert!(msg.chars().count() < 1200, "{} chars", msg.chars().count());
            }
        }
    }
}

/// The header's raw text is echoed escaped: a newline or an escape sequence in it does not reach
/// the terminal as such (the message used to hold the raw bytes and a newline).
#[test]
fn malformed_header_messages_are_one_escaped_line() {
    let header = "{'descr': '<f4',\n\u{1b}[2J 'shape': (1,), }\n";
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&[0; 4]);
    let msg = npy::decode(&b, "--q").unwrap_err().to_string();
    assert!(msg.contains("malformed"), "{msg}");
    assert!(!msg.contains('\n') && !msg.contains('\u{1b}'), "{msg:?}");
    assert!(msg.contains("\\n") && msg.contains("\\u{1b}"), "{msg}");
}

/// Reading is bounded by what the header declares: an endless device or a file whose header
/// declares more than memory holds is an error, never an unbounded read.
#[cfg(unix)]
#[test]
fn reads_stop_where_the_header_says() {
    let e = npy::read(std::path::Path::new("/dev/zero"), "--q").unwrap_err();
    assert!(e.to_string().contains("not a .npy file"), "{e}");
    let dir = std::env::temp_dir().join(format!("fa4-npy-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A header declaring 2⁶⁰ float32 elements over 4 bytes of data.
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1152921504606846976,), }\n";
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&[0; 4]);
    let p = dir.join("huge.npy");
    std::fs::write(&p, &b).unwrap();
    let e = npy::read(&p, "--q").unwrap_err().to_string();
    assert!(e.contains("holds 4 bytes of data"), "{e}");
    // A good file still reads, and one byte too many is noticed.
    let good = npy::encode(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
    std::fs::write(&p, &good).unwrap();
    assert_eq!(npy::read(&p, "--q").unwrap().len(), 3);
    std::fs::write(&p, [good.as_slice(), &[0]].concat()).unwrap();
    let e = npy::read(&p, "--q").unwrap_err().to_string();
    assert!(e.contains("holds 13 bytes of data"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
