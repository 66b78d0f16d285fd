//! Leader election for controller replicas, on a `coordination.k8s.io/v1` Lease, with the same
//! lease code and the same rules as a job's lease.
//!
//! The shape is client-go's `tools/leaderelection`: a replica takes the Lease when it is free or
//! when it has not seen it renewed for `leaseDuration` on its own clock ([`leasehold_core::expiry`]); the
//! leader renews every `retryPeriod`; it stops leading at once when a renewal finds another
//! holder, or when `renewDeadline` (< `leaseDuration`) has passed on its monotonic clock since
//! the start of its last successful renewal.
//!
//! Fencing the leader the way workers are fenced:
//! - holderIdentity is a fresh token per term (`<term>.<32 hex>`, term = leaseTransitions + 1),
//!   so a renewal is a JSON Patch that `test`s the token: a deposed leader can never renew.
//! - every controller write first asks [`Leadership::token`], which answers only while the
//!   term is valid on the monotonic clock. A leader frozen (SIGSTOP, a GC pause, a stopped VM)
//!   past its renew deadline finds its term over the moment it resumes, since the monotonic
//!   clock kept running, and writes nothing.
//! - the Lease's annotation `leasehold.dev/holder-pod` names the leader's pod, so an admission
//!   policy can refuse controller writes from any other pod inside the API server.
//! - every write that depends on what was read is also conditional on it (resourceVersion or
//!   `test`), so a write that slipped between a check and a freeze still cannot undo anything.
//!
//! On shutdown the leader ends its term first, then releases the Lease, so a standby takes over
//! within one `retryPeriod` instead of a whole `leaseDuration`. A replica that finds the Lease
//! held under its own identity (its container restarted in the same pod, so the process that
//! held it has exited) starts a new term at once, as client-go does. Were that earlier process
//! somehow still alive, its renewals fail on the token `test`, its term ends at its renew
//! deadline, and every write it might slip in before then is conditional.

use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;
use tokio::time::Instant;
use tracing::{info, warn};

use leasehold_core::crd::{MANAGED_BY, MANAGED_BY_LABEL};
use leasehold_core::expiry::{self, Observation, Record, Verdict};
use leasehold_core::lease;
use leasehold_core::token::Token;
use leasehold_kube::api::is_status;
use leasehold_kube::lease::LeaseError;

/// Annotation on the leader Lease naming the leader's pod (its identity).
pub const HOLDER_POD_ANNOTATION: &str = "leasehold.dev/holder-pod";

/// Timing and naming of the election. Defaults are client-go's: 15 s / 10 s / 2 s.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    /// Namespace of the leader Lease.
    pub namespace: String,
    /// Name of the leader Lease.
    pub lease_name: String,
    /// This replica's identity (pod name).
    pub identity: String,
    /// How long a leader's Lease stays valid without renewal, for the standbys.
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal. Must be shorter than
    /// `lease_duration`, so a leader stops before any standby may take over.
    pub renew_deadline: Duration,
    /// How often the leader renews and a standby tries to acquire.
    pub retry_period: Duration,
}

impl ElectionConfig {
    /// Checks the timing rule `retry_period < renew_deadline < lease_duration`.
    ///
    /// # Errors
    /// A message naming the flags and the rule.
    pub fn validate(&self) -> Result<(), String> {
        if self.retry_period.is_zero()
            || self.retry_period >= self.renew_deadline
            || self.renew_deadline >= self.lease_duration
        {
            return Err(format!(
                "leader election timing must satisfy 0 < --leader-retry-period ({}s) < --leader-renew-deadline ({}s) < --leader-lease-duration ({}s)",
                self.retry_period.as_secs_f64(),
                self.renew_deadline.as_secs_f64(),
                self.lease_duration.as_secs_f64()
            ));
        }
        Ok(())
    }
}

struct Term {
    token: Token,
    valid_until: Instant,
}

