//! `leasehold smoke-test`: one job through an installation, end to end, as `helm test` runs it
//! (the chart's test pod, whose sidecar the injection webhook adds): create a LeasedJob in a
//! queue of its own, claim it through the sidecar, complete it with the token the claim
//! returned, and check that the API server recorded it Succeeded with that result; then
//! delete it. Every step prints one line; the first failure ends it with the step named.

use std::time::Duration;

use anyhow::{bail, Context as _};
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use leasehold_core::crd::{LeasedJob, LeasedJobSpec, Phase};
use serde_json::{json, Value};

use super::{check_dns_label, clients, namespace_or_default};

/// What `leasehold smoke-test` checks, and where.
#[derive(clap::Args)]
pub struct SmokeArgs {
    /// The queue to run the job in: one no worker but this pod's sidecar serves.
    #[arg(long, env = "LEASEHOLD_QUEUE")]
    queue: String,
    /// Namespace of the job (default: POD_NAMESPACE, else the kubeconfig's).
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: Option<String>,
    /// The sidecar's base URL.
    #[arg(
        long,
        env = "LEASEHOLD_SIDECAR",
        default_value = "http://127.0.0.1:7070"
    )]
    sidecar: String,
    /// Seconds each step may take.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// Runs the check.
///
/// # Errors
/// The step that failed, with what the API server or the sidecar answered.
pub async fn run(args: SmokeArgs) -> anyhow::Result<()> {
    check_dns_label("--queue", &args.queue)?;
    let clients = clients().await?;
    let ns = namespace_or_default(&clients, args.namespace.clone())?;
    let jobs: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), &ns);
    let mut job = LeasedJob::new(
        "",
        LeasedJobSpec {
            queue: args.queue.clone(),
            payload: json!({"check": "leasehold smoke-test"}),
            ..LeasedJobSpec::default()
        },
    );
    job.metadata.name = None;
    job.metadata.generate_name = Some(format!("{}-smoke-", args.queue));
    let created = jobs
        .create(&PostParams::default(), &job)
        .await
        .with_context(|| format!("creating a LeasedJob in namespace {ns}"))?;
    let name = created.metadata.name.clone().unwrap_or_default();
    println!("created LeasedJob {ns}/{name} in queue {}", args.queue);
    let outcome = through(&args, &jobs, &ns, &name).await;
    let deleted = jobs.delete(&name, &DeleteParams::default()).await;
    outcome?;
    deleted.with_context(|| format!("deleting LeasedJob {ns}/{name}"))?;
    println!("deleted LeasedJob {ns}/{name}: the installation claims, fences and completes jobs");
    Ok(())
}

/// Claim, complete and check job `name`.
async fn through(
    args: &SmokeArgs,
    jobs: &Api<LeasedJob>,
    ns: &str,
    name: &str,
) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(args.timeout + 10))
        .build()
        .context("an HTTP client")?;
    let base = args.sidecar.trim_end_matches('/');
    let claimed = post(
        &http,
        &format!("{base}/v1/claim?wait={}", args.timeout.min(300)),
        json!({}),
    )
    .await
    .context("claiming through the sidecar")?;
    let Some(claimed) = claimed else {
        bail!(
            "claiming through the sidecar: no job offered within {} s",
            args.timeout
        );
    };
    if claimed["name"] != name {
        bail!(
            "claiming through the sidecar: it returned job {} instead of {name}: is queue {} served by other workers?",
            claimed["name"],
            args.queue
        );
    }
    let token = claimed["token"].as_str().unwrap_or_default().to_string();
    println!(
        "claimed it through the sidecar at {base} (attempt {})",
        claimed["attempt"]
    );
    let result = json!({"smoke": "ok"});
    post(
        &http,
        &format!("{base}/v1/jobs/{name}/complete"),
        json!({"token": token, "result": result}),
    )
    .await
    .context("completing through the sidecar")?;
    println!("completed it with its token");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout);
    loop {
        let job = jobs
            .get(name)
            .await
            .with_context(|| format!("reading LeasedJob {ns}/{name}"))?;
        let status = job.status.unwrap_or_default();
        if status.phase == Some(Phase::Succeeded) {
            if status.result.as_ref() != Some(&result) {
                bail!(
                    "LeasedJob {ns}/{name} is Succeeded with result {:?}, not {result}",
                    status.result
                );
            }
            println!("the API server has it Succeeded, with the result");
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "LeasedJob {ns}/{name} is {:?}, not Succeeded, {} s after its completion",
                status.phase,
                args.timeout
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// POSTs `body` to `url`: the answer's JSON on 200, None on 204, else an error with the
/// sidecar's answer.
async fn post(http: &reqwest::Client, url: &str, body: Value) -> anyhow::Result<Option<Value>> {
    let response = http
        .post(url)
        .json(&body)
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = response.status();
    if status == reqwest::StatusCode::NO_CONTENT {
        return Ok(None);
    }
    let text = response.text().await.unwrap_or_default();
    if !status.is_success() {
        bail!("POST {url}: {status}: {text}");
    }
    Ok(Some(serde_json::from_str(&text).with_context(|| {
        format!("POST {url}: the answer is not JSON: {text}")
    })?))
}
