//! Requests counted by the claimers' own clients: exactly what they sent, whatever else the API
//! server counts meanwhile.
//!
//! Why: the API server's `apiserver_request_total` counts every client's requests, among them
//! the control plane's own Lease renewals (leader election, by the second, not by the job). Net
//! of an estimate of those, row 2k's writes per job were only about as fine as the 0.002 to
//! 0.003 writes per job its goal turned on. A claimer's client counting its own requests has no
//! such background: the claimers write nothing while no job runs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use http::{Method, Request};
use kube::Client;

use crate::metrics::{Key, Requests};

/// Requests counted by the clients made with [`CountedClients::client`], by [`Key`] (as the
/// API server labels them), shared by all of them.
#[derive(Clone, Default)]
pub struct CountedClients(Arc<Mutex<BTreeMap<Key, f64>>>);

impl CountedClients {
    /// A client as `inner` (whose connections it uses) that counts every request it sends,
    /// with the answer's status (`code` empty when no answer came).
    pub fn client(&self, inner: Client) -> Client {
        let counts = self.clone();
        let namespace = inner.default_namespace().to_string();
        let service = tower::service_fn(move |request: Request<kube::client::Body>| {
            let (inner, counts) = (inner.clone(), counts.clone());
            async move {
                let key = key_of(&request);
                let answer = inner.send(request).await;
                if let Some(mut key) = key {
                    if let Ok(response) = &answer {
                        key.code = response.status().as_u16().to_string();
                    }
                    counts.add(key);
                }
                answer
            }
        });
        Client::new(service, namespace)
    }

    fn add(&self, key: Key) {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *counts.entry(key).or_insert(0.0) += 1.0;
    }

    /// Everything counted so far: [`Requests::since`] of two readings is what was sent
    /// between them.
    pub fn read(&self) -> Requests {
        Requests(self.0.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// The [`Key`] the API server would count `request` under, without its `code`; None for a path
/// that names no resource (`/version`, `/metrics`).
///
/// Paths: `/api/v1/...` (the core group) or `/apis/<group>/<version>/...`, then
/// `namespaces/<ns>/` for a namespaced resource, then `<resource>[/<name>[/<subresource>]]`.
/// Verbs as the API server names them: a GET without a name is a LIST, or a WATCH with
/// `watch=true`; a DELETE without a name is a DELETECOLLECTION; a PATCH whose body is an
/// apply configuration is an APPLY.
pub fn key_of<B>(request: &Request<B>) -> Option<Key> {
    let segments: Vec<&str> = request
        .uri()
        .path()
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let (group, rest) = match segments.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let rest = match rest {
        ["namespaces", _ns, resource, more @ ..] => {
            let mut r = vec![*resource];
            r.extend_from_slice(more);
            r
        }
        other => other.to_vec(),
    };
    let (resource, name, subresource) = match rest.as_slice() {
        [resource] => (*resource, None, ""),
        [resource, name] => (*resource, Some(*name), ""),
        [resource, name, sub] => (*resource, Some(*name), *sub),
        _ => return None,
    };
    let watch = request
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    let apply = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/apply-patch"));
    let verb = match (request.method(), name) {
        (&Method::GET, _) if watch => "WATCH",
        (&Method::GET, Some(_)) => "GET",
        (&Method::GET, None) => "LIST",
        (&Method::DELETE, None) => "DELETECOLLECTION",
        (&Method::PATCH, _) if apply => "APPLY",
        (m, _) => m.as_str(),
    };
    Some(Key {
        group: group.to_string(),
        resource: resource.to_string(),
        subresource: subresource.to_string(),
        verb: verb.to_string(),
        code: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(method: Method, uri: &str) -> Option<(String, String, String, String)> {
        let mut r = Request::builder().method(method).uri(uri);
        if uri.contains("apply") {
            r = r.header("content-type", "application/apply-patch+yaml");
        }
        key_of(&r.body(()).unwrap()).map(|k| (k.group, k.resource, k.subresource, k.verb))
    }

    fn k(
        group: &str,
        resource: &str,
        sub: &str,
        verb: &str,
    ) -> Option<(String, String, String, String)> {
        Some((group.into(), resource.into(), sub.into(), verb.into()))
    }

    #[test]
    fn requests_are_keyed_as_the_api_server_labels_them() {
        let jobs = "/apis/leasehold.dev/v1/namespaces/ns/leasedjobs";
        assert_eq!(
            key(Method::PUT, &format!("{jobs}/j-1/status")),
            k("leasehold.dev", "leasedjobs", "status", "PUT")
        );
        assert_eq!(
            key(Method::GET, &format!("{jobs}/j-1")),
            k("leasehold.dev", "leasedjobs", "", "GET")
        );
        assert_eq!(
            key(Method::GET, jobs),
            k("leasehold.dev", "leasedjobs", "", "LIST")
        );
        assert_eq!(
            key(Method::GET, &format!("{jobs}?watch=true&resourceVersion=5")),
            k("leasehold.dev", "leasedjobs", "", "WATCH")
        );
        let leases = "/apis/coordination.k8s.io/v1/namespaces/ns/leases";
        assert_eq!(
            key(Method::POST, leases),
            k("coordination.k8s.io", "leases", "", "POST")
        );
        assert_eq!(
            key(Method::PUT, &format!("{leases}/lhq-claim-k0-1")),
            k("coordination.k8s.io", "leases", "", "PUT")
        );
        assert_eq!(
            key(Method::DELETE, leases),
            k("coordination.k8s.io", "leases", "", "DELETECOLLECTION")
        );
        assert_eq!(
            key(Method::PATCH, &format!("{leases}/x?fieldManager=apply")),
            k("coordination.k8s.io", "leases", "", "APPLY")
        );
        assert_eq!(
            key(Method::POST, "/api/v1/namespaces/ns/events"),
            k("", "events", "", "POST")
        );
        assert_eq!(
            key(Method::GET, "/api/v1/namespaces/ns"),
            k("", "namespaces", "", "GET")
        );
        assert_eq!(
            key(
                Method::GET,
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/x"
            ),
            k(
                "apiextensions.k8s.io",
                "customresourcedefinitions",
                "",
                "GET"
            )
        );
        assert_eq!(key(Method::GET, "/version"), None);
        assert_eq!(key(Method::GET, "/metrics"), None);
    }
}
