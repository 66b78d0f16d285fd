//! Claiming through the dispatcher: the sidecar asks the leading controller's dispatcher for a
//! job of its queue (a long poll), and claims the job it is offered with its own
//! resourceVersion-guarded write, from a copy of the job read from the API server, never from
//! the dispatcher's word. docs/protocol.md, "Dispatch". Such a sidecar keeps no copy of its
//! queue: only the jobs it holds.
//!
//! Finding it: the leading replica names its `host:port` in the annotation
//! `leasehold.dev/dispatcher-address` of the Lease `leasehold-dispatcher` of the sidecar's
//! namespace; a watch of that one Lease follows it across failovers. Proving who asks: a
//! projected service-account token for the audience `leasehold-dispatcher`, read from
//! [`DispatchConfig::token_file`] at every poll (the kubelet rotates it). Without the file, or
//! while no dispatcher is advertised, the sidecar chooses on its own as before.
//!
//! Claims never wait on it: while a poll waits, the dispatcher sends a newline every
//! [`KEEP_ALIVE`], and a silence of [`SILENCE_BOUND`] means a frozen dispatcher, or a stalled
//! path to it, which is so noticed within [`FALLBACK_AFTER`]; one that fails, answers "not leading", cannot be reached within
//! [`CONNECT_BOUND`], or is not answering in time is set aside ([`aside_for`]: 1 s, doubling
//! to [`SET_ASIDE`] while it keeps failing; that address
//! only: a new leader's is asked at once), and meanwhile the sidecar chooses on its own from a
//! bounded list (`listed.rs`).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::watcher;
use kube::Api;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;

use leasehold_core::dispatch::{ADDRESS_ANNOTATION, ADVERT_LEASE};
use leasehold_core::slots::Preferred;
use leasehold_kube::api::error_chain;

/// How long a connection to the dispatcher may take before it is set aside.
pub const CONNECT_BOUND: Duration = Duration::from_millis(500);
/// The longest a dispatcher that failed is set aside before it is asked again.
pub const SET_ASIDE: Duration = Duration::from_secs(5);
/// How long a dispatcher that failed once (after answering) is set aside.
pub const FIRST_SET_ASIDE: Duration = Duration::from_secs(1);

/// How long a dispatcher that failed `strikes` times in a row (>= 1) is set aside:
/// [`FIRST_SET_ASIDE`], doubling, at most [`SET_ASIDE`]. A transient failure (a connection
/// that took too long while hundreds of sidecars connected at once) costs a second of
/// choosing on one's own; a dispatcher that stays away is asked every 5 s.
pub fn aside_for(strikes: u32) -> Duration {
    let doublings = strikes.saturating_sub(1).min(8);
    (FIRST_SET_ASIDE * 2u32.pow(doublings)).min(SET_ASIDE)
}
/// The longest wait of one poll: a sidecar whose claim waits longer asks again.
pub const POLL_WAIT: Duration = Duration::from_secs(30);
/// How often a waiting dispatcher sends a newline down a poll's answer (its `keepAliveMs`).
pub const KEEP_ALIVE: Duration = Duration::from_millis(250);
/// The longest silence of a dispatcher answering a poll (before the answer's head, or between
/// two chunks of its body) before it is set aside: a frozen dispatcher, or a stalled path to
/// it, accepts the connection and then sends nothing.
pub const SILENCE_BOUND: Duration = Duration::from_millis(700);
/// The longest a sidecar waits on a dispatcher that stopped answering before it chooses on
/// its own.
pub const FALLBACK_AFTER: Duration = SILENCE_BOUND;
/// Largest poll answer read, in bytes, the keep-alive newlines aside.
const MAX_ANSWER_BYTES: usize = 4096;

/// Where the sidecar's dispatcher token comes from.
#[derive(Clone, Debug)]
pub struct DispatchConfig {
    /// The projected service-account token for the audience `leasehold-dispatcher`.
    pub token_file: PathBuf,
    /// Namespace of the advert Lease [`ADVERT_LEASE`] (the controller's leader namespace).
    pub advert_namespace: String,
}

