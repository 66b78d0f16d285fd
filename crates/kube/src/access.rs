//! Who may ask the dispatcher: a caller proves who it is with a bearer token the API server
//! issued (a pod's projected service-account token), and may ask about a namespace's queues
//! only if it may claim there, that is update `leasedjobs/status` in that namespace. Both are
//! the API server's own answers: a TokenReview (authentication.k8s.io/v1) and a
//! SubjectAccessReview (authorization.k8s.io/v1), as kube-rbac-proxy and the aggregated API
//! servers' delegated authentication do.
//!
//! Answers are cached for [`ACCESS_TTL`] per (token, namespace), so a sidecar's polls cost the
//! API server two reviews a minute, not two per poll. A refusal names the rule, never another
//! namespace's jobs.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use thiserror::Error;
use tokio::time::Instant;

use leasehold_core::crd::GROUP;

/// The audience a caller's token must be issued for: a projected service-account token with
/// this audience (`serviceAccountToken.audience` of a projected volume, or `kubectl create
/// token --audience`). The API server itself refuses such a token, so a token sent to a
/// dispatcher (over plain HTTP inside the cluster) grants nothing anywhere else.
pub const AUDIENCE: &str = "leasehold-dispatcher";

/// How long an answer about one (token, namespace) is reused.
pub const ACCESS_TTL: Duration = Duration::from_secs(60);

/// Cached answers past this many are dropped at once (a bound on memory, whoever calls).
const MAX_CACHED: usize = 10_000;

/// Why a caller may not ask.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum Refusal {
    /// No bearer token was presented.
    #[error("no bearer token: present the pod's service-account token in Authorization")]
    NoToken,
    /// The API server did not accept the token (for [`AUDIENCE`]).
    #[error("the bearer token was not accepted by the API server's TokenReview for audience leasehold-dispatcher (a projected service-account token with that audience is needed)")]
    NotAuthenticated,
    /// The caller may not claim in the namespace.
    #[error("{user} may not update leasedjobs/status in namespace {namespace}: only those who may claim there may ask for its jobs")]
    NotAllowed {
        /// The caller, as the TokenReview named it.
        user: String,
        /// The namespace asked about.
        namespace: String,
    },
}

/// Who a caller is, as the API server's TokenReview named it: the user (for a service-account
/// token, `system:serviceaccount:<namespace>:<name>`) and, for a token bound to a pod (the
/// tokens the kubelet projects into pods are), that pod: its name and uid, from the review's
/// `extra` (`authentication.kubernetes.io/pod-name`, `.../pod-uid`). Two sidecars with tokens
/// of one ServiceAccount are one caller unless their tokens are bound to their pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The user's name.
    pub user: String,
    /// The pod the token is bound to, `<name>/<uid>` (only the name when the review gives no
    /// uid); None for a token bound to no pod.
    pub pod: Option<String>,
}

impl Caller {
    /// The worker `word` (the name a request gives) as this caller: a key that two requests
    /// share only when both the caller and the word are the same. Lengths prefix the parts,
    /// so no choice of names makes two callers' keys equal.
    pub fn worker(&self, word: &str) -> String {
        let pod = self.pod.as_deref().unwrap_or("");
        format!(
            "{}:{}|{}:{}|{word}",
            self.user.len(),
            self.user,
            pod.len(),
            pod
        )
    }

    fn of(user: &k8s_openapi::api::authentication::v1::UserInfo) -> Caller {
        let one = |key: &str| {
            let values = user.extra.as_ref()?.get(key)?;
            match values.as_slice() {
                [value] if !value.is_empty() => Some(value.clone()),
                _ => None,
            }
        };
        let pod = one(POD_NAME).map(|name| match one(POD_UID) {
            Some(uid) => format!("{name}/{uid}"),
            None => name,
        });
        Caller {
            user: user.username.clone().unwrap_or_default(),
            pod,
        }
    }
}

