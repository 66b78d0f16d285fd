//! The controller's copy of every job it watches, kept small: what its decisions read and
//! nothing else, packed so that a backlog of queued jobs costs a few hundred bytes a job.
//!
//! A cache of whole `LeasedJob` objects cost about 1.1 KiB a job before any index (784 bytes
//! of struct alone, most of it empty `ObjectMeta` and status fields), and the controller's
//! resident memory 2.3 KiB a job with its other per-job records (benchmark row 10f). Here a
//! job is one [`JobRecord`] under its [`JobKey`]:
//! - the namespace is interned (one allocation per namespace), the name is the key;
//! - uid and resourceVersion are packed into integers when they have the API server's usual
//!   form (a lowercase UUID, a decimal number) and kept as text otherwise, so that
//!   [`JobCache::job`] gives back exactly what was read;
//! - the spec, payload dropped, is interned: a backlog of jobs that differ only by payload
//!   shares one;
//! - the status is not stored at all while it is the one the controller's initialisation writes
//!   ([`initial_status`]), the state of every job that waits in a backlog;
//! - labels, annotations, finalizers, owner references and managedFields are dropped: no
//!   decision of the controller reads them (its writes are status writes and deletes guarded by
//!   uid and resourceVersion, its Events name the job by reference).
//!
//! [`JobCache::job`] rebuilds a `LeasedJob` with every field the controller reads, for one
//! reconcile at a time. The cache also keeps, per job, the (attempt, phase) at which the
//! controller last recorded transitions ([`JobCache::swap_seen`]), so that no second map keyed
//! by job is needed.
//!
//! Relists follow kube's reflector: between [`JobCache::relist_began`] and
//! [`JobCache::relist_done`] the jobs listed are applied as they come, and at the end the jobs
//! the list did not bring are dropped.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde_json::Value;

use crate::crd::{LeasedJob, LeasedJobSpec, LeasedJobStatus, Phase};
use crate::lease;

/// A job's identity in the cache: its namespace (interned) and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct JobKey {
    /// metadata.namespace.
    pub namespace: Arc<str>,
    /// metadata.name.
    pub name: Box<str>,
}

/// A string that is usually a decimal number (resourceVersion) or a UUID (uid), packed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Packed {
    Number(u64),
    /// The UUID's 128 bits, as two halves (a `u128` would align the enum to 16 bytes).
    Uuid([u64; 2]),
    Text(Box<str>),
}

impl Packed {
    /// Packs `text` so that [`Packed::text`] gives it back byte for byte.
    fn pack(text: &str) -> Packed {
        if let Some(n) = text.parse::<u64>().ok().filter(|n| n.to_string() == text) {
            return Packed::Number(n);
        }
        if let Some(u) = uuid_bits(text) {
            return Packed::Uuid([(u >> 64) as u64, u as u64]);
        }
        Packed::Text(text.into())
    }

    fn text(&self) -> String {
        match self {
            Packed::Number(n) => n.to_string(),
            Packed::Uuid([high, low]) => uuid_text((u128::from(*high) << 64) | u128::from(*low)),
            Packed::Text(t) => t.to_string(),
        }
    }
}

/// The 128 bits of a UUID written as the API server writes uids (lowercase hex, dashes after
/// the 8th, 12th, 16th and 20th digit); None for any other text.
fn uuid_bits(text: &str) -> Option<u128> {
    let bytes = text.as_bytes();
    if bytes.len() != 36 {
        return None;
    }
    let mut bits: u128 = 0;
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if *b != b'-' {
                return None;
            }
            continue;
        }
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => return None,
        };
        bits = (bits << 4) | u128::from(digit);
    }
    Some(bits)
}

