//! The sidecar's API against its OpenAPI document (docs/sidecar-openapi.json, served at GET
//! /openapi.json), with the real sidecar, controller and control plane:
//! - a worker's real paths (claim, heartbeat with progress, complete, fail, release, and the
//!   errors each documents), every answer validated against the document
//!   (tests/tools/schemathesis/check_flows.py);
//! - property-based fuzzing of every endpoint with schemathesis (from PyPI, pinned in
//!   tests/tools/schemathesis/requirements.txt): no 5xx, every status documented for its
//!   operation, every body of the documented schema and Content-Type (so every error is a
//!   documented JSON error), and invalid requests refused with a 4xx.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use leasehold_testkit::*;
use serde_json::json;

/// The venv's `st` (schemathesis), from tests/tools/schemathesis/venv.sh via scripts/test.
fn schemathesis() -> PathBuf {
    PathBuf::from(std::env::var_os("LEASEHOLD_SCHEMATHESIS").expect(
        "LEASEHOLD_SCHEMATHESIS is not set: the venv with schemathesis comes from \
         tests/tools/schemathesis/venv.sh; run `scripts/test`",
    ))
}

/// Runs `program args` in `dir` (schemathesis keeps a cache in `.schemathesis/` there) without
/// blocking the runtime; returns success and the output.
async fn run_tool(program: PathBuf, args: Vec<String>, dir: PathBuf) -> (bool, String) {
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new(&program)
            .args(&args)
            .current_dir(&dir)
            .env("SCHEMATHESIS_HOOKS", "")
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    })
    .await
    .unwrap()
}

/// Creates `n` jobs in `queue` that come back soon when a claimer goes silent (lease 5 s, many
/// attempts), so that the fuzzer's claims always find one and never wait out their `wait`.
/// Every other job carries a producer's trace context, so that claims with and without
/// `traceparent` and `tracestate` are validated.
async fn fill_queue(client: &kube::Client, ns: &str, queue: &str, n: usize) {
    let creates = (0..n).map(|i| {
        let annotations = if i % 2 == 0 {
            json!({
                "leasehold.dev/traceparent": format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{:016x}-01", i + 1),
                "leasehold.dev/tracestate": "rojo=00f067aa0ba902b7",
            })
        } else {
            json!({})
        };
        create_job(
            client,
            ns,
            json!({"metadata": {"name": format!("j{i}"), "annotations": annotations},
                   "spec": {"queue": queue, "leaseDurationSeconds": 5, "maxAttempts": 1000000,
                            "payload": {"i": i}}}),
        )
    });
    futures::future::join_all(creates).await;
}

/// The live sidecar answers as its OpenAPI document says under fuzzing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_matches_its_openapi_document() {
    require_control_plane!();
    let st = schemathesis();
    let python = st.with_file_name("python");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Fixture { client, ns } = fixture!("openapi");
    let _controller = controller(&ns.name);
    // --worker-timeout 1: jobs the fuzzer claims and forgets are no longer renewed after
    // max(1, 5) s, and the controller requeues them 5 s later.
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &["--worker-timeout", "1"]).await;
    fill_queue(&client, &ns.name, "q", 120).await;
    wait_for("a claimable job", Duration::from_secs(30), || async {
        let (s, body) = http_get_json(&sc.base, "/readyz").await?;
        (s == 200 && !body.is_empty()).then_some(())
    })
    .await;

    let doc = root.join("docs/sidecar-openapi.json");
    let flows = root.join("tests/tools/schemathesis/check_flows.py");
    let (ok, out) = run_tool(
        python,
        vec![
            flows.display().to_string(),
            sc.base.clone(),
            doc.display().to_string(),
        ],
        log_dir(),
    )
    .await;
    println!("{out}");
    assert!(
        ok,
        "an answer of the sidecar broke its OpenAPI document:\n{out}"
    );

    let report = log_dir().join(format!("{}-schemathesis", ns.name));
    let (ok, out) = run_tool(
        st,
        vec![
            "run".into(),
            format!("{}/openapi.json", sc.base),
            "--checks".into(),
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,negative_data_rejection,positive_data_acceptance".into(),
            "--phases".into(),
            "examples,coverage,fuzzing".into(),
            "--max-examples".into(),
            "100".into(),
            "--workers".into(),
            "1".into(),
            "--request-timeout".into(),
            "20".into(),
            "--seed".into(),
            std::env::var("LEASEHOLD_SCHEMATHESIS_SEED").unwrap_or_else(|_| "11".into()),
            "--suppress-health-check".into(),
            "all".into(),
            "--report".into(),
            "junit".into(),
            "--report-dir".into(),
            report.display().to_string(),
        ],
        report.clone(),
    )
    .await;
    println!("{out}");
    assert!(
        ok,
        "schemathesis found answers that break docs/sidecar-openapi.json (report in {}; sidecar log {}):\n{out}",
        report.display(),
        sc.proc.log.display()
    );
}

/// GETs `base` + `path`: (status, body text), or None when nothing answers.
async fn http_get_json(base: &str, path: &str) -> Option<(u16, String)> {
    let r = reqwest::get(format!("{base}{path}")).await.ok()?;
    let status = r.status().as_u16();
    Some((status, r.text().await.ok()?))
}