/// The TokenReview's `extra` key naming the pod a token is bound to.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
/// The TokenReview's `extra` key giving that pod's uid.
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// A review could not be made (the API server failed or is unreachable).
#[derive(Debug, Error)]
#[error("{review} failed")]
pub struct ReviewFailed {
    /// `TokenReview` or `SubjectAccessReview`.
    pub review: &'static str,
    /// The underlying error.
    #[source]
    pub source: kube::Error,
}

/// An answer, and when it was given.
type Cached = (Result<Caller, Refusal>, Instant);

/// Whom an answer is for: the token's hash and the namespace asked about.
type Key = (u64, String);

/// Held while a key is reviewed.
type Gate = Arc<tokio::sync::Mutex<()>>;

/// Removes a gate from the map of reviews under way when dropped, if it is still the one there
/// for its key (a later poll may have put another).
struct GateGone<'a> {
    reviewing: &'a Mutex<HashMap<Key, Gate>>,
    key: &'a Key,
    gate: &'a Gate,
}

impl Drop for GateGone<'_> {
    fn drop(&mut self) {
        let mut reviewing = self.reviewing.lock().unwrap();
        if reviewing
            .get(self.key)
            .is_some_and(|g| Arc::ptr_eq(g, self.gate))
        {
            reviewing.remove(self.key);
        }
    }
}

/// The reviews, and their cached answers.
pub struct Access {
    client: Client,
    /// (the token's hash, namespace) -> the answer and when it was given. The hash's keys are
    /// random per process, so no token is held and no one can aim at another's entry.
    cache: Mutex<HashMap<Key, Cached>>,
    /// One gate per key being reviewed: the polls of many sidecars sharing a token, arriving
    /// together when its answer lapses, wait for one review instead of each making its own.
    reviewing: Mutex<HashMap<Key, Gate>>,
    keys: RandomState,
}

impl Access {
    /// Reviews through `client` (which needs `create` on tokenreviews and
    /// subjectaccessreviews, as the ClusterRole `system:auth-delegator` grants).
    pub fn new(client: Client) -> Access {
        Access {
            client,
            cache: Mutex::new(HashMap::new()),
            reviewing: Mutex::new(HashMap::new()),
            keys: RandomState::new(),
        }
    }

