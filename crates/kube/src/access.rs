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
type Cached = (Result<(), Refusal>, Instant);

/// Whom an answer is for: the token's hash and the namespace asked about.
type Key = (u64, String);

/// Held while a key is reviewed.
type Gate = Arc<tokio::sync::Mutex<()>>;

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

    /// Whether the holder of `token` may ask about the queues of `namespace`.
    ///
    /// # Errors
    /// [`ReviewFailed`] when a review could not be made; the caller answers 503.
    pub async fn check(
        &self,
        token: Option<&str>,
        namespace: &str,
    ) -> Result<Result<(), Refusal>, ReviewFailed> {
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
        // Another poll may have made the review while this one waited at the gate.
        if let Some(answer) = self.cached(&key) {
            return Ok(answer);
        }
        let answer = self.review(token, namespace).await;
        self.reviewing.lock().unwrap().remove(&key);
        let answer = answer?;
        let mut cache = self.cache.lock().unwrap();
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(key, (answer.clone(), Instant::now()));
        Ok(answer)
    }

    /// The answer cached for `key`, if it is younger than [`ACCESS_TTL`].
    fn cached(&self, key: &Key) -> Option<Result<(), Refusal>> {
        let cache = self.cache.lock().unwrap();
        let (answer, at) = cache.get(key)?;
        (at.elapsed() < ACCESS_TTL).then(|| answer.clone())
    }

    async fn review(
        &self,
        token: &str,
        namespace: &str,
    ) -> Result<Result<(), Refusal>, ReviewFailed> {
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
            Ok(Ok(()))
        } else {
            Ok(Err(Refusal::NotAllowed {
                user: user.username.unwrap_or_default(),
                namespace: namespace.to_string(),
            }))
        }
    }
}