/// Whether this replica leads now. Shared between the elector and the reconciler.
#[derive(Default)]
pub struct Leadership {
    term: Mutex<Option<Term>>,
    /// Notified when a term begins (one permit kept for a waiter that comes later).
    began: tokio::sync::Notify,
}

impl Leadership {
    /// A replica that leads from the start, for a single controller run without election.
    pub fn always() -> Leadership {
        Leadership {
            term: Mutex::new(Some(Term {
                token: Token::issue(1),
                valid_until: Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600),
            })),
            began: tokio::sync::Notify::new(),
        }
    }

    /// The current term's token if this replica leads right now (its term has not passed its
    /// renew deadline on the monotonic clock). Ask immediately before every write.
    pub fn token(&self) -> Option<Token> {
        let term = self.term.lock().unwrap();
        term.as_ref()
            .filter(|t| Instant::now() < t.valid_until)
            .map(|t| t.token.clone())
    }

    /// True while this replica leads.
    pub fn is_leader(&self) -> bool {
        self.token().is_some()
    }

    fn start(&self, token: Token, valid_until: Instant) {
        *self.term.lock().unwrap() = Some(Term { token, valid_until });
        self.began.notify_one();
    }

    /// Resolves when this replica begins a term (or began one since the last call): for the
    /// one task that acts at once on leading (the dispatcher's advert).
    pub async fn began(&self) {
        self.began.notified().await;
    }

    fn extend(&self, token: &Token, valid_until: Instant) {
        if let Some(t) = self
            .term
            .lock()
            .unwrap()
            .as_mut()
            .filter(|t| t.token == *token)
        {
            t.valid_until = valid_until;
        }
    }

    fn end(&self) -> Option<Token> {
        self.term.lock().unwrap().take().map(|t| t.token)
    }
}

/// Runs the election until `shutdown` resolves, then gives the Lease up.
pub async fn run(
    api: Api<Lease>,
    config: ElectionConfig,
    leadership: &Leadership,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut observed: Option<Observation> = None;
    loop {
        let started = Instant::now();
        match leadership.token() {
            Some(token) => renew(&api, &config, leadership, &token, started).await,
            None => {
                if leadership.end().is_some() {
                    warn!(identity = %config.identity, "Lost leadership: no successful renewal within the renew deadline");
                }
                try_acquire(&api, &config, leadership, &mut observed, started).await;
            }
        }
        tokio::select! {
            () = tokio::time::sleep_until(started + config.retry_period) => {}
            () = &mut shutdown => break,
        }
    }
    if let Some(token) = leadership.end() {
        match leasehold_kube::lease::release(&api, &config.lease_name, token.as_str()).await {
            Ok(()) => info!(identity = %config.identity, "Released leadership on shutdown"),
            Err(e) => {
                warn!(identity = %config.identity, error = %e, "Releasing leadership failed; a standby takes over once the lease expires")
            }
        }
    }
}

async fn renew(
    api: &Api<Lease>,
    config: &ElectionConfig,
    leadership: &Leadership,
    token: &Token,
    started: Instant,
) {
    match leasehold_kube::lease::renew(api, &config.lease_name, token, None, None).await {
        Ok(_) => leadership.extend(token, started + config.renew_deadline),
        Err(LeaseError::Lost { .. }) => {
            leadership.end();
            warn!(identity = %config.identity, term = token.attempt(), "Lost leadership: the Lease is held by another replica");
        }
        Err(e) => warn!(identity = %config.identity, error = %e, "Leader renewal failed; retrying"),
    }
}

