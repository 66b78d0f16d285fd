//! leasehold-core: the types and decisions of leasehold, with no IO.
//!
//! Every rule that says *what* happens lives here as a plain function over plain data: which
//! job a claimer picks, what status a claim writes, which token a write must present and why a
//! stale one is refused, when a lease is expired, what a Lease renewal patches. The crates
//! above (leasehold-kube, the worker, the controller, the binary) read, call these, and write.
//!
//! What must not live here: tokio, HTTP, an API client (this crate depends on `kube` only for
//! its derive and core types; `cargo tree -p leasehold-core` shows no tokio, hyper or
//! kube-client). Tests here are tables of cases that run in milliseconds.
//!
//! - [`crd`]: the `LeasedJob` custom resource.
//! - [`queue`]: the `LeasedQueue` custom resource: a queue as an object (pause, its status).
//! - [`definition`]: their CustomResourceDefinitions, as installed.
//! - [`token`]: the fencing token a claim issues.
//! - [`claim`]: which job a claimer picks and the Leased status a claim writes.
//! - [`claim_index`]: a queue's claimable jobs in claim order, kept from watch events.
//! - [`dispatch`]: which waiting job the dispatcher offers to which waiting worker.
//! - [`slots`]: the slots that make a queue's limits exact.
//! - [`adoption`]: the jobs Leased before a limit, counted by slots before it allows a claim.
//! - [`share`]: which job a claimer tries, so that the claimers of a queue do not race.
//! - [`fence`]: the conditional writes that end an attempt; where a stale token is refused.
//! - [`submit`]: submitting with an idempotency key: the job name and the spec hash every
//!   producer uses.
//! - [`injection`]: sidecar injection's names; which pods escaped it.
//! - [`job_cache`]: the controller's slim copy of every job it watches.
//! - [`json`]: the size of a JSON document, counted without building its text.
//! - [`policy`]: a job's lease duration, maxAttempts and backoff: its own, else its queue's.
//! - [`lease`]: the per-job `coordination.k8s.io/v1` Lease: its name, whose it is, its patches.
//! - [`expiry`]: how the controller judges a lease expired (on its own clock).
//! - [`progress`]: how far a job is (fraction and message), carried by heartbeats.
//! - [`queue_stats`]: what the controller reports per queue, computed from its caches.
//! - [`trace`]: the producer's W3C trace context, carried from the submit to the claim.
//! - [`category`]: the stable, short label every error of leasehold carries.

pub mod adoption;
pub mod category;
pub mod claim;
pub mod claim_index;
pub mod crd;
pub mod definition;
pub mod dispatch;
pub mod expiry;
pub mod fence;
pub mod injection;
pub mod job_cache;
pub mod json;
pub mod lease;
pub mod policy;
pub mod progress;
pub mod queue;
pub mod queue_stats;
pub mod share;
pub mod slots;
pub mod submit;
pub mod token;
pub mod trace;

pub use category::Category;
