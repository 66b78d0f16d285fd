//! leasehold: the binary's library: the sidecar's HTTP API, the kubectl plugin, the admission
//! webhook, and serving HTTP with bounded waits. The rules live in the crates below:
//! leasehold-core (types and decisions, no IO), leasehold-kube (talking to the API server),
//! leasehold-metrics, and the roles leasehold-worker and leasehold-controller.
//!
//! - [`cli`]: the command line, one function per subcommand.
//! - [`sidecar`]: the worker library over local HTTP, for workers in any language.
//! - [`plugin`]: `kubectl leasehold` (get with progress, retry, cancel).
//! - [`admission`]: the controller's admission webhook, which refuses a LeasedJob too large to
//!   store ([`leasehold_core::crd::MAX_JOB_BYTES`]) with a 4xx naming the field.
//! - [`inject`]: the controller's mutating webhook that adds the sidecar to pods annotated
//!   `leasehold.dev/queue`.
//! - [`review`]: reading an AdmissionReview and writing its answer, for both webhooks.
//! - [`http`]: serving HTTP with bounded waits, for the sidecar, the metrics endpoints and the
//!   admission webhook.
//! - [`observe`]: `/metrics`, `/healthz` and `/readyz` as HTTP responses.
//! - [`tls`]: a serving certificate read from files and re-read when they change.
//! - [`telemetry`]: logging set-up.

pub mod admission;
pub mod cli;
pub mod dispatch;
pub mod http;
pub mod inject;
pub mod observe;
pub mod plugin;
pub mod review;
pub mod sidecar;
pub mod telemetry;
pub mod tls;
