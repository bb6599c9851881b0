//! `fa4 plan` end to end: the JSON form reproduces the contract's table; bad input is one line
//! on stderr and exit code 2.

use std::process::Command;

fn fa4(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fa4"))
        .args(args)
        .output()
        .expect("the fa4 binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn json_reproduces_every_worked_row() {
    // dtype, depth, BM, pd, BN, S1, C0, C1, O0, O1, tmem_used, kv_stages, smem_used, supported
    let rows = [
        (
            "bf16", "64", 256, 64, 192, 192, 96, 288, 384, 448, 512, 8, 229_628, true,
        ),
        (
            "bf16", "128", 256, 128, 128, 128, 64, 192, 256, 384, 512, 5, 229_580, true,
        ),
        (
            "fp16", "256", 128, 256, 256, 1_048_576, 128, 1_048_704, 256, 1_048_832, 512, 1,
            196_748, false,
        ),
        (
            "fp8", "128", 256, 128, 128, 128, 64, 192, 256, 384, 512, 12, 229_692, true,
        ),
        (
            "fp8", "256", 128, 256, 256, 1_048_576, 128, 1_048_704, 256, 1_048_832, 512, 3,
            229_548, true,
        ),
    ];
    for (dt, d, bm, pd, bn, s1, c0, c1, o0, o1, tmem, kv, smem, ok) in rows {
        let (code, out, err) = fa4(&[
            "plan", "--depth", d, "--dtype", dt, "--group", "4", "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
        let want = serde_json::json!({
            "BM": bm, "padded_depth": pd, "BN": bn, "TMEM_S1": s1, "TMEM_C0": c0, "TMEM_C1": c1,
            "TMEM_O0": o0, "TMEM_O1": o1, "tmem_used": tmem, "num_kv_stages": kv,
            "smem_used": smem, "supported": ok, "split_m": d == "256", "swizzle_mode": "128B",
            "num_kv_heads": 8, "num_q_heads": 32, "group": 4,
        });
        for (k, w) in want.as_object().unwrap() {
            assert_eq!(&v[k], w, "{dt} d={d}: key {k}");
        }
    }
}

#[test]
fn report_shows_tmem_map_budget_and_verdict() {
    let (code, out, _) = fa4(&["plan", "--depth", "256"]);
    assert_eq!(code, 0);
    for needle in [
        "tensor memory",
        "O1",
        "1048832",
        "[256, 512)",
        "smem_used",
        "196748",
        "supported: no",
        "K/V stage",
    ] {
        assert!(out.contains(needle), "report lacks {needle:?}:\n{out}");
    }
    let (_, out, _) = fa4(&["plan", "--depth", "128"]);
    assert!(out.contains("supported: yes"), "{out}");
}

#[test]
fn bad_arguments_are_one_line_and_exit_2() {
    let cases: [(&[&str], &str); 9] = [
        (&["plan", "--depth", "0"], "depth"),
        (&["plan", "--depth", "-4"], "depth"),
        (&["plan", "--depth", "abc"], "depth"),
        (&["plan", "--depth", "64", "--group", "3"], "group"),
        (&["plan", "--depth", "64", "--group", "0"], "group"),
        (
            &["plan", "--depth", "64", "--num-q-heads", "0"],
            "num_q_heads",
        ),
        (&["plan", "--depth", "64", "--dtype", "int4"], "dtype"),
        (&["plan", "--depth", "64", "--swizzle", "16B"], "swizzle"),
        (&["plan"], "depth"),
    ];
    for (args, name) in cases {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?} printed to stdout: {out}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: not one line:\n{err}"
        );
        assert!(
            err.contains(name),
            "{args:?}: error does not name {name}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn sm90_plan_reports_roles_budgets_and_the_kernel_choice() {
    let (code, out, err) = fa4(&["plan", "--arch", "sm90", "--depth", "96", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["dispatch"]["kernel"], "sm80");
    assert!(v["dispatch"]["reason"]
        .as_str()
        .unwrap()
        .contains("head_dim 96"));
    assert!(v.get("roles").is_none(), "no Hopper plan for d96: {v}");

    let (code, out, err) = fa4(&["plan", "--arch", "sm90", "--depth", "128", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["head_dim"], 128);
    assert_eq!(v["dispatch"]["kernel"], "sm90", "{v}");
    assert_eq!(v["roles"].as_array().map(Vec::len), Some(3));
    assert_eq!(v["roles"][0]["role"], "producer");
    let total = v["smem_total"].as_u64().unwrap();
    assert!(total <= v["smem_limit"].as_u64().unwrap());
    let s = &v["smem"];
    let parts: u64 = ["q", "k", "v", "barriers", "align_slack"]
        .iter()
        .map(|k| s[*k].as_u64().unwrap())
        .sum();
    assert_eq!(parts, total);
    assert!(v["dispatch"]["kernel"].is_string());
    assert!(!v["dispatch"]["reason"].as_str().unwrap().is_empty());

    let (code, out, _) = fa4(&["plan", "--arch", "sm90", "--depth", "128", "--varlen"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("wg2 consumer") && out.contains("warps 8-11"),
        "{out}"
    );
    assert!(
        out.contains("kernel for this problem: sm90 (") && out.contains("variable-length batch"),
        "{out}"
    );
    // Varlen batches take one CTA per tile, also where a fixed-length one would be persistent.
    let (code, out, _) = fa4(&[
        "plan", "--arch", "sm90", "--depth", "128", "--varlen", "--seqlen", "1024",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("launch: one CTA per tile (varlen"), "{out}");

    // Per sequence length: d64 takes 128-row tiles and the persistent launch at 1k, 192-row
    // tiles and one CTA per tile at 16k.
    let tiles = |seqlen: &str| {
        let (code, out, err) = fa4(&[
            "plan", "--arch", "sm90", "--depth", "64", "--seqlen", seqlen, "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        (
            v["block_m"].as_u64().unwrap(),
            v["tiles"]["persistent"].as_bool().unwrap(),
        )
    };
    assert_eq!(tiles("1024"), (128, true));
    assert_eq!(tiles("16384"), (192, false));
    let (code, out, _) = fa4(&[
        "plan", "--arch", "sm90", "--depth", "128", "--seqlen", "2048",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("launch: persistent"), "{out}");

    let (code, out, _) = fa4(&["plan", "--arch", "sm90", "--depth", "512"]);
    assert_eq!(code, 0);
    assert!(out.contains("kernel for this problem: cpu"), "{out}");

    for (args, name) in [
        (&["plan", "--arch", "sm90", "--depth", "0"][..], "--depth"),
        (
            &["plan", "--arch", "sm90", "--depth", "64", "--group", "3"][..],
            "--group",
        ),
        (&["plan", "--depth", "64", "--varlen"][..], "--varlen"),
        (
            &["plan", "--depth", "64", "--seqlen", "100"][..],
            "--seqlen",
        ),
        (
            &["plan", "--arch", "sm90", "--depth", "64", "--seqlen", "0"][..],
            "--seqlen",
        ),
    ] {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {out}");
        assert!(err.contains(&format!("`{name}`")), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// `fa4 plan --compile` compiles the SM100 kernel (NVRTC, no GPU) and reports what the cubin
/// needs; its shared memory is the plan's smem_used. Skipped (and said so) without NVRTC, unless
/// FA4_REQUIRE_NVRTC=1.
#[test]
fn plan_compile_reports_the_sm100_cubin() {
    if fa4::cuda::compile::nvrtc_version().is_err() {
        assert!(
            std::env::var("FA4_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "FA4_REQUIRE_NVRTC=1 but NVRTC is missing"
        );
        eprintln!("plan_compile_reports_the_sm100_cubin: skipped: no NVRTC");
        return;
    }
    for (depth, dtype) in [("128", "bf16"), ("80", "fp16")] {
        let (code, out, err) = fa4(&[
            "plan",
            "--depth",
            depth,
            "--dtype",
            dtype,
            "--compile",
            "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        let c = &v["compiled"];
        assert_eq!(c["target"], "sm_100a");
        assert_eq!(c["smem_bytes"], v["smem_used"], "{out}");
        let regs = c["registers"].as_u64().unwrap();
        assert!(regs > 0 && regs <= 128, "{regs}");
        assert!(c["cubin_bytes"].as_u64().unwrap() > 10_000);
    }
    let (code, out, _) = fa4(&["plan", "--depth", "64", "--compile"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("NOT RUN ON HARDWARE") && out.contains("229628 bytes"),
        "{out}"
    );
}

#[test]
fn plan_compile_refuses_what_it_cannot_build_and_compiles_nothing() {
    for (args, flag) in [
        (&["plan", "--depth", "256", "--compile"][..], "--depth"),
        (
            &["plan", "--depth", "128", "--dtype", "fp8", "--compile"][..],
            "--dtype",
        ),
        (
            &["plan", "--depth", "128", "--dtype", "f32", "--compile"][..],
            "--dtype",
        ),
        (
            &["plan", "--arch", "sm90", "--depth", "128", "--compile"][..],
            "--compile",
        ),
    ] {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(out.is_empty(), "{args:?} printed {out}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
