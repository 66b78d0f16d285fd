//! `kubectl leasehold submit`: creates a LeasedJob, idempotently when given a key
//! ([`leasehold_core::submit`]: the name from the queue and the key, the key and the spec's hash
//! in annotations), and, with `--wait`, waits for it to finish.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject, PostParams, WatchParams};
use kube::core::WatchEvent;
use kube::{Api, ResourceExt};
use serde_json::{json, Map, Value};

use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::submit::{self, KEY_ANNOTATION, SPEC_HASH_ANNOTATION};
use leasehold_core::trace::{self, TRACEPARENT_ANNOTATION};
use leasehold_kube::api::{is_status, Clients};

use super::{api_error, PluginError};

/// What to submit: the spec's fields as given (None: not set, so the job gets its queue's or
/// leasehold's default), and how to name the job.
#[derive(Clone, Debug, Default)]
pub struct Submission {
    /// spec.queue (a DNS label).
    pub queue: String,
    /// spec.payload (any JSON).
    pub payload: Value,
    /// The idempotency key: the job's name comes from it (and the queue).
    pub key: Option<String>,
    /// The job's name; without it and without a key, the API server generates one
    /// (`<queue>-<random>`).
    pub name: Option<String>,
    /// spec.priority.
    pub priority: Option<i32>,
    /// spec.leaseDurationSeconds.
    pub lease_duration_seconds: Option<i32>,
    /// spec.maxAttempts.
    pub max_attempts: Option<i32>,
    /// spec.notBefore (RFC 3339).
    pub not_before: Option<String>,
    /// spec.concurrencyKey.
    pub concurrency_key: Option<String>,
    /// metadata.labels.
    pub labels: BTreeMap<String, String>,
    /// The producer's W3C traceparent, set as the annotation [`TRACEPARENT_ANNOTATION`] (not
    /// part of the spec, so not of the spec hash: [`leasehold_core::trace`]). Checked by
    /// [`submit()`].
    pub traceparent: Option<String>,
}

impl Submission {
    /// The spec as submitted: the fields given, in camelCase, and nothing else (this is what
    /// [`submit::spec_hash`] hashes, so every producer builds it the same way).
    pub fn spec(&self) -> Value {
        let mut spec = Map::new();
        spec.insert("queue".into(), json!(self.queue));
        spec.insert("payload".into(), self.payload.clone());
        let optional = [
            ("priority", self.priority.map(|v| json!(v))),
            (
                "leaseDurationSeconds",
                self.lease_duration_seconds.map(|v| json!(v)),
            ),
            ("maxAttempts", self.max_attempts.map(|v| json!(v))),
            ("notBefore", self.not_before.as_ref().map(|v| json!(v))),
            (
                "concurrencyKey",
                self.concurrency_key.as_ref().map(|v| json!(v)),
            ),
        ];
        for (field, value) in optional {
            if let Some(value) = value {
                spec.insert(field.into(), value);
            }
        }
        Value::Object(spec)
    }
}

/// Creates the job of `submission` in `namespace`. With a key, a job already made by the same
/// submission (same key and spec, by any producer) is returned instead, with `false`.
///
/// # Errors
/// [`PluginError::Key`] for a bad key; [`PluginError::TraceParent`] for a malformed
/// traceparent; [`PluginError::Submit`] when the key's job exists with
/// another spec or was not submitted with the key; [`PluginError::Api`] when the API server
/// refuses the job (its message names the field and the rule) or cannot be reached.
pub async fn submit(
    clients: &Clients,
    namespace: &str,
    submission: &Submission,
) -> Result<(LeasedJob, bool), PluginError> {
    let api: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), namespace);
    let spec = submission.spec();
    let mut annotations = Map::new();
    if let Some(traceparent) = &submission.traceparent {
        trace::parse_traceparent(traceparent)?;
        annotations.insert(TRACEPARENT_ANNOTATION.into(), json!(traceparent));
    }
    let name = match (&submission.key, &submission.name) {
        (Some(key), name) => {
            submit::check_key(key)?;
            annotations.insert(KEY_ANNOTATION.into(), json!(key));
            annotations.insert(SPEC_HASH_ANNOTATION.into(), json!(submit::spec_hash(&spec)));
            Some(
                name.clone()
                    .unwrap_or_else(|| submit::name_for_key(&submission.queue, key)),
            )
        }
        (None, Some(name)) => Some(name.clone()),
        (None, None) => None,
    };
    let mut metadata = json!({"labels": submission.labels});
    if !annotations.is_empty() {
        metadata["annotations"] = Value::Object(annotations);
    }
    match &name {
        Some(name) => metadata["name"] = json!(name),
        None => metadata["generateName"] = json!(format!("{}-", submission.queue)),
    }
    // Sent as built, never through the typed LeasedJob, whose lenient readers would drop or
    // rewrite a value the API server must judge (a notBefore that is not RFC 3339 would
    // vanish, and the job would run at once).
    let job: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1",
        "kind": "LeasedJob",
        "metadata": metadata,
        "spec": spec,
    }))
    .map_err(|e| PluginError::Api {
        what: "building the LeasedJob".into(),
        detail: e.to_string(),
    })?;
    let raw: Api<DynamicObject> = Api::namespaced_with(
        clients.requests.clone(),
        namespace,
        &ApiResource::erase::<LeasedJob>(&()),
    );
    let shown = format!(
        "{namespace}/{}",
        name.as_deref()
            .unwrap_or(&format!("{}-…", submission.queue))
    );
    match raw.create(&PostParams::default(), &job).await {
        Ok(created) => {
            let created = serde_json::to_value(created)
                .and_then(serde_json::from_value)
                .map_err(|e| PluginError::Api {
                    what: format!("reading the created LeasedJob {shown}"),
                    detail: e.to_string(),
                })?;
            Ok((created, true))
        }
        Err(e) if is_status(&e, 409) && submission.key.is_some() => {
            let name = name.expect("a key names the job");
            let existing = api
                .get(&name)
                .await
                .map_err(|e| api_error(format!("reading LeasedJob {namespace}/{name}"), &e))?;
            let key = submission.key.as_deref().expect("checked above");
            submit::judge_existing(&existing, key, &spec)?;
            Ok((existing, false))
        }
        Err(e) => Err(api_error(format!("creating LeasedJob {shown}"), &e)),
    }
}

