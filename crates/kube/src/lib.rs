//! leasehold-kube: everything leasehold says to the Kubernetes API server, shared by the roles
//! above it (the worker, the controller, the binary), which never import each other.
//!
//! The decisions are leasehold-core's; this crate sends them as conditional writes and reads
//! the answers. What must not live here: a role's policy (when to claim, when to expire), HTTP
//! serving, Prometheus.
//!
//! - [`api`]: clients whose every request has a deadline, the watch backoff, error
//!   classification.
//! - [`claim`]: the claim's write (a status replace under the snapshot's resourceVersion).
//! - [`fence`]: the write that ends an attempt, and why one was refused.
//! - [`lease`]: the per-job Lease's writes: acquire, renew, release.
//! - [`events`]: Kubernetes Events that are always valid, whatever the object's name or the
//!   length of what they say.
//! - [`watch`]: watches that decode each object on its own, so that one undecodable object is
//!   skipped and reported instead of stalling the watch; cache readiness.
//! - [`queue_watch`]: the watch of one queue's jobs a claimer keeps while claims come.
//! - [`queue_object`]: a sidecar's view of its queue's LeasedQueue (is it paused?).
//! - [`slots`]: taking the slots that make a queue's limits exact.
//! - [`adopt`]: giving slots to the jobs Leased before a limit existed.
//! - [`recorder`]: what the watches and the worker report (claims, heartbeats, skipped
//!   objects), for a metrics registry above to count.
//! - [`health`]: readiness and liveness of a process.
//! - [`memory`]: freed heap memory handed back to the kernel.
//! - [`shutdown`]: the process's shutdown signal.

pub mod access;
pub mod adopt;
pub mod api;
pub mod claim;
pub mod events;
pub mod fence;
pub mod health;
pub mod lease;
pub mod memory;
pub mod queue_object;
pub mod queue_watch;
pub mod recorder;
pub mod shutdown;
pub mod slots;
pub mod watch;