/// A job the dispatcher offered.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Hint {
    /// The job's name.
    pub name: String,
    /// Its resourceVersion as the dispatcher saw it.
    pub resource_version: String,
    /// The slot of the queue's limit to try first (`maxLeased`), if the dispatcher suggests
    /// one ([`Preferred`]). Advice: a value that is not an index (negative, fractional, too
    /// large, not a number) is read as no suggestion, and the offer stands.
    #[serde(default, deserialize_with = "slot_index")]
    pub queue_slot: Option<u32>,
    /// The slot of the job's concurrency key's limit to try first (`maxLeasedPerKey`), read
    /// as `queue_slot` is.
    #[serde(default, deserialize_with = "slot_index")]
    pub key_slot: Option<u32>,
    /// Whether `queue_slot` is this claimer's own free slot, suggested for it to swap
    /// (docs/protocol.md, "Limits": swapping one's own slot); anything but `true` reads as no.
    #[serde(default, deserialize_with = "flag")]
    pub own_queue_slot: bool,
    /// Whether `key_slot` is, read as `own_queue_slot`.
    #[serde(default, deserialize_with = "flag")]
    pub own_key_slot: bool,
}

/// Reads a flag: `true`, anything else false.
fn flag<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(d)?;
    Ok(value == Some(serde_json::Value::Bool(true)))
}

/// Reads a suggested slot index: a whole number from 0 to `u32::MAX`, anything else none.
fn slot_index<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(d)?;
    Ok(value
        .as_ref()
        .and_then(serde_json::Value::as_u64)
        .and_then(|i| u32::try_from(i).ok()))
}

impl Hint {
    /// Whether the hint can name a job at all: its name an object name (a lowercase RFC 1123
    /// subdomain of at most 253 characters) and its resourceVersion 1 to 64 ASCII letters and
    /// digits (an etcd revision is digits). Anything else is declined without a read: a name
    /// with `/` or `..` would otherwise go into the read's path as it is.
    pub fn is_well_formed(&self) -> bool {
        let version = &self.resource_version;
        leasehold_core::crd::is_dns_subdomain(&self.name)
            && (1..=64).contains(&version.len())
            && version.bytes().all(|b| b.is_ascii_alphanumeric())
    }

    /// The slots the dispatcher suggests trying first.
    pub fn preferred(&self) -> Preferred {
        Preferred {
            queue: self.queue_slot,
            key: self.key_slot,
        }
    }

    /// Those of them suggested as this claimer's own free slots, to swap.
    pub fn swappable(&self) -> Preferred {
        Preferred {
            queue: self.queue_slot.filter(|_| self.own_queue_slot),
            key: self.key_slot.filter(|_| self.own_key_slot),
        }
    }
}

/// Why the dispatcher could not be used for this poll.
#[derive(Debug, thiserror::Error)]
#[error("the dispatcher at {address} {why}")]
pub struct Unusable {
    address: String,
    why: String,
}

/// Who asks the dispatcher, for which queue: the same in every poll of one sidecar.
#[derive(Clone, Debug)]
pub struct Asker {
    /// The jobs' namespace.
    pub namespace: String,
    /// Their `spec.queue`.
    pub queue: String,
    /// The worker's identity (the pod name).
    pub worker: String,
}

/// The sidecar's side of the dispatcher.
pub struct Dispatched {
    config: DispatchConfig,
    asker: Asker,
    address: watch::Receiver<Option<String>>,
    http: reqwest::Client,
    /// The address set aside after a failure, until when, and its failures in a row.
    aside: Mutex<Option<Aside>>,
    /// The address of a dispatcher that refused a poll naming `ownSlots` (one older than
    /// them, whose polls refuse unknown fields): polls to it name none from then on.
    own_refused: Mutex<Option<String>>,
}

/// A dispatcher's address set aside.
#[derive(Debug)]
struct Aside {
    address: String,
    until: Instant,
    strikes: u32,
}

