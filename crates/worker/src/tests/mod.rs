//! The worker's unit tests, in milliseconds and without a cluster: its pure decisions from
//! tables (`decisions`), and its IO-facing behaviour against a mocked API server (`mock_api`).
//! The integration tests (tests/*.rs) check the same behaviour against a real control plane.

mod decisions;
mod mock_api;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use leasehold_core::crd::{LeasedJob, LeasedJobSpec, LeasedJobStatus, Phase};
use leasehold_core::token::Token;

/// A job `name` of queue `q` in namespace `default`, in `phase` on `attempt`, its status naming
/// `token` (if any) and holder `w-1`.
pub(crate) fn job(name: &str, phase: Phase, attempt: i32, token: Option<&Token>) -> LeasedJob {
    let mut j = LeasedJob::new(
        name,
        LeasedJobSpec {
            queue: "q".into(),
            ..LeasedJobSpec::default()
        },
    );
    j.metadata.namespace = Some("default".into());
    j.metadata.resource_version = Some(format!("rv-{name}"));
    j.metadata.creation_timestamp = Some(Time(Timestamp::now()));
    j.status = Some(LeasedJobStatus {
        phase: Some(phase),
        attempt,
        token: token.map(|t| t.as_str().to_string()),
        holder: token.map(|_| "w-1".to_string()),
        ..LeasedJobStatus::default()
    });
    j
}
