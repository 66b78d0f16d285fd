//! leasehold: a Kubernetes-native job queue in which workers never own a job — they lease it,
//! and prove the lease on every write.
//!
//! Where things live:
//! - [`crd`]: the `LeasedJob` custom resource.
//! - [`crd_check`]: the controller's start-up check that the installed CRD is up to date.
//! - [`token`]: the fencing token a claim issues.
//! - [`claim`]: the atomic Queued -> Leased transition.
//! - [`share`]: which job a claimer tries, so that the claimers of a queue do not race.
//! - [`lease`]: the per-job `coordination.k8s.io/v1` Lease: acquire, renew (heartbeat), release.
//! - [`fence`]: the conditional writes that end an attempt; where a stale token is refused.
//! - [`expiry`]: how the controller judges a lease expired (on its own clock).
//! - [`controller`]: the reconciler that requeues expired jobs and records Events.
//! - [`events`]: Kubernetes Events that are always valid, whatever the object's name or the
//!   length of what they say.
//! - [`leader`]: leader election among controller replicas, fenced like workers.
//! - [`worker`]: the client library a worker (or the sidecar) uses.
//! - [`sidecar`]: that library over local HTTP, for workers in any language.
//! - [`http`]: serving HTTP with bounded waits, for the sidecar, the metrics endpoints and the
//!   admission webhook.
//! - [`admission`]: the controller's admission webhook, which refuses a LeasedJob too large to
//!   store ([`crd::MAX_JOB_BYTES`]) with a 4xx naming the field.
//! - [`tls`]: a serving certificate read from files and re-read when they change.
//! - [`kubeapi`]: what the roles share about the API server: clients whose every request has
//!   a deadline, the watch backoff, error classification, cache readiness.
//! - [`memory`]: freed heap memory handed back to the kernel, so resident memory follows
//!   what the caches keep.
//! - [`watch`]: the watches both roles run, decoding each object on its own so that one
//!   undecodable object is skipped and reported instead of stalling the watch.
//! - [`progress`]: how far a job is (fraction and message), carried by heartbeats and kept on
//!   its Lease.
//! - [`plugin`]: `kubectl leasehold` (get with progress, retry, cancel).
//! - [`metrics`]: Prometheus metrics and health.
//! - [`queue_stats`]: what the controller reports per queue (oldest attempt, overdue leases,
//!   how attempts ended), computed from its caches.
//! - [`telemetry`]: logging set-up; [`shutdown`]: the shutdown signal.

pub mod admission;
pub mod claim;
pub mod claim_index;
pub mod controller;
pub mod crd;
pub mod crd_check;
pub mod events;
pub mod expiry;
pub mod fence;
pub mod http;
pub mod kubeapi;
pub mod leader;
pub mod lease;
pub mod memory;
pub mod metrics;
pub mod plugin;
pub mod progress;
pub mod queue_stats;
pub mod queue_watch;
pub mod share;
pub mod shutdown;
pub mod sidecar;
pub mod telemetry;
pub mod tls;
pub mod token;
pub mod watch;
pub mod worker;