impl Dispatched {
    /// Follows the advert Lease through `leases` (the sidecar's namespace). Returns the client
    /// and the future following the advert (runs forever: select it with the worker's other
    /// watches).
    pub fn start(
        leases: Api<Lease>,
        config: DispatchConfig,
        asker: Asker,
    ) -> (Dispatched, impl std::future::Future<Output = ()> + Send) {
        let (tx, address) = watch::channel(None);
        let follow = async move {
            let events = watcher::watcher(
                leases,
                watcher::Config::default().fields(&format!("metadata.name={ADVERT_LEASE}")),
            );
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                        let a = lease
                            .metadata
                            .annotations
                            .and_then(|mut a| a.remove(ADDRESS_ANNOTATION));
                        tx.send_if_modified(|was| {
                            let changed = *was != a;
                            *was = a;
                            changed
                        });
                    }
                    Ok(watcher::Event::Delete(_)) => {
                        tx.send_replace(None);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "Watch of Lease {ADVERT_LEASE} failed; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        };
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_BOUND)
            .build()
            .unwrap_or_default();
        (
            Dispatched {
                config,
                asker,
                address,
                http,
                aside: Mutex::new(None),
                own_refused: Mutex::new(None),
            },
            follow,
        )
    }

    /// The advertised address, unless none is or that address is set aside.
    pub fn usable(&self) -> Option<String> {
        let address = self.address.borrow().clone()?;
        let aside = self.aside.lock().unwrap();
        match &*aside {
            Some(a) if a.address == address && Instant::now() < a.until => None,
            _ => Some(address),
        }
    }

