//! Requests counted by the claimers' own clients: what they sent, whatever else the API server
//! counts meanwhile.
//!
//! Each request is counted as it is sent, under the [`Key`] the API server would count it
//! under, with the answer's status once it comes (`code` empty when none came: a request
//! whose wait was given up is still counted, as the API server counts it). A WATCH is counted
//! as it opens, where the API server counts it as it closes; paths that name no resource
//! (`/version`) are not counted. Only writes are read from it (row 2k).
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
                // Counted when dropped: when the answer came, or when the caller stopped
                // waiting for it (a timeout drops this future mid-request).
                let mut sent = Sent {
                    counts,
                    key: key_of(&request),
                };
                let answer = inner.send(request).await;
                if let (Some(key), Ok(response)) = (sent.key.as_mut(), &answer) {
                    key.code = response.status().as_u16().to_string();
                }
                drop(sent);
                answer
            }
        });
        Client::new(service, namespace)
    }

    /// Everything counted so far: [`Requests::since`] of two readings is what was sent
    /// between them.
    pub fn read(&self) -> Requests {
        Requests(self.0.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// One request sent, counted when dropped.
struct Sent {
    counts: CountedClients,
    key: Option<Key>,
}

impl Drop for Sent {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut counts = self.counts.0.lock().unwrap_or_else(|e| e.into_inner());
            *counts.entry(key).or_insert(0.0) += 1.0;
        }
    }
}

/// The [`Key`] the API server would count `request` under, without its `code`; None for a path
/// that names no resource (`/version`, `/metrics`). A namespace's own subresources
/// (`/api/v1/namespaces/<ns>/status`) would read as a resource of the namespace: the claimers
/// send none.
///
/// Paths: `/api/v1/...` (the core group) or `/apis/<group>/<version>/...`, then
/// `namespaces/<ns>/` for a namespaced resource, then `<resource>[/<name>[/<subresource>]]`.
/// Verbs as the API server names them: a GET without a name is a LIST, or a WATCH with
/// `watch=true`; a DELETE without a name is a DELETECOLLECTION; a PATCH whose body is an
/// apply configuration is an APPLY.
pub(crate) fn key_of<B>(request: &Request<B>) -> Option<Key> {
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
    fn a_request_is_counted_with_its_answer_or_without_one_when_given_up() {
        let counted = CountedClients::default();
        let put = key_of(
            &Request::builder()
                .method(Method::PUT)
                .uri("/apis/coordination.k8s.io/v1/namespaces/ns/leases/s")
                .body(())
                .unwrap(),
        );
        let mut answered = Sent {
            counts: counted.clone(),
            key: put.clone(),
        };
        answered.key.as_mut().unwrap().code = "409".into();
        drop(answered);
        drop(Sent {
            counts: counted.clone(),
            key: put,
        });
        let read = counted.read();
        let codes: Vec<(&str, f64)> = read.0.iter().map(|(k, n)| (k.code.as_str(), *n)).collect();
        assert_eq!(codes, vec![("", 1.0), ("409", 1.0)]);
        assert_eq!(read.sum(Key::is_write), 2.0);
    }

    #[test]
    fn requests_are_keyed_as_the_api_server_labels_them() {
        let jobs = "/apis/leasehold.dev/v1/namespaces/ns/leasedjobs";
        let leases = "/apis/coordination.k8s.io/v1/namespaces/ns/leases";
        let (lh, co) = ("leasehold.dev", "coordination.k8s.io");
        let cases = [
            (
                Method::PUT,
                format!("{jobs}/j-1/status"),
                k(lh, "leasedjobs", "status", "PUT"),
            ),
            (
                Method::GET,
                format!("{jobs}/j-1"),
                k(lh, "leasedjobs", "", "GET"),
            ),
            (
                Method::GET,
                jobs.to_string(),
                k(lh, "leasedjobs", "", "LIST"),
            ),
            (
                Method::GET,
                format!("{jobs}?watch=true&resourceVersion=5"),
                k(lh, "leasedjobs", "", "WATCH"),
            ),
            (
                Method::POST,
                leases.to_string(),
                k(co, "leases", "", "POST"),
            ),
            (
                Method::PUT,
                format!("{leases}/lhq-claim-k0-1"),
                k(co, "leases", "", "PUT"),
            ),
            (
                Method::DELETE,
                leases.to_string(),
                k(co, "leases", "", "DELETECOLLECTION"),
            ),
            (
                Method::PATCH,
                format!("{leases}/x?fieldManager=apply"),
                k(co, "leases", "", "APPLY"),
            ),
            (
                Method::POST,
                "/api/v1/namespaces/ns/events".into(),
                k("", "events", "", "POST"),
            ),
            (
                Method::GET,
                "/api/v1/namespaces/ns".into(),
                k("", "namespaces", "", "GET"),
            ),
            (
                Method::GET,
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/x".into(),
                k(
                    "apiextensions.k8s.io",
                    "customresourcedefinitions",
                    "",
                    "GET",
                ),
            ),
            (Method::GET, "/version".into(), None),
            (Method::GET, "/metrics".into(), None),
        ];
        for (method, uri, expected) in cases {
            assert_eq!(key(method, &uri), expected, "{uri}");
        }
    }
}