/// Waits until job `name` of `namespace` has finished (Succeeded, Failed or Cancelled), for at
/// most `timeout` (None: for ever), following it with a watch (re-read after any break, a
/// 410 included). Returns the finished job.
///
/// # Errors
/// [`PluginError::NotFound`] when the job is or gets deleted; [`PluginError::Timeout`];
/// [`PluginError::Api`] when it cannot be read.
pub async fn await_finished(
    clients: &Clients,
    namespace: &str,
    name: &str,
    timeout: Option<Duration>,
) -> Result<LeasedJob, PluginError> {
    let api: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), namespace);
    let job_ref = format!("{namespace}/{name}");
    let follow = async {
        loop {
            let job = api
                .get_opt(name)
                .await
                .map_err(|e| api_error(format!("reading LeasedJob {job_ref}"), &e))?
                .ok_or_else(|| PluginError::NotFound(job_ref.clone()))?;
            if job.phase().is_finished() {
                return Ok(job);
            }
            let params = WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(290);
            let version = job.resource_version().unwrap_or_default();
            let mut events = match api.watch(&params, &version).await {
                Ok(events) => events.boxed(),
                // Refusals that waiting does not change: say so, rather than wait for ever.
                Err(e) if [401, 403, 404].iter().any(|s| is_status(&e, *s)) => {
                    return Err(api_error(format!("watching LeasedJob {job_ref}"), &e));
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            while let Some(event) = events.next().await {
                match event {
                    Ok(WatchEvent::Added(job) | WatchEvent::Modified(job))
                        if job.phase().is_finished() =>
                    {
                        return Ok(job);
                    }
                    Ok(WatchEvent::Deleted(_)) => {
                        return Err(PluginError::Deleted(job_ref.clone()))
                    }
                    Ok(WatchEvent::Error(_)) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        }
    };
    match timeout {
        None => follow.await,
        Some(limit) => {
            tokio::time::timeout(limit, follow)
                .await
                .map_err(|_| PluginError::Timeout {
                    job: job_ref.clone(),
                    waited: limit,
                })?
        }
    }
}

/// What a finished job's outcome says, for a person: its result (Succeeded), or its phase,
/// the reason of its finished condition and its failures, one per line.
pub fn outcome_text(job: &LeasedJob) -> String {
    let status = job.status.clone().unwrap_or_default();
    match job.phase() {
        Phase::Succeeded => status
            .result
            .map(|r| r.to_string())
            .unwrap_or_else(|| "null".into()),
        phase => {
            let mut text = format!("LeasedJob {} {phase}", job.reference());
            if let Some(c) = status
                .conditions
                .iter()
                .find(|c| c.status == "True" && (c.type_ == "Failed" || c.type_ == "Cancelled"))
            {
                text.push_str(&format!(": {} ({})", c.reason, c.message));
            }
            for f in &status.failures {
                text.push_str(&format!(
                    "\n  attempt {} on {}: {}: {}",
                    f.attempt, f.holder, f.reason, f.message
                ));
            }
            text
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_holds_only_what_was_given() {
        let mut s = Submission {
            queue: "media".into(),
            payload: json!({"url": "s3://a/b.wav"}),
            ..Submission::default()
        };
        assert_eq!(
            s.spec(),
            json!({"queue": "media", "payload": {"url": "s3://a/b.wav"}})
        );
        s.priority = Some(5);
        s.concurrency_key = Some("tenant-a".into());
        assert_eq!(
            submit::canonical_json(&s.spec()),
            r#"{"concurrencyKey":"tenant-a","payload":{"url":"s3://a/b.wav"},"priority":5,"queue":"media"}"#
        );
    }
}