fn uuid_text(bits: u128) -> String {
    let hex = format!("{bits:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// A job's status as the cache keeps it.
#[derive(Clone, Debug)]
enum SlimStatus {
    /// No status (not initialised yet).
    Absent,
    /// Exactly [`initial_status`] of the job.
    Initial,
    /// Anything else, result and checkpoint dropped.
    Other(Box<LeasedJobStatus>),
}

/// The status the controller's initialisation gives a job applied without one: Queued since its
/// creation, with its Lease's name, for its generation.
pub fn initial_status(
    name: &str,
    created: Option<&Time>,
    generation: Option<i64>,
) -> LeasedJobStatus {
    LeasedJobStatus {
        phase: Some(Phase::Queued),
        queued_time: created.cloned(),
        lease_name: Some(lease::lease_name(name)),
        observed_generation: generation,
        ..LeasedJobStatus::default()
    }
}

/// One job, as [`JobCache`] keeps it (see the module doc).
#[derive(Clone, Debug)]
pub struct JobRecord {
    uid: Option<Packed>,
    resource_version: Option<Packed>,
    generation: Option<i64>,
    created: Option<Time>,
    /// metadata.deletionTimestamp: rare, so boxed.
    deleting: Option<Box<Time>>,
    spec: Arc<LeasedJobSpec>,
    status: SlimStatus,
    /// (attempt, phase) at which transitions were last recorded.
    seen: Option<(i32, Phase)>,
    /// The relist that last brought it.
    epoch: u32,
}

impl JobRecord {
    /// spec.queue.
    pub fn queue(&self) -> &str {
        &self.spec.queue
    }

    /// status.phase; Queued without a status, as [`LeasedJob::phase`].
    pub fn phase(&self) -> Phase {
        match &self.status {
            SlimStatus::Absent | SlimStatus::Initial => Phase::Queued,
            SlimStatus::Other(s) => s.phase.unwrap_or(Phase::Queued),
        }
    }

    /// spec.concurrencyKey.
    pub fn concurrency_key(&self) -> Option<&str> {
        self.spec.concurrency_key.as_deref()
    }

    /// metadata.creationTimestamp.
    pub fn created(&self) -> Option<&Time> {
        self.created.as_ref()
    }

    /// status.claimedTime.
    pub fn claimed_time(&self) -> Option<&Time> {
        match &self.status {
            SlimStatus::Other(s) => s.claimed_time.as_ref(),
            _ => None,
        }
    }
}

/// Every job the controller watches, slim (see the module doc).
#[derive(Debug, Default)]
pub struct JobCache {
    jobs: HashMap<JobKey, JobRecord>,
    namespaces: HashSet<Arc<str>>,
    /// Specs (payload dropped) by their JSON text.
    specs: HashMap<String, Arc<LeasedJobSpec>>,
    /// Bumped by every relist.
    epoch: u32,
    /// Specs interned since the last sweep of unused ones.
    interned_since_sweep: usize,
}

impl JobCache {
    /// An empty cache.
    pub fn new() -> JobCache {
        JobCache::default()
    }

    /// Jobs held.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// True when no job is held.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The key of `namespace`/`name`, with the namespace interned if the cache knows it.
    pub fn key(&self, namespace: &str, name: &str) -> JobKey {
        let namespace = self
            .namespaces
            .get(namespace)
            .cloned()
            .unwrap_or_else(|| Arc::from(namespace));
        JobKey {
            namespace,
            name: name.into(),
        }
    }

    /// Whether `namespace`/`name` is held.
    pub fn contains(&self, namespace: &str, name: &str) -> bool {
        self.jobs.contains_key(&self.key(namespace, name))
    }

    /// Stores `job` (added or changed) and answers its key; None for an object without a name
    /// or namespace, which the API server never sends.
    pub fn apply(&mut self, job: &LeasedJob) -> Option<JobKey> {
        let meta = &job.metadata;
        let (name, namespace) = (meta.name.as_deref()?, meta.namespace.as_deref()?);
        let namespace = match self.namespaces.get(namespace) {
            Some(ns) => Arc::clone(ns),
            None => {
                let ns: Arc<str> = Arc::from(namespace);
                self.namespaces.insert(Arc::clone(&ns));
                ns
            }
        };
        let key = JobKey {
            namespace,
            name: name.into(),
        };
        let status = match &job.status {
            None => SlimStatus::Absent,
            Some(s) => {
                let mut s = s.clone();
                s.result = None;
                s.checkpoint = None;
                if s == initial_status(name, meta.creation_timestamp.as_ref(), meta.generation) {
                    SlimStatus::Initial
                } else {
                    SlimStatus::Other(Box::new(s))
                }
            }
        };
        let seen = self.jobs.get(&key).and_then(|r| r.seen);
        let record = JobRecord {
            uid: meta.uid.as_deref().map(Packed::pack),
            resource_version: meta.resource_version.as_deref().map(Packed::pack),
            generation: meta.generation,
            created: meta.creation_timestamp.clone(),
            deleting: meta.deletion_timestamp.clone().map(Box::new),
            spec: self.intern(&job.spec),
            status,
            seen,
            epoch: self.epoch,
        };
        self.jobs.insert(key.clone(), record);
        Some(key)
    }

    /// Forgets `job` (deleted).
    pub fn delete(&mut self, job: &LeasedJob) {
        if let (Some(name), Some(ns)) = (
            job.metadata.name.as_deref(),
            job.metadata.namespace.as_deref(),
        ) {
            let key = self.key(ns, name);
            self.jobs.remove(&key);
        }
    }

    /// A relist begins: the jobs it does not bring are dropped when it is done.
    pub fn relist_began(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// The relist is done: drops the jobs it did not bring, and the namespaces and specs no
    /// job uses any more. Answers the jobs dropped.
    pub fn relist_done(&mut self) -> Vec<JobKey> {
        let epoch = self.epoch;
        let gone: Vec<JobKey> = self
            .jobs
            .iter()
            .filter(|(_, r)| r.epoch != epoch)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &gone {
            self.jobs.remove(key);
        }
        self.sweep();
        gone
    }

    /// The job under `key`, rebuilt with every field the controller reads (payload, result,
    /// checkpoint, labels and annotations left out).
    pub fn job(&self, key: &JobKey) -> Option<LeasedJob> {
        let r = self.jobs.get(key)?;
        let metadata = ObjectMeta {
            name: Some(key.name.to_string()),
            namespace: Some(key.namespace.to_string()),
            uid: r.uid.as_ref().map(Packed::text),
            resource_version: r.resource_version.as_ref().map(Packed::text),
            generation: r.generation,
            creation_timestamp: r.created.clone(),
            deletion_timestamp: r.deleting.as_deref().cloned(),
            ..ObjectMeta::default()
        };
        let status = match &r.status {
            SlimStatus::Absent => None,
            SlimStatus::Initial => {
                Some(initial_status(&key.name, r.created.as_ref(), r.generation))
            }
            SlimStatus::Other(s) => Some((**s).clone()),
        };
        Some(LeasedJob {
            metadata,
            spec: (*r.spec).clone(),
            status,
        })
    }

    /// Every job held, unordered.
    pub fn records(&self) -> impl Iterator<Item = (&JobKey, &JobRecord)> {
        self.jobs.iter()
    }

    /// Sets the (attempt, phase) at which transitions of `key` are recorded and answers the one
    /// before (None at the first sight, and for a job not held).
    pub fn swap_seen(&mut self, key: &JobKey, seen: (i32, Phase)) -> Option<(i32, Phase)> {
        let record = self.jobs.get_mut(key)?;
        record.seen.replace(seen)
    }

    /// The interned copy of `spec` with its payload dropped.
    fn intern(&mut self, spec: &LeasedJobSpec) -> Arc<LeasedJobSpec> {
        let mut slim = spec.clone();
        slim.payload = Value::Null;
        let text = serde_json::to_string(&slim).unwrap_or_default();
        if let Some(shared) = self.specs.get(&text) {
            return Arc::clone(shared);
        }
        let shared = Arc::new(slim);
        self.specs.insert(text, Arc::clone(&shared));
        self.interned_since_sweep += 1;
        // Specs of jobs since changed or gone are let go now and then, not at every change.
        if self.interned_since_sweep > 1024.max(self.specs.len()) {
            self.sweep();
        }
        shared
    }

    /// Drops the specs and namespaces no job holds any more, and spare capacity.
    fn sweep(&mut self) {
        self.specs.retain(|_, s| Arc::strong_count(s) > 1);
        self.namespaces.retain(|ns| Arc::strong_count(ns) > 1);
        self.interned_since_sweep = 0;
        if self.jobs.capacity() > 2 * self.jobs.len() + 1024 {
            self.jobs.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::AttemptFailure;
    use k8s_openapi::jiff::Timestamp;

    fn time(s: i64) -> Time {
        Time(Timestamp::from_second(s).unwrap())
    }

    fn job(ns: &str, name: &str) -> LeasedJob {
        let mut j = LeasedJob::new(
            name,
            LeasedJobSpec {
                queue: "q".into(),
                payload: serde_json::json!({"audio": "x".repeat(100)}),
                ..LeasedJobSpec::default()
            },
        );
        j.metadata.namespace = Some(ns.into());
        j.metadata.uid = Some("0f3c2a4e-5b6d-4e8f-9a0b-1c2d3e4f5a6b".into());
        j.metadata.resource_version = Some("123456".into());
        j.metadata.generation = Some(1);
        j.metadata.creation_timestamp = Some(time(1_700_000_000));
        j
    }

    /// What the cache must give back: the job without what it drops.
    fn slimmed(mut j: LeasedJob) -> LeasedJob {
        j.spec.payload = Value::Null;
        j.metadata.labels = None;
        j.metadata.annotations = None;
        j.metadata.managed_fields = None;
        if let Some(s) = j.status.as_mut() {
            s.result = None;
            s.checkpoint = None;
        }
        j
    }

    #[test]
    fn every_field_the_controller_reads_comes_back_exactly() {
        let mut cache = JobCache::new();
        let fresh = job("ns", "a");
        let mut initial = job("ns", "b");
        initial.status = Some(initial_status(
            "b",
            initial.metadata.creation_timestamp.as_ref(),
            Some(1),
        ));
        let mut leased = job("ns", "c");
        leased.metadata.labels = Some([("team".to_string(), "x".to_string())].into());
        leased.metadata.deletion_timestamp = Some(time(1_700_000_100));
        leased.status = Some(LeasedJobStatus {
            phase: Some(Phase::Leased),
            attempt: 2,
            holder: Some("w-1".into()),
            token: Some("2.0123456789abcdef0123456789abcdef".into()),
            claimed_time: Some(time(1_700_000_050)),
            checkpoint: Some(serde_json::json!({"at": 3})),
            result: Some(serde_json::json!("r")),
            failures: vec![AttemptFailure {
                attempt: 1,
                holder: "w-0".into(),
                reason: "LeaseExpired".into(),
                message: "m".into(),
                time: time(1_700_000_040),
            }],
            ..initial_status("c", None, Some(1))
        });
        // Forms the API server does not use are kept as text.
        let mut odd = job("other", "d");
        odd.metadata.uid = Some("NOT-A-UUID".into());
        odd.metadata.resource_version = Some("007".into());
        for j in [&fresh, &initial, &leased, &odd] {
            let key = cache.apply(j).unwrap();
            let back = serde_json::to_value(cache.job(&key).unwrap()).unwrap();
            let want = serde_json::to_value(slimmed(j.clone())).unwrap();
            assert_eq!(back, want, "{key:?}");
        }
        assert_eq!(cache.len(), 4);
        let phases: Vec<Phase> = ["a", "b", "c"]
            .iter()
            .map(|n| cache.jobs[&cache.key("ns", n)].phase())
            .collect();
        assert_eq!(phases, [Phase::Queued, Phase::Queued, Phase::Leased]);
        assert!(matches!(
            cache.jobs[&cache.key("ns", "b")].status,
            SlimStatus::Initial
        ));
    }

    #[test]
    fn a_backlog_shares_one_spec_and_one_namespace() {
        let mut cache = JobCache::new();
        for i in 0..100 {
            cache.apply(&job("ns", &format!("j{i}"))).unwrap();
        }
        assert_eq!((cache.specs.len(), cache.namespaces.len()), (1, 1));
        let mut other = job("ns", "j0");
        other.spec.priority = 5;
        cache.apply(&other).unwrap();
        assert_eq!(cache.specs.len(), 2);
        cache.relist_began();
        for i in 0..100 {
            cache.apply(&job("ns", &format!("j{i}"))).unwrap();
        }
        cache.relist_done();
        assert_eq!(
            cache.specs.len(),
            1,
            "the spec no job holds any more is let go"
        );
    }

    #[test]
    fn a_relist_drops_what_it_did_not_bring_and_keeps_what_was_seen() {
        let mut cache = JobCache::new();
        let keys: Vec<JobKey> = (0..3)
            .map(|i| cache.apply(&job("ns", &format!("j{i}"))).unwrap())
            .collect();
        assert_eq!(
            cache.swap_seen(&keys[0], (1, Phase::Leased)),
            None,
            "first sight"
        );
        cache.relist_began();
        cache.apply(&job("ns", "j0")).unwrap();
        cache.apply(&job("ns", "j2")).unwrap();
        let gone = cache.relist_done();
        assert_eq!(gone, vec![keys[1].clone()]);
        assert!(!cache.contains("ns", "j1") && cache.contains("ns", "j2"));
        assert_eq!(
            cache.swap_seen(&keys[0], (1, Phase::Succeeded)),
            Some((1, Phase::Leased)),
            "what was seen survives a change of the job and a relist"
        );
        cache.delete(&job("ns", "j0"));
        assert!(!cache.contains("ns", "j0"));
        assert_eq!(cache.swap_seen(&keys[0], (1, Phase::Queued)), None);
    }

    #[test]
    fn a_record_stays_small() {
        // What a queued job costs in the cache's table, before its name's allocation: the
        // figure docs/scaling.md builds on. A field added here must be worth its bytes.
        println!(
            "JobRecord {} Packed {} Time {} Status {}",
            std::mem::size_of::<JobRecord>(),
            std::mem::size_of::<Option<Packed>>(),
            std::mem::size_of::<Option<Time>>(),
            std::mem::size_of::<SlimStatus>()
        );
        assert!(
            std::mem::size_of::<JobRecord>() <= 136,
            "{}",
            std::mem::size_of::<JobRecord>()
        );
        assert_eq!(std::mem::size_of::<JobKey>(), 32);
    }

    #[test]
    fn packing_gives_back_the_text_it_was_given() {
        for text in [
            "0",
            "123456",
            "18446744073709551615",
            "18446744073709551616",
            "007",
            "-1",
            "",
            "abc",
            "0f3c2a4e-5b6d-4e8f-9a0b-1c2d3e4f5a6b",
            "0F3C2A4E-5B6D-4E8F-9A0B-1C2D3E4F5A6B",
            "0f3c2a4e5b6d4e8f9a0b1c2d3e4f5a6b0000",
        ] {
            assert_eq!(Packed::pack(text).text(), text);
        }
        assert!(matches!(Packed::pack("123"), Packed::Number(123)));
        assert!(matches!(
            Packed::pack("0f3c2a4e-5b6d-4e8f-9a0b-1c2d3e4f5a6b"),
            Packed::Uuid(_)
        ));
        assert!(matches!(Packed::pack("007"), Packed::Text(_)));
    }
}