    /// Resolves when the advertised address changes (a new leader): a sidecar choosing on its
    /// own asks the new one at once.
    pub(crate) async fn advert_changed(&self) {
        let mut address = self.address.clone();
        address.borrow_and_update();
        if address.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Sets the dispatcher at `address` aside for [`aside_for`] its failures in a row because
    /// it `why` (said in the log).
    pub(crate) fn set_aside(&self, address: &str, why: &str) {
        let mut aside = self.aside.lock().unwrap();
        let strikes = match &*aside {
            Some(a) if a.address == address => a.strikes + 1,
            _ => 1,
        };
        let time = aside_for(strikes);
        tracing::info!(dispatcher = %address, strikes, "Choosing jobs on our own for {} ms: the dispatcher at {address} {why}", time.as_millis());
        *aside = Some(Aside {
            address: address.to_string(),
            until: Instant::now() + time,
            strikes,
        });
    }

    /// The dispatcher at `address` answered a poll empty, or offered a job that was claimed:
    /// its next failure is its first.
    pub(crate) fn answered(&self, address: &str) {
        let mut aside = self.aside.lock().unwrap();
        if aside.as_ref().is_some_and(|a| a.address == address) {
            *aside = None;
        }
    }

    fn token(&self, address: &str) -> Result<String, Unusable> {
        std::fs::read_to_string(&self.config.token_file)
            .map(|t| t.trim().to_string())
            .map_err(|e| Unusable {
                address: address.to_string(),
                why: format!(
                    "cannot be asked: the token file {} cannot be read ({e})",
                    self.config.token_file.display()
                ),
            })
    }

    /// Asks the dispatcher at `address` for a job of the [`Asker`]'s queue, waiting up to
    /// `wait` (at most [`POLL_WAIT`]). `Ok(None)` when none came in time; an error (including
    /// a silence of [`SILENCE_BOUND`] while it waits) sets the dispatcher aside.
    /// `own`: the free slots of this claimer's own to name (concurrency key, or none for the
    /// queue's scope; index), so that the dispatcher may offer a job they fit and suggest them
    /// (docs/protocol.md, "Limits": swapping one's own slot); none are named when empty.
    pub async fn poll(
        &self,
        address: &str,
        wait: Duration,
        own: Vec<(Option<String>, u32)>,
    ) -> Result<Option<Hint>, Unusable> {
        let answer = self.ask(address, wait, own).await;
        // An empty answer shows a working dispatcher; an offer shows that only once it can be
        // claimed ([`Dispatched::answered`] from the claim), or a dispatcher offering jobs that
        // cannot be claimed would start again at one strike at each offer.
        if matches!(answer, Ok(None)) {
            self.answered(address);
        }
        answer
    }

    async fn ask(
        &self,
        address: &str,
        wait: Duration,
        own: Vec<(Option<String>, u32)>,
    ) -> Result<Option<Hint>, Unusable> {
        let wait = wait.min(POLL_WAIT);
        let Asker {
            namespace,
            queue,
            worker,
        } = &self.asker;
        let mut body = json!({"namespace": namespace, "queue": queue, "worker": worker,
            "waitMs": u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            "keepAliveMs": u64::try_from(KEEP_ALIVE.as_millis()).unwrap_or(250)});
        let refused = self.own_refused.lock().unwrap().as_deref() == Some(address);
        let names_own = !own.is_empty() && !refused;
        if names_own {
            let slots: Vec<_> = own
                .into_iter()
                .map(|(key, index)| match key {
                    Some(key) => json!({"key": key, "index": index}),
                    None => json!({"index": index}),
                })
                .collect();
            body["ownSlots"] = json!(slots);
        }
        let sent = self.post(address, "/v1/dispatch/poll", body, None);
        let response = match tokio::time::timeout(SILENCE_BOUND, sent).await {
            Ok(Ok(response)) => response,
            Ok(Err(e)) => {
                return Err(
                    self.unusable(address, format!("could not be asked ({})", error_chain(&e)))
                )
            }
            Err(_) => {
                return Err(self.unusable(
                    address,
                    format!(
                        "did not answer a poll within {} ms",
                        SILENCE_BOUND.as_millis()
                    ),
                ))
            }
        };
        let status = response.status();
        if status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let text = self.read_answer(address, response).await?;
        if !status.is_success() {
            let text: String = text.chars().take(300).collect();
            if names_own && status == reqwest::StatusCode::BAD_REQUEST {
                // Most likely a dispatcher from before ownSlots: ask it without them.
                *self.own_refused.lock().unwrap() = Some(address.to_string());
            }
            return Err(self.unusable(address, format!("refused a poll with {status}: {text}")));
        }
        let answer: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            self.unusable(
                address,
                format!("answered a poll with a body that is not JSON ({e})"),
            )
        })?;
        if let Some(code) = answer.get("error").and_then(|c| c.as_str()) {
            return Err(self.unusable(address, format!("refused a poll: {code}")));
        }
        if answer.as_object().is_some_and(|o| o.is_empty()) {
            return Ok(None);
        }
        serde_json::from_value::<Hint>(answer)
            .map(Some)
            .map_err(|e| {
                self.unusable(
                    address,
                    format!("answered a poll with a body that is not a job's name ({e})"),
                )
            })
    }

    /// Reads a poll's answer: its body, keep-alive newlines and all, each chunk within
    /// [`SILENCE_BOUND`] of the last, at most [`MAX_ANSWER_BYTES`] besides the newlines.
    async fn read_answer(
        &self,
        address: &str,
        mut response: reqwest::Response,
    ) -> Result<String, Unusable> {
        let mut text = Vec::new();
        loop {
            match tokio::time::timeout(SILENCE_BOUND, response.chunk()).await {
                Ok(Ok(Some(chunk))) => {
                    text.extend(chunk.iter().filter(|b| **b != b'\n'));
                    if text.len() > MAX_ANSWER_BYTES {
                        return Err(self.unusable(
                            address,
                            format!("answered a poll with over {MAX_ANSWER_BYTES} bytes"),
                        ));
                    }
                }
                Ok(Ok(None)) => return Ok(String::from_utf8_lossy(&text).into_owned()),
                Ok(Err(e)) => {
                    return Err(self.unusable(
                        address,
                        format!("broke off a poll's answer ({})", error_chain(&e)),
                    ))
                }
                Err(_) => {
                    return Err(self.unusable(
                        address,
                        format!(
                            "went silent for {} ms in a poll's answer",
                            SILENCE_BOUND.as_millis()
                        ),
                    ))
                }
            }
        }
    }

    /// Tells the dispatcher at `address` that this worker could not claim the job `name` it
    /// was offered, so it is offered to others at once. Best effort: a lost word costs the
    /// offer's time to lapse.
    pub async fn declined(&self, address: &str, name: &str) {
        let Asker {
            namespace,
            queue,
            worker,
        } = &self.asker;
        let body = json!({"namespace": namespace, "queue": queue, "worker": worker, "name": name});
        let _ = self
            .post(address, "/v1/dispatch/declined", body, Some(SILENCE_BOUND))
            .await;
    }

    /// Posts `body` to `path`; `bound` limits the whole exchange (none for a poll, whose
    /// answer is read chunk by chunk).
    async fn post(
        &self,
        address: &str,
        path: &str,
        body: serde_json::Value,
        bound: Option<Duration>,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let token = match self.token(address) {
            Ok(t) => t,
            Err(e) => {
                self.set_aside(address, &e.why);
                // An empty token is refused by the dispatcher (401), which sets it aside too.
                String::new()
            }
        };
        let mut request = self
            .http
            .post(format!("http://{address}{path}"))
            .bearer_auth(token)
            .json(&body);
        if let Some(bound) = bound {
            request = request.timeout(bound);
        }
        request.send().await
    }

    fn unusable(&self, address: &str, why: String) -> Unusable {
        self.set_aside(address, &why);
        Unusable {
            address: address.to_string(),
            why,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dispatcher_failing_again_and_again_is_set_aside_longer_up_to_five_seconds() {
        let secs: Vec<u64> = (1..=6).map(|n| aside_for(n).as_millis() as u64).collect();
        assert_eq!(secs, [1000, 2000, 4000, 5000, 5000, 5000]);
        assert_eq!(aside_for(u32::MAX), SET_ASIDE);
        assert_eq!(aside_for(0), FIRST_SET_ASIDE);
    }

    #[test]
    fn a_hint_names_a_job_only_with_an_object_name_and_a_resource_version_of_letters_and_digits() {
        let hint = |name: &str, version: &str| Hint {
            name: name.into(),
            resource_version: version.into(),
            queue_slot: None,
            key_slot: None,
            own_queue_slot: false,
            own_key_slot: false,
        };
        assert!(hint("job-1", "7").is_well_formed());
        assert!(hint("a.b-c", &"9".repeat(64)).is_well_formed());
        for (name, version) in [
            ("", "7"),
            ("../../other/leasedjobs/x", "7"),
            ("x/status", "7"),
            ("Upper", "7"),
            ("job?watch=1", "7"),
            (&*"a".repeat(254), "7"),
            ("job", ""),
            ("job", "7&limit=1"),
            ("job", "-1"),
            ("job", &*"9".repeat(65)),
        ] {
            assert!(
                !hint(name, version).is_well_formed(),
                "{name:?} {version:?}"
            );
        }
    }

    #[test]
    fn a_suggested_slot_that_is_no_index_is_no_suggestion_and_the_offer_stands() {
        let read = |slots: &str| {
            let text = format!(r#"{{"name": "j", "resourceVersion": "7"{slots}}}"#);
            serde_json::from_str::<Hint>(&text).map(|h| h.preferred())
        };
        let none = Preferred::NONE;
        assert_eq!(read("").unwrap(), none);
        assert_eq!(
            read(r#", "queueSlot": 2, "keySlot": 0"#).unwrap(),
            Preferred {
                queue: Some(2),
                key: Some(0)
            }
        );
        for bad in [
            "-1",
            "1.5",
            "1.0",
            r#""1""#,
            "null",
            "4294967296",
            "[1]",
            "{}",
        ] {
            let got = read(&format!(r#", "keySlot": {bad}, "queueSlot": {bad}"#));
            assert_eq!(got.unwrap(), none, "{bad}");
        }
        // The rest of the answer is read as before.
        assert!(serde_json::from_str::<Hint>(r#"{"name": 3, "resourceVersion": "7"}"#).is_err());
    }

    #[test]
    fn only_a_slot_marked_as_the_claimer_s_own_is_to_swap() {
        let read = |text: &str| {
            let text = format!(r#"{{"name": "j", "resourceVersion": "7"{text}}}"#);
            serde_json::from_str::<Hint>(&text).unwrap().swappable()
        };
        assert_eq!(read(r#", "keySlot": 2"#), Preferred::NONE);
        let key = Preferred {
            queue: None,
            key: Some(2),
        };
        assert_eq!(
            read(r#", "keySlot": 2, "queueSlot": 1, "ownKeySlot": true"#),
            key
        );
        for not in ["false", "1", r#""true""#, "null"] {
            let got = read(&format!(r#", "keySlot": 2, "ownKeySlot": {not}"#));
            assert_eq!(got, Preferred::NONE, "{not}");
        }
        assert_eq!(read(r#", "ownKeySlot": true"#), Preferred::NONE, "no slot");
    }
}
