//! The dispatcher as tests meet it: where the leading controller advertises it, and a fake
//! one (any HTTP router) advertised in its place, to play a dispatcher that lies.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::PostParams;
use kube::{Api, Client};
use leasehold_core::dispatch::{ADDRESS_ANNOTATION, ADVERT_LEASE};
use serde_json::json;

use crate::{log_dir, wait_for};

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
