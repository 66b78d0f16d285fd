//! What the watches and the worker report as they go, for a metrics registry above them
//! (leasehold-metrics) to count. The worker library does not depend on Prometheus: a process
//! that embeds it without metrics passes [`NoRecorder`].

/// Receives the events the watches and the worker report. Every method has an empty default,
/// so an implementation counts only what it wants.
pub trait Recorder: Send + Sync {
    /// A claim succeeded; `queue_wait_seconds` is the time from the job's creation to it, in
    /// seconds, when the job had a creationTimestamp.
    fn claimed(&self, queue_wait_seconds: Option<f64>) {
        let _ = queue_wait_seconds;
    }
    /// The claim just counted by [`Recorder::claimed`] was of a job the dispatcher offered.
    fn claimed_offered(&self) {}
    /// A claim write lost to another claimer (409 Conflict).
    fn claim_conflict(&self) {}
    /// A write was refused because its token was not the current holder's.
    fn stale_token_refused(&self) {}
    /// A Lease renewal was made (`ok`) or failed.
    fn heartbeat(&self, ok: bool) {
        let _ = ok;
    }
    /// An attempt its holder ended, `seconds` after its claim.
    fn attempt_ran(&self, seconds: f64) {
        let _ = seconds;
    }
    /// A watch skipped an object of `kind` that could not be decoded.
    fn undecodable(&self, kind: &str) {
        let _ = kind;
    }
    /// The watch of a claimer's queue started (`true`) or stopped (`false`).
    fn queue_watch_running(&self, running: bool) {
        let _ = running;
    }
    /// The watch of a claimer's queue stopped for want of claims.
    fn queue_watch_stopped(&self) {}
    /// The slot writes a claim made to take or swap its slots ([`crate::slots::acquire`]).
    fn slot_writes(&self, writes: &crate::slots::Writes) {
        let _ = writes;
    }
}

/// A [`Recorder`] that records nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoRecorder;

impl Recorder for NoRecorder {}