async fn try_acquire(
    api: &Api<Lease>,
    config: &ElectionConfig,
    leadership: &Leadership,
    observed: &mut Option<Observation>,
    started: Instant,
) {
    let current = match api.get_opt(&config.lease_name).await {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "Reading the leader Lease failed");
            return;
        }
    };
    let spec = current
        .as_ref()
        .and_then(|l| l.spec.clone())
        .unwrap_or_default();
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
    // A term held under this replica's own identity belongs to an earlier incarnation of this
    // replica (its container restarted in the same pod): take it back at once instead of
    // waiting a whole leaseDuration with no controller, as client-go does for its own identity.
    let held_by_earlier_self = current
        .as_ref()
        .and_then(|l| l.metadata.annotations.as_ref())
        .and_then(|a| a.get(HOLDER_POD_ANNOTATION))
        .is_some_and(|pod| *pod == config.identity);
    if holder.is_some() && !held_by_earlier_self {
        let record = Record {
            token: String::new(),
            holder_identity: holder.clone(),
            renew_time: spec.renew_time.as_ref().map(|t| t.0.to_string()),
        };
        let o = expiry::observe(observed.as_ref(), record, std::time::Instant::now());
        let verdict = expiry::judge(&o, config.lease_duration, std::time::Instant::now());
        *observed = Some(o);
        if matches!(verdict, Verdict::Live { .. }) {
            return;
        }
    }
    let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(current.is_some());
    let token = Token::issue(transitions + 1);
    let now = Timestamp::now();
    let mut meta = current
        .as_ref()
        .map(|l| l.metadata.clone())
        .unwrap_or_else(|| ObjectMeta {
            name: Some(config.lease_name.clone()),
            namespace: Some(config.namespace.clone()),
            ..ObjectMeta::default()
        });
    meta.labels
        .get_or_insert_with(Default::default)
        .insert(MANAGED_BY_LABEL.into(), MANAGED_BY.into());
    meta.annotations
        .get_or_insert_with(Default::default)
        .insert(HOLDER_POD_ANNOTATION.into(), config.identity.clone());
    let lease = Lease {
        metadata: meta,
        spec: Some(LeaseSpec {
            holder_identity: Some(token.as_str().to_string()),
            lease_duration_seconds: Some(
                i32::try_from(config.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX),
            ),
            acquire_time: Some(lease::micro_time(now)),
            renew_time: Some(lease::micro_time(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }),
    };
    let written = match current {
        None => api.create(&PostParams::default(), &lease).await,
        Some(_) => {
            api.replace(&config.lease_name, &PostParams::default(), &lease)
                .await
        }
    };
    match written {
        Ok(_) => {
            leadership.start(token.clone(), started + config.renew_deadline);
            *observed = None;
            info!(identity = %config.identity, term = token.attempt(), "Became leader (term {})", token.attempt());
        }
        // Another replica won the race (409) or created it first.
        Err(e) if is_status(&e, 409) => {}
        Err(e) => warn!(error = %e, "Acquiring the leader Lease failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_must_nest() {
        let c = |l, d, r| ElectionConfig {
            namespace: "ns".into(),
            lease_name: "l".into(),
            identity: "a".into(),
            lease_duration: Duration::from_secs(l),
            renew_deadline: Duration::from_secs(d),
            retry_period: Duration::from_secs(r),
        };
        assert!(c(15, 10, 2).validate().is_ok());
        for (l, d, r) in [(10, 10, 2), (15, 10, 10), (15, 10, 0), (5, 10, 2)] {
            let e = c(l, d, r).validate().unwrap_err();
            assert!(e.contains("--leader-renew-deadline"), "{e}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_term_ends_at_its_deadline_on_the_monotonic_clock() {
        let l = Leadership::default();
        assert!(!l.is_leader());
        let t = Token::issue(3);
        l.start(t.clone(), Instant::now() + Duration::from_secs(10));
        assert_eq!(l.token(), Some(t.clone()));
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(l.is_leader());
        l.extend(&t, Instant::now() + Duration::from_secs(10));
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(l.is_leader());
        // A freeze: time passes with no renewal.
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!l.is_leader());
        // An old term's renewal cannot extend a new term.
        let t2 = Token::issue(4);
        l.start(t2.clone(), Instant::now() + Duration::from_secs(1));
        l.extend(&t, Instant::now() + Duration::from_secs(100));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!l.is_leader());
    }
}