    /// Whether the holder of `token` may ask about the queues of `namespace`: who it is, or
    /// why not.
    ///
    /// # Errors
    /// [`ReviewFailed`] when a review could not be made; the caller answers 503.
    pub async fn check(
        &self,
        token: Option<&str>,
        namespace: &str,
    ) -> Result<Result<Caller, Refusal>, ReviewFailed> {
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            return Ok(Err(Refusal::NoToken));
        };
        let key = (self.keys.hash_one(token), namespace.to_string());
        if let Some(answer) = self.cached(&key) {
            return Ok(answer);
        }
        let gate = Arc::clone(
            self.reviewing
                .lock()
                .unwrap()
                .entry(key.clone())
                .or_default(),
        );
        let _reviewing = gate.lock().await;
        // The gate leaves the map however this ends: answered, failed, or dropped mid-review
        // (its poll's caller went away), which left it there for good.
        let _gone = GateGone {
            reviewing: &self.reviewing,
            key: &key,
            gate: &gate,
        };
        // Another poll may have made the review while this one waited at the gate.
        if let Some(answer) = self.cached(&key) {
            return Ok(answer);
        }
        let answer = self.review(token, namespace).await?;
        let mut cache = self.cache.lock().unwrap();
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(key.clone(), (answer.clone(), Instant::now()));
        Ok(answer)
    }

    /// The answer cached for `key`, if it is younger than [`ACCESS_TTL`].
    fn cached(&self, key: &Key) -> Option<Result<Caller, Refusal>> {
        let cache = self.cache.lock().unwrap();
        let (answer, at) = cache.get(key)?;
        (at.elapsed() < ACCESS_TTL).then(|| answer.clone())
    }

    async fn review(
        &self,
        token: &str,
        namespace: &str,
    ) -> Result<Result<Caller, Refusal>, ReviewFailed> {
        let reviews: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![AUDIENCE.to_string()]),
            },
            ..TokenReview::default()
        };
        let reviewed = reviews
            .create(&PostParams::default(), &review)
            .await
            .map_err(|source| ReviewFailed {
                review: "TokenReview",
                source,
            })?;
        let status = reviewed.status.unwrap_or_default();
        let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
            return Ok(Err(Refusal::NotAuthenticated));
        };
        let access: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let question = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                groups: user.groups.clone(),
                uid: user.uid.clone(),
                extra: user.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_string()),
                    verb: Some("update".into()),
                    group: Some(GROUP.into()),
                    resource: Some("leasedjobs".into()),
                    subresource: Some("status".into()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let answered = access
            .create(&PostParams::default(), &question)
            .await
            .map_err(|source| ReviewFailed {
                review: "SubjectAccessReview",
                source,
            })?;
        if answered.status.is_some_and(|s| s.allowed) {
            Ok(Ok(Caller::of(&user)))
        } else {
            Ok(Err(Refusal::NotAllowed {
                user: user.username.unwrap_or_default(),
                namespace: namespace.to_string(),
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::authentication::v1::UserInfo;

    use super::*;

    fn user(name: &str, extra: &[(&str, &[&str])]) -> UserInfo {
        UserInfo {
            username: Some(name.into()),
            extra: Some(
                extra
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..UserInfo::default()
        }
    }

    #[test]
    fn a_caller_is_its_user_and_the_pod_its_token_is_bound_to() {
        let sa = "system:serviceaccount:ns:claimer";
        let plain = Caller::of(&user(sa, &[]));
        assert_eq!(
            plain,
            Caller {
                user: sa.into(),
                pod: None
            }
        );
        let bound = Caller::of(&user(sa, &[(POD_NAME, &["w-1"]), (POD_UID, &["u1"])]));
        assert_eq!(bound.pod.as_deref(), Some("w-1/u1"));
        let no_uid = Caller::of(&user(sa, &[(POD_NAME, &["w-1"])]));
        assert_eq!(no_uid.pod.as_deref(), Some("w-1"));
        // Anything but one pod name is no pod.
        for odd in [&[][..], &["a", "b"][..], &[""][..]] {
            assert_eq!(
                Caller::of(&user(sa, &[(POD_NAME, odd)])).pod,
                None,
                "{odd:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_review_given_up_half_way_leaves_no_gate_behind() {
        // An API server that accepts the connection and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", silent.local_addr().unwrap());
        let _held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                open.push(socket);
            }
        });
        let config = kube::Config::new(url.parse().unwrap());
        let access = Arc::new(Access::new(Client::try_from(config).unwrap()));
        let asking = {
            let access = Arc::clone(&access);
            tokio::spawn(async move { access.check(Some("a-token"), "ns").await })
        };
        tokio::time::timeout(Duration::from_secs(5), async {
            while access.reviewing.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the review started");
        asking.abort();
        let _ = asking.await;
        assert!(access.reviewing.lock().unwrap().is_empty());
        assert!(access.cache.lock().unwrap().is_empty());
    }

    #[test]
    fn two_callers_never_share_a_worker_key() {
        let caller = |user: &str, pod: Option<&str>| Caller {
            user: user.into(),
            pod: pod.map(str::to_string),
        };
        let a = caller("system:serviceaccount:ns:a", Some("p/1"));
        assert_eq!(a.worker("w"), a.clone().worker("w"));
        let others = [
            caller("system:serviceaccount:ns:b", Some("p/1")),
            caller("system:serviceaccount:ns:a", Some("p/2")),
            caller("system:serviceaccount:ns:a", None),
        ];
        for other in &others {
            assert_ne!(a.worker("w"), other.worker("w"), "{other:?}");
        }
        assert_ne!(a.worker("w"), a.worker("w2"));
        // Separators inside names do not make two keys meet.
        assert_ne!(
            caller("a|1:b", None).worker("c"),
            caller("a", Some("b")).worker("c")
        );
        assert_ne!(
            caller("u", Some("x|1:y")).worker("z"),
            caller("u", Some("x")).worker("y|z")
        );
    }
}
