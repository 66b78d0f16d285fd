//! The dispatcher as tests meet it: where the leading controller advertises it, and a fake
//! one (any HTTP router) advertised in its place, to play a dispatcher that lies.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::PostParams;
use kube::{Api, Client};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::dispatch::{ADDRESS_ANNOTATION, ADVERT_LEASE};
use serde_json::json;

use crate::{http_get, log_dir, sample, wait_for};

/// The address the leading controller advertises in `ns`, once it does (within 30 s).
pub async fn advertised(client: &Client, ns: &str) -> String {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("a dispatcher advertised in {ns}"),
        Duration::from_secs(30),
        || async {
            let lease = leases.get_opt(ADVERT_LEASE).await.ok()??;
            lease.metadata.annotations?.get(ADDRESS_ANNOTATION).cloned()
        },
    )
    .await
}

/// Serves `router` on loopback as `ns`'s dispatcher: advertised in the Lease
/// [`ADVERT_LEASE`] (held by "liar"), as a controller would. Returns a token file for
/// `--dispatch-token-file` whose token no API server accepts (the fake asks nobody).
pub async fn fake_dispatcher(client: &Client, ns: &str, router: axum::Router) -> PathBuf {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let advert: Lease = serde_json::from_value(json!({
        "metadata": {"name": ADVERT_LEASE, "annotations": {ADDRESS_ANNOTATION: address}},
        "spec": {"holderIdentity": "liar"},
    }))
    .unwrap();
    leases
        .create(&PostParams::default(), &advert)
        .await
        .unwrap();
    let token = log_dir().join(format!("{ns}-any-token"));
    std::fs::write(&token, "anything").unwrap();
    token
}

/// Waits until the controller's own cache (fed by the watch the dispatcher follows, after the
/// dispatcher has seen each event) counts `n` Queued jobs of queue `q`: the API server showing
/// a job Queued does not mean the dispatcher's view does yet (its watch is milliseconds behind).
pub async fn dispatcher_sees(ctl_port: u16, n: usize) {
    let metric = "leasehold_jobs{queue=\"q\",phase=\"Queued\"}";
    wait_for("the dispatcher's view", Duration::from_secs(10), || async {
        let m = http_get(ctl_port, "/metrics").await?.1;
        (sample(&m, metric)? >= n as f64).then_some(())
    })
    .await;
}

/// Waits until each job of `names` in `ns` is Queued (the controller initialised it), within
/// 20 s each.
pub async fn wait_queued(client: &Client, ns: &str, names: &[&str]) {
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    for name in names {
        let deadline = Instant::now() + Duration::from_secs(20);
        while jobs.get(name).await.unwrap().status.and_then(|s| s.phase) != Some(Phase::Queued) {
            assert!(Instant::now() < deadline, "{name} never Queued");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
