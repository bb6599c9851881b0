//! `fa4 plan` end to end: the JSON form reproduces the contract's table; bad input is one line
//! on stderr and exit code 2.

mod common;
use common::fa4;

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
        (&["plan", "--depth", "0"], "--depth"),
        (&["plan", "--depth", "-4"], "--depth"),
        (&["plan", "--depth", "abc"], "--depth"),
        (&["plan", "--depth", "64", "--group", "3"], "--group"),
        (&["plan", "--depth", "64", "--group", "0"], "--group"),
        (
            &["plan", "--depth", "64", "--num-q-heads", "0"],
            "--num-q-heads",
        ),
        (&["plan", "--depth", "64", "--dtype", "int4"], "--dtype"),
        (&["plan", "--depth", "64", "--swizzle", "16B"], "--swizzle"),
        (&["plan"], "--depth"),
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
    // Off the multiples of 8 there is no Hopper plan, and the dispatch says why.
    let (code, out, err) = fa4(&["plan", "--arch", "sm90", "--depth", "100", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["dispatch"]["kernel"], "sm80");
    assert!(v["dispatch"]["reason"]
        .as_str()
        .unwrap()
        .contains("head_dim 100"));
    assert!(v.get("roles").is_none(), "no Hopper plan for d100: {v}");
    // d96 is padded to 128-column tiles, its slabs loaded through 4-D maps.
    let (code, out, err) = fa4(&["plan", "--arch", "sm90", "--depth", "96", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["dispatch"]["kernel"], "sm90", "{v}");
    assert_eq!(
        (v["padded_head_dim"].as_u64(), v["slab_maps"][0].as_bool()),
        (Some(128), Some(true))
    );
    // MLA prefill: 192 for Q·Kᵀ, 128 for V.
    let (code, out, err) = fa4(&[
        "plan",
        "--arch",
        "sm90",
        "--depth",
        "192",
        "--depth-v",
        "128",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("head_dim 192/128") && out.contains("kernel for this problem: sm90"),
        "{out}"
    );
    // --depth-v elsewhere, or wider than --depth, is named.
    let (code, _, err) = fa4(&["plan", "--depth", "128", "--depth-v", "64"]);
    assert!(code == 2 && err.contains("--depth-v"), "{err}");
    let (code, out, _) = fa4(&[
        "plan",
        "--arch",
        "sm90",
        "--depth",
        "64",
        "--depth-v",
        "128",
    ]);
    assert!(
        code == 0 && out.contains("no Hopper plan") && out.contains("wider"),
        "{out}"
    );

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
    // Causal d64 takes the dynamic schedule; d128 keeps its static walk.
    let (code, out, _) = fa4(&[
        "plan", "--arch", "sm90", "--depth", "64", "--causal", "--seqlen", "2048",
    ]);
    assert_eq!(code, 0);
    assert!(
        out.contains("tile 128×128") && out.contains("launch: persistent, dynamic"),
        "{out}"
    );
    let (code, out, _) = fa4(&[
        "plan", "--arch", "sm90", "--depth", "128", "--causal", "--seqlen", "2048",
    ]);
    assert_eq!(code, 0);
    assert!(
        out.contains("launch: persistent (one CTA per SM walks"),
        "{out}"
    );
    // Varlen batches take the dynamic schedule, at any sequence length.
    for seqlen in ["1024", "16384"] {
        let (code, out, _) = fa4(&[
            "plan", "--arch", "sm90", "--depth", "128", "--varlen", "--seqlen", seqlen,
        ]);
        assert_eq!(code, 0);
        assert!(out.contains("launch: persistent, dynamic"), "{out}");
    }

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
        // Past the Hopper kernels' int32 TMA coordinates (2^30 rows): no plan, not a wrap.
        (
            &[
                "plan",
                "--arch",
                "sm90",
                "--depth",
                "64",
                "--seqlen",
                "1073741824",
            ][..],
            "--seqlen",
        ),
        (
            &[
                "plan",
                "--arch",
                "sm90",
                "--depth",
                "128",
                "--seqlen",
                "18446744073709551615",
            ][..],
            "--seqlen",
        ),
    ] {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {out}");
        assert!(err.contains(&format!("`{name}`")), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// `fa4 plan --arch sm90 --dtype fp8`: the e4m3 kernel's launch as `plan_fp8` plans it (tiles,
/// warpgroups, shared memory for 1-byte operands), the Vᵀ pass and its scratch, in the report and
/// in `--json`; what the e4m3 kernel does not take is an error naming the flag.
#[test]
fn sm90_fp8_plan_reports_the_e4m3_kernel_and_its_vt_pass() {
    use fa4::config::sm90::fp8::{plan_fp8, vt_smem_bytes, VT_ENTRY};
    use fa4::problem::{Options, Problem};
    use fa4::tensor::Layout;

    // Without --seqlen: the first-choice tiles (d128: 256-key blocks, ping-pong), scratch per key.
    let (code, out, err) = fa4(&["plan", "--arch", "sm90", "--dtype", "fp8", "--depth", "128"]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "e4m3 forward plan",
        "tile 128×256",
        "2 K/Vᵀ stages",
        "wg2 consumer",
        "ping-pong between consumers: on",
        "Vᵀ pass (fa4_vt_fp8",
        "Vᵀ 128 bytes per key (the keys padded with zeros to 256-key blocks), descales 12 bytes",
        "kernel for this problem: sm90 (",
    ] {
        assert!(out.contains(needle), "report lacks {needle:?}:\n{out}");
    }

    // The JSON is the library's plan of the same problem: one head, 1000 rows and keys.
    let v = json(&[
        "plan", "--arch", "sm90", "--dtype", "fp8", "--depth", "128", "--seqlen", "1000", "--json",
    ]);
    let l = Layout::new("q", &[1, 1000, 1, 128], None).unwrap();
    let p = Problem::new_fp8(
        fa4::DType::Bf16,
        &l,
        &l,
        &l,
        &l,
        None,
        None,
        &Options::new(),
    )
    .unwrap();
    let f = plan_fp8(&p, &fa4::arch::H200, "sm_90a", None).unwrap();
    let t = f.plan.spec.tiles;
    assert_eq!(v["dispatch"]["kernel"], "sm90", "{v}");
    assert_eq!(v["tiles"]["block_n"].as_u64(), Some(t.block_n as u64));
    assert_eq!(v["tiles"]["persistent"].as_bool(), Some(t.persistent));
    assert_eq!(v["tiles"]["tma_store"], false);
    assert_eq!(v["block_m"].as_u64(), Some(t.block_m() as u64));
    assert_eq!(
        v["roles"].as_array().map(Vec::len),
        Some(1 + t.consumer_wgs)
    );
    assert!(v["roles"][0]["work"].as_str().unwrap().contains("K and Vᵀ"));
    assert_eq!(
        v["smem_total"].as_u64(),
        Some(f.plan.spec.smem_bytes() as u64)
    );
    let parts: u64 = ["q", "k", "v", "barriers", "align_slack"]
        .iter()
        .map(|k| v["smem"][*k].as_u64().unwrap())
        .sum();
    assert_eq!(parts, v["smem_total"].as_u64().unwrap());
    assert!(v["smem_total"].as_u64() <= v["smem_limit"].as_u64());
    let vt = &v["fp8"];
    assert_eq!(vt["entry"], VT_ENTRY);
    assert_eq!(vt["smem_bytes"].as_u64(), Some(vt_smem_bytes(128) as u64));
    assert_eq!(vt["seq_cols"].as_u64(), Some(f.vt_seq_keys as u64));
    assert_eq!(vt["vt_bytes"].as_u64(), Some(128 * f.vt_seq_keys as u64));
    assert_eq!(vt["descale_bytes"], 12);
    // Without a length the scratch is per key only.
    let v = json(&[
        "plan", "--arch", "sm90", "--dtype", "fp8", "--depth", "128", "--json",
    ]);
    assert!(
        v["fp8"]["seq_cols"].is_null() && v["fp8"]["vt_bytes"].is_null(),
        "{v}"
    );
    // 16-bit plans carry no Vᵀ pass.
    let v = json(&["plan", "--arch", "sm90", "--depth", "128", "--json"]);
    assert!(v.get("fp8").is_none(), "{v}");

    // d64: three consumer warpgroups, Vᵀ of 64 rows; Q and K padded to one 128-column slab.
    let v = json(&[
        "plan", "--arch", "sm90", "--dtype", "fp8", "--depth", "64", "--seqlen", "4096", "--json",
    ]);
    assert_eq!(v["tiles"]["consumer_wgs"], 3, "{v}");
    assert_eq!(
        (
            v["padded_head_dim"].as_u64(),
            v["padded_head_dim_v"].as_u64()
        ),
        (Some(128), Some(64))
    );
    assert_eq!(v["slab_maps"][0], true);
    assert_eq!(v["fp8"]["rows"], 64);
    // Varlen batches: the dynamic schedule, at most two consumer warpgroups.
    let v = json(&[
        "plan", "--arch", "sm90", "--dtype", "fp8", "--depth", "64", "--varlen", "--seqlen",
        "4096", "--json",
    ]);
    assert_eq!(v["varlen"], true);
    assert_eq!(v["tiles"]["dynamic"], true, "{v}");
    assert!(v["tiles"]["consumer_wgs"].as_u64() <= Some(2));
    // MLA prefill shapes, causal.
    let (code, out, err) = fa4(&[
        "plan",
        "--arch",
        "sm90",
        "--dtype",
        "fp8",
        "--depth",
        "192",
        "--depth-v",
        "128",
        "--causal",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("head_dim 192/128 (compiled for 256/128)"),
        "{out}"
    );

    for (args, flag) in [
        (&["--depth", "100"][..], "--depth"),
        (&["--depth", "72"][..], "--depth"),
        (&["--depth", "512"][..], "--depth"),
        (&["--depth", "64", "--depth-v", "128"][..], "--depth-v"),
        (&["--depth", "128", "--depth-v", "100"][..], "--depth-v"),
        (&["--depth", "128", "--seqlen", "0"][..], "--seqlen"),
        (
            &["--depth", "128", "--seqlen", "2000000000"][..],
            "--seqlen",
        ),
        (&["--depth", "128", "--group", "2"][..], "--group"),
        (&["--depth", "128", "--backward"][..], "--dtype"),
    ] {
        let mut a = vec!["plan", "--arch", "sm90", "--dtype", "fp8"];
        a.extend_from_slice(args);
        let (code, out, err) = fa4(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(out.is_empty(), "{a:?} printed {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{a:?}: {err}");
        assert!(err.contains(&format!("`{flag}`")), "{a:?}: {err}");
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

fn json(args: &[&str]) -> serde_json::Value {
    let (code, out, err) = fa4(args);
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}"))
}

/// `fa4 plan --backward --json` names the main kernel's family (`sm90`, `sm80`, `cpu`) beside
/// the prose, and plans packed (`--varlen`) batches: on sm90 the Hopper kernel runs them (its
/// `varlen` variant), the Ampere-class kernels the deterministic mode and everything on sm80;
/// d96 runs the Hopper kernel in tiles of 128, d192 and d256 in tiles of 256 (shared keys).
#[test]
fn backward_plan_names_its_family_and_plans_packed_batches() {
    let family = |extra: &[&str]| {
        let mut a = vec!["plan", "--backward", "--json"];
        a.extend_from_slice(extra);
        let v = json(&a);
        (v["family"].as_str().unwrap_or("").to_string(), v)
    };
    assert_eq!(family(&["--depth", "128"]).0, "sm90");
    let (f, v) = family(&["--depth", "96", "--causal"]);
    assert_eq!(f, "sm90", "{v}");
    assert_eq!(v["padded_head_dim"], 128);
    assert_eq!(family(&["--depth", "256"]).0, "sm90");
    let (f, v) = family(&["--depth", "192", "--causal"]);
    assert_eq!(f, "sm90", "{v}");
    assert_eq!(v["padded_head_dim"], 256);
    // The deterministic mode runs the Hopper kernel too, with the same launches.
    let (f, v) = family(&["--depth", "128", "--deterministic"]);
    assert_eq!(f, "sm90", "{v}");
    assert_eq!(v["launches"][2]["kernel"], "convert", "{v}");
    assert!(
        v["dq_accumulation"]
            .as_str()
            .unwrap()
            .contains("fixed order of key blocks"),
        "{v}"
    );
    assert!(
        v["kernels"].as_str().unwrap().contains("deterministic"),
        "{v}"
    );
    assert_eq!(family(&["--arch", "sm80", "--depth", "64"]).0, "sm80");
    assert_eq!(family(&["--arch", "cpu", "--depth", "64"]).0, "cpu");
    // Packed: 3 sequences of 500 x 700, their launches over the longest.
    let (f, v) = family(&[
        "--depth",
        "64",
        "--varlen",
        "--batch",
        "3",
        "--seqlen-q",
        "500",
        "--seqlen-k",
        "700",
    ]);
    assert_eq!(f, "sm90", "{v}");
    let kernels = v["kernels"].as_str().unwrap();
    assert!(
        kernels.contains("d64 128x128 24+2x240 regs varlen"),
        "{kernels}"
    );
    // Each sequence padded to whole blocks of 128 rows in one packed entry: 3 · 500 + 3 · 128
    // rounded down to a block.
    assert!(kernels.contains("1792 padded rows"), "{kernels}");
    assert!(
        v["problem"]
            .as_str()
            .unwrap()
            .contains("batch 3 packed (varlen), seqlen 500 x 700"),
        "{v}"
    );
    let main = &v["launches"][1];
    assert_eq!(main["kernel"], "main", "{v}");
    // The same packed batch on the CPU: its work items count every sequence.
    let (f, _) = family(&["--arch", "cpu", "--depth", "64", "--varlen", "--batch", "3"]);
    assert_eq!(f, "cpu");
    // V narrower than Q (192/128): the Hopper kernel in the shared-keys tiles, both modes (the
    // Ampere-class kernels' refusal below).
    for det in [&[][..], &["--deterministic"][..]] {
        let mut a = vec!["--depth", "192", "--depth-v", "128", "--causal"];
        a.extend_from_slice(det);
        let (f, v) = family(&a);
        assert_eq!(f, "sm90", "{v}");
        assert!(
            v["problem"]
                .as_str()
                .unwrap()
                .contains("head_dim 192 (v: 128)"),
            "{v}"
        );
        assert!(
            v["kernels"]
                .as_str()
                .unwrap()
                .contains("d192/128 (tiles d256)"),
            "{v}"
        );
    }
    for a in [
        &["--depth", "192", "--depth-v", "128", "--arch", "sm80"][..],
        &["--depth", "128", "--depth-v", "256"][..],
        &["--depth", "192", "--depth-v", "12"][..],
    ] {
        let mut args = vec!["plan", "--backward"];
        args.extend_from_slice(a);
        let (code, _, err) = fa4(&args);
        assert_eq!(code, 2, "{a:?}: {err}");
        assert!(err.contains("`--depth-v`"), "{a:?}: {err}");
    }
}

/// `fa4 plan --backward`: the three launches with the tiles of the documented table
/// (docs/backward.md: d64 128 keys x 64 queries, d128 128 x 32, d256 64 x 32 in two column
/// groups), grids worked out by hand for the problem, and what `--deterministic` swaps.
#[test]
fn backward_plan_lists_the_launches_their_tiles_and_grids() {
    // Defaults: batch 1, seqlen 1024, 8 query heads; --heads-kv 2 (GQA 4).
    let v = json(&[
        "plan",
        "--backward",
        "--depth",
        "128",
        "--heads-kv",
        "2",
        "--json",
    ]);
    assert_eq!(v["arch"], "sm90", "{v}");
    assert_eq!(v["target"], "sm_90");
    assert_eq!(v["deterministic"], false);
    // The Hopper main kernel covers d128 here: its bulk reduce-add, then the Ampere-class one's.
    let dq = v["dq_accumulation"].as_str().unwrap();
    assert!(
        dq.contains("cp.reduce.async.bulk") && dq.contains("red.global.add.v2.f32"),
        "{dq}"
    );
    let l = v["launches"].as_array().unwrap();
    let kernels: Vec<&str> = l.iter().map(|x| x["kernel"].as_str().unwrap()).collect();
    assert_eq!(kernels, ["pre", "main", "convert"]);
    // pre/convert: 4 warps, 16 lanes per row at d128 (8 rows per CTA), over 1024 rows and 8
    // query heads.
    assert_eq!(l[0]["grid"], serde_json::json!([128, 8, 1]));
    assert_eq!(l[0]["warps"], 4);
    assert_eq!(l[2]["grid"], serde_json::json!([128, 8, 1]));
    // main: 128 keys per CTA over 1024 keys and 2 KV heads.
    assert_eq!(
        (&l[1]["block_n"], &l[1]["block_m"], &l[1]["warps"]),
        (
            &serde_json::json!(128),
            &serde_json::json!(32),
            &serde_json::json!(8)
        )
    );
    assert_eq!(l[1]["grid"], serde_json::json!([8, 2, 1]));
    assert!(l[1]["tiles_reason"].as_str().unwrap().contains("spill"));
    assert_eq!(l[0]["smem_bytes"], 0);
    let smem = l[1]["smem_bytes"].as_u64().unwrap();
    assert!(smem > 0 && smem <= 227 * 1024, "{smem}");
    assert_eq!(
        v["workspace_bytes"]["dq_accumulator"],
        1024 * 8 * 128 * 4,
        "f32 per row, head and column"
    );
    assert_eq!(v["workspace_bytes"]["d"], 1024 * 8 * 4);
    // The other mode on sm90 runs the Hopper kernel with the same launches.
    assert_eq!(v["other_mode"]["launches"][2]["kernel"], "convert");

    // Deterministic on the Ampere-class kernels (sm80): dq replaces convert (64 rows per
    // CTA), no accumulator.
    let d = json(&[
        "plan",
        "--backward",
        "--deterministic",
        "--arch",
        "sm80",
        "--depth",
        "128",
        "--heads-kv",
        "2",
        "--json",
    ]);
    let l = d["launches"].as_array().unwrap();
    assert_eq!(l[2]["kernel"], "dq");
    assert_eq!(l[2]["grid"], serde_json::json!([16, 8, 1]));
    assert_eq!(
        (&l[2]["block_m"], &l[2]["block_n"]),
        (&serde_json::json!(64), &serde_json::json!(64))
    );
    assert_eq!(d["workspace_bytes"]["dq_accumulator"], 0);
    assert_eq!(d["other_mode"]["launches"][2]["kernel"], "convert");
    assert_eq!(
        l[1]["grid"], v["launches"][1]["grid"],
        "main's grid does not change"
    );

    // d256 (head dim 200 is padded to it): 64 keys, two column groups; the A100 reduces dQ
    // with scalar reductions; a varlen-free batch of 3 sequences of 100 x 300.
    let a = json(&[
        "plan",
        "--backward",
        "--arch",
        "sm80",
        "--depth",
        "200",
        "--dtype",
        "fp16",
        "--batch",
        "3",
        "--seqlen-q",
        "100",
        "--seqlen-k",
        "300",
        "--heads-q",
        "4",
        "--causal",
        "--json",
    ]);
    assert_eq!(a["target"], "sm_80");
    assert_eq!(a["padded_head_dim"], 256);
    let dq = a["dq_accumulation"].as_str().unwrap();
    assert!(
        dq.contains("red.global.add.f32") && !dq.contains("v2"),
        "{dq}"
    );
    let m = &a["launches"][1];
    assert_eq!(
        (&m["block_n"], &m["dsplit"]),
        (&serde_json::json!(64), &serde_json::json!(2))
    );
    assert_eq!(m["grid"], serde_json::json!([5, 4, 3]));
    assert_eq!(a["launches"][0]["grid"], serde_json::json!([25, 4, 3]));
    assert!(m["smem_bytes"].as_u64().unwrap() <= 163 * 1024);
    assert!(m["spec"].as_str().unwrap().contains("window"), "{m}");
}

#[test]
fn backward_plan_report_explains_the_choices() {
    let (code, out, err) = fa4(&["plan", "--backward", "--depth", "64", "--softcap", "30"]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "Ampere-class",
        "the Hopper backward (kernels/bwd_sm90",
        "replaces launch 2 below",
        "persistent CTAs (at most one per SM)",
        "launch 3 reads those tiles whole",
        "fa4_bwd_pre",
        "rowsum(dO∘O)",
        "fa4_bwd_main",
        "128 keys x 64 queries",
        "fa4_bwd_convert",
        "red.global.add.v2.f32",
        "cp.reduce.async.bulk",
        "with --deterministic: the Hopper main kernel adds dQ in a fixed order",
        "tiles:",
        "softcap 30",
    ] {
        assert!(out.contains(needle), "report lacks {needle:?}:\n{out}");
    }
    let (code, out, _) = fa4(&[
        "plan",
        "--backward",
        "--deterministic",
        "--arch",
        "sm80",
        "--depth",
        "128",
    ]);
    assert_eq!(code, 0);
    assert!(
        out.contains("fa4_bwd_dq")
            && out.contains("without --deterministic")
            && !out.contains("fa4_bwd_convert  ")
            && !out.contains("accumulator zeroed"),
        "{out}"
    );
}

/// `--arch cpu`: 96 x 96 tiles shrunk to the sequence, the two passes' work items.
#[test]
fn backward_plan_for_the_cpu() {
    let v = json(&[
        "plan",
        "--backward",
        "--arch",
        "cpu",
        "--depth",
        "64",
        "--dtype",
        "f32",
        "--heads-kv",
        "2",
        "--json",
    ]);
    assert_eq!(
        (&v["block_m"], &v["block_n"]),
        (&serde_json::json!(96), &serde_json::json!(96))
    );
    // 1024 rows: 11 blocks of 96; pass 1 per KV head (2), pass 2 per query head (8).
    assert_eq!(v["passes"][0]["items"], 22);
    assert_eq!(v["passes"][1]["items"], 88);
    assert_eq!(v["deterministic"], true);
    let v = json(&[
        "plan",
        "--backward",
        "--arch",
        "cpu",
        "--depth",
        "64",
        "--seqlen-q",
        "50",
        "--seqlen-k",
        "500",
        "--json",
    ]);
    assert_eq!(
        (&v["block_m"], &v["block_n"]),
        (&serde_json::json!(50), &serde_json::json!(96))
    );
    assert_eq!(v["passes"][0]["items"], 6 * 8);
    let (code, out, _) = fa4(&[
        "plan",
        "--backward",
        "--arch",
        "cpu",
        "--depth",
        "64",
        "--deterministic",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("changes nothing"), "{out}");
}

#[test]
fn backward_plan_refuses_what_it_would_ignore_or_cannot_plan() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["plan", "--depth", "64", "--deterministic"],
            "--deterministic",
        ),
        (&["plan", "--depth", "64", "--causal"], "--causal"),
        (&["plan", "--depth", "64", "--arch", "sm80"], "--arch"),
        (&["plan", "--depth", "64", "--arch", "cpu"], "--arch"),
        (
            &["plan", "--backward", "--depth", "64", "--arch", "sm100"],
            "--arch",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--num-q-heads", "8"],
            "--num-q-heads",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--group", "2"],
            "--group",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--seqlen", "9"],
            "--seqlen",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--compile"],
            "--compile",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--decode"],
            "--decode",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--num-splits", "2"],
            "--num-splits",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--swizzle", "64B"],
            "--swizzle",
        ),
        (&["plan", "--backward", "--depth", "0"], "--depth"),
        (&["plan", "--backward", "--depth", "512"], "--depth"),
        (&["plan", "--backward", "--depth", "36"], "--depth"),
        (
            &["plan", "--backward", "--depth", "64", "--dtype", "f32"],
            "--dtype",
        ),
        (
            &[
                "plan",
                "--backward",
                "--depth",
                "64",
                "--dtype",
                "fp8",
                "--arch",
                "cpu",
            ],
            "--dtype",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--heads-kv", "3"],
            "--heads-kv",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--seqlen-q", "0"],
            "--seqlen-q",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--batch", "0"],
            "--batch",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--heads-q", "70000"],
            "--heads-q",
        ),
        (
            &[
                "plan",
                "--backward",
                "--depth",
                "64",
                "--batch",
                "70000",
                "--seqlen-q",
                "1",
            ],
            "--batch",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--softcap", "-1"],
            "--softcap",
        ),
        (
            &[
                "plan",
                "--backward",
                "--depth",
                "64",
                "--causal",
                "--window",
                "3,0",
            ],
            "--window",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--window", "x"],
            "--window",
        ),
    ];
    for &(args, flag) in cases {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(out.is_empty(), "{args:?} printed {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains(flag),
            "{args:?}: error does not name {flag}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Issue 30: `fa4 plan --depth 0` said `invalid argument \`depth\``, FA4Config's name, not the
/// flag typed. Every form of `fa4 plan` (SM100, `--arch sm90`, `--backward`, `--decode`) names
/// the flag as typed, `--depth`, `--num-q-heads`, …, in backticks, and no library name (`depth`,
/// `num_q_heads`, `heads_kv`) anywhere in the line; the decode form refuses the flags it would
/// ignore.
#[test]
fn every_plan_form_names_the_flag_as_typed() {
    let cases: &[(&[&str], &str)] = &[
        (&["plan", "--depth", "0"], "--depth"),
        (&["plan", "--depth", "0", "--json"], "--depth"),
        (&["plan", "--depth", "0", "--compile"], "--depth"),
        (
            &["plan", "--depth", "64", "--num-q-heads", "0"],
            "--num-q-heads",
        ),
        (&["plan", "--depth", "64", "--group", "0"], "--group"),
        // The reason names the other flag as typed too.
        (
            &["plan", "--depth", "64", "--group", "3"],
            "--num-q-heads 32",
        ),
        (
            &[
                "plan",
                "--depth",
                "64",
                "--num-q-heads",
                "6",
                "--group",
                "4",
            ],
            "--group",
        ),
        (&["plan", "--arch", "sm90", "--depth", "0"], "--depth"),
        (
            &["plan", "--arch", "sm90", "--depth", "64", "--seqlen", "0"],
            "--seqlen",
        ),
        (&["plan", "--backward", "--depth", "0"], "--depth"),
        (&["plan", "--backward", "--depth", "7"], "--depth"),
        (
            &["plan", "--backward", "--depth", "64", "--heads-q", "0"],
            "--heads-q",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--heads-kv", "0"],
            "--heads-kv",
        ),
        (
            &["plan", "--backward", "--depth", "64", "--seqlen-k", "0"],
            "--seqlen-k",
        ),
        (
            &["plan", "--decode", "--depth", "0", "--seqlen-k", "9"],
            "--depth",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--heads-q",
                "0",
            ],
            "--heads-q",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--heads-kv",
                "0",
            ],
            "--heads-kv",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--heads-kv",
                "3",
            ],
            "--heads-kv",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--num-splits",
                "0",
            ],
            "--num-splits",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--page-size",
                "0",
            ],
            "--page-size",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--sms",
                "0",
            ],
            "--sms",
        ),
        // Flags the decode plan would ignore.
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--num-q-heads",
                "8",
            ],
            "--num-q-heads",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--group",
                "2",
            ],
            "--group",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--seqlen",
                "4",
            ],
            "--seqlen",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--swizzle",
                "64B",
            ],
            "--swizzle",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--varlen",
            ],
            "--varlen",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--compile",
            ],
            "--compile",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--arch",
                "sm90",
            ],
            "--arch",
        ),
        (
            &[
                "plan",
                "--decode",
                "--depth",
                "64",
                "--seqlen-k",
                "9",
                "--dtype",
                "f32",
            ],
            "--dtype",
        ),
    ];
    for &(args, needle) in cases {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(out.is_empty(), "{args:?} printed {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        let named = err
            .strip_prefix("fa4: error: invalid argument `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(name, _)| name)
            .unwrap_or_else(|| panic!("{args:?}: not an argument error: {err}"));
        assert!(named.starts_with("--"), "{args:?}: names `{named}`: {err}");
        if needle.contains(' ') {
            assert!(err.contains(needle), "{args:?}: lacks {needle:?}: {err}");
        } else {
            assert_eq!(named, needle, "{args:?}: {err}");
        }
        for library_name in [
            "`depth`",
            "num_q_heads",
            "heads_kv",
            "heads_q",
            "dtype_size",
        ] {
            assert!(
                !err.contains(library_name),
                "{args:?}: says {library_name}: {err}"
            );
        }
    }
}
