//! The API server's own request counter, `apiserver_request_total`, read from its `/metrics`
//! endpoint: what the benchmark counts requests with, instead of trusting our own code (row
//! 2k also reads its claimers' writes from their own clients' count, [`crate::counted`]).

use std::collections::BTreeMap;

use anyhow::Context as _;
use kube::Client;

/// The labels of `apiserver_request_total` that the benchmark looks at.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    /// API group (empty for the core group).
    pub group: String,
    /// Resource, e.g. `leasedjobs`.
    pub resource: String,
    /// Subresource, e.g. `status` (empty for the object itself).
    pub subresource: String,
    /// `GET`, `LIST`, `WATCH`, `POST`, `PUT`, `PATCH`, `APPLY`, `DELETE`, ...
    pub verb: String,
    /// HTTP status code.
    pub code: String,
}

impl Key {
    /// True for verbs that write.
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "POST" | "PUT" | "PATCH" | "APPLY" | "DELETE" | "DELETECOLLECTION"
        )
    }
}

/// Request counts by [`Key`] (summed over the labels not in the key).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Requests(pub BTreeMap<Key, f64>);

impl Requests {
    /// Parses the Prometheus text exposition format, keeping `apiserver_request_total`.
    pub fn parse(text: &str) -> Requests {
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once('}') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let labels = parse_labels(labels);
            let get = |k: &str| labels.get(k).cloned().unwrap_or_default();
            let key = Key {
                group: get("group"),
                resource: get("resource"),
                subresource: get("subresource"),
                verb: get("verb"),
                code: get("code"),
            };
            *out.entry(key).or_insert(0.0) += value;
        }
        Requests(out)
    }

    /// The requests counted since `before` (counters only grow; a restart would show as 0).
    pub fn since(&self, before: &Requests) -> Requests {
        Requests(
            self.0
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        (v - before.0.get(k).copied().unwrap_or(0.0)).max(0.0),
                    )
                })
                .filter(|(_, v)| *v > 0.0)
                .collect(),
        )
    }

    /// These counts and `other`'s, added key by key (requests of several runs taken together).
    pub fn plus(&self, other: &Requests) -> Requests {
        let mut out = self.0.clone();
        for (k, v) in &other.0 {
            *out.entry(k.clone()).or_insert(0.0) += v;
        }
        Requests(out)
    }

    /// The sum of the counts whose key matches.
    pub fn sum(&self, matches: impl Fn(&Key) -> bool) -> f64 {
        self.0
            .iter()
            .filter(|(k, _)| matches(k))
            .map(|(_, v)| v)
            .sum::<f64>()
            + 0.0
    }

    /// Counts grouped by resource (with subresource) and verb, summed over codes, largest
    /// first, each with its non-2xx codes: `("leases", "PATCH", 1300.0, [("422", 300.0)])`.
    pub fn by_resource_verb(&self) -> Vec<Grouped> {
        let mut grouped: BTreeMap<(String, String), (f64, BTreeMap<String, f64>)> = BTreeMap::new();
        for (k, v) in &self.0 {
            if k.verb == "WATCH" {
                // A watch is counted when it ends, not per event: not a request rate.
                continue;
            }
            let resource = if k.subresource.is_empty() {
                k.resource.clone()
            } else {
                format!("{}/{}", k.resource, k.subresource)
            };
            let entry = grouped.entry((resource, k.verb.clone())).or_default();
            entry.0 += v;
            if !k.code.starts_with('2') {
                *entry.1.entry(k.code.clone()).or_insert(0.0) += v;
            }
        }
        let mut rows: Vec<Grouped> = grouped
            .into_iter()
            .map(|((resource, verb), (count, codes))| Grouped {
                resource,
                verb,
                count,
                failed: codes.into_iter().collect(),
            })
            .collect();
        rows.sort_by(|a, b| {
            b.count
                .total_cmp(&a.count)
                .then_with(|| (&a.resource, &a.verb).cmp(&(&b.resource, &b.verb)))
        });
        rows
    }
}

/// Requests of one resource and verb.
#[derive(Clone, Debug, PartialEq)]
pub struct Grouped {
    /// Resource, with `/subresource` if any.
    pub resource: String,
    /// Verb.
    pub verb: String,
    /// All requests.
    pub count: f64,
    /// Those answered with a code other than 2xx, by code.
    pub failed: Vec<(String, f64)>,
}

/// Parses `a="x",b="y\"z"` into a map (Prometheus label escapes: `\\`, `\"`, `\n`).
fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut chars = text.chars().peekable();
    loop {
        let name: String = chars.by_ref().take_while(|c| *c != '=').collect();
        let name = name.trim_start_matches(',').trim().to_string();
        if name.is_empty() || chars.next() != Some('"') {
            break;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => break,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        out.insert(name, value);
    }
    out
}

/// Reads `apiserver_request_total` from the API server.
pub async fn scrape(client: &Client) -> anyhow::Result<Requests> {
    Ok(Requests::parse(&scrape_text(client).await?))
}

/// The API server's `/metrics`, as text.
pub async fn scrape_text(client: &Client) -> anyhow::Result<String> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .context("build /metrics request")?;
    client
        .request_text(req)
        .await
        .context("GET /metrics from the API server")
}

/// The sums of the series of two metrics, `names`, in the text exposition format, over the
/// series whose labels `keep` accepts: `[sum of names[0], sum of names[1]]`.
fn sum_series(
    text: &str,
    names: [&str; 2],
    keep: impl Fn(&BTreeMap<String, String>) -> bool,
) -> [f64; 2] {
    let mut out = [0.0; 2];
    for line in text.lines() {
        let Some((i, rest)) = names.iter().enumerate().find_map(|(i, name)| {
            line.strip_prefix(name)
                .and_then(|r| r.strip_prefix('{'))
                .map(|r| (i, r))
        }) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        if !keep(&parse_labels(labels)) {
            continue;
        }
        if let Ok(v) = value.trim().parse::<f64>() {
            out[i] += v;
        }
    }
    out
}

/// Time the API server spent answering one kind of request, from the `_sum` and `_count` of
/// `apiserver_request_duration_seconds` (from the request's arrival to its answer, etcd
/// included), summed over the labels not matched. Its buckets are too coarse (25, 50, 100 ms)
/// for percentiles of fast writes; the mean is exact.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ServerTime {
    /// Seconds, all matching requests together.
    pub seconds: f64,
    /// Requests.
    pub count: f64,
}

impl ServerTime {
    /// Parses the requests with this `resource`, `subresource` and `verb` out of `text`.
    pub fn parse(text: &str, resource: &str, subresource: &str, verb: &str) -> ServerTime {
        let [seconds, count] = sum_series(
            text,
            [
                "apiserver_request_duration_seconds_sum",
                "apiserver_request_duration_seconds_count",
            ],
            |labels| {
                let is = |k: &str, v: &str| labels.get(k).map_or(v.is_empty(), |x| x == v);
                is("resource", resource) && is("subresource", subresource) && is("verb", verb)
            },
        );
        ServerTime { seconds, count }
    }

    /// The difference from an earlier reading.
    pub fn since(&self, before: &ServerTime) -> ServerTime {
        ServerTime {
            seconds: (self.seconds - before.seconds).max(0.0),
            count: (self.count - before.count).max(0.0),
        }
    }

    /// Mean milliseconds per request; None without requests.
    pub fn mean_ms(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.seconds / self.count * 1000.0)
    }
}

/// What the API server sent to watchers of one resource: `apiserver_watch_events_total` and
/// `apiserver_watch_events_sizes_sum` (bytes of the encoded events), summed over versions.
/// Initial LISTs are not watch events and are not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WatchSent {
    /// Events sent, to all watchers together.
    pub events: f64,
    /// Bytes of those events.
    pub bytes: f64,
}

impl WatchSent {
    /// Parses the two metrics for `resource` (plural, e.g. `leasedjobs`) out of `text`.
    pub fn parse(text: &str, resource: &str) -> WatchSent {
        let [events, bytes] = sum_series(
            text,
            [
                "apiserver_watch_events_total",
                "apiserver_watch_events_sizes_sum",
            ],
            |labels| labels.get("resource").map(String::as_str) == Some(resource),
        );
        WatchSent { events, bytes }
    }

    /// The difference from an earlier reading.
    pub fn since(&self, before: &WatchSent) -> WatchSent {
        WatchSent {
            events: (self.events - before.events).max(0.0),
            bytes: (self.bytes - before.bytes).max(0.0),
        }
    }
}

/// Watches of `resource` (plural) open on the API server right now: the sum of
/// `apiserver_longrunning_requests` with that resource and the verb WATCH.
pub fn open_watches(text: &str, resource: &str) -> f64 {
    let [open, _] = sum_series(text, ["apiserver_longrunning_requests"; 2], |labels| {
        labels.get("resource").map(String::as_str) == Some(resource)
            && labels.get("verb").map(String::as_str) == Some("WATCH")
    });
    open
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
# HELP apiserver_request_total [STABLE] Counter of apiserver requests.
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 10
apiserver_request_total{code="409",component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PATCH",version="v1"} 7
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="namespace",subresource="",verb="WATCH",version="v1"} 3
apiserver_request_duration_seconds_bucket{le="0.1",verb="PUT"} 99
"#;

    #[test]
    fn server_time_is_the_mean_of_the_matching_requests() {
        let text = r#"
apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="status",verb="PUT",version="v1alpha1",le="0.005"} 3
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 0.5
apiserver_request_duration_seconds_count{component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 20
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 9
apiserver_request_duration_seconds_count{component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 10
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="",verb="PUT",version="v1alpha1"} 7
apiserver_request_duration_seconds_count{component="apiserver",dry_run="",group="leasehold.dev",resource="leasedjobs",scope="resource",subresource="",verb="PUT",version="v1alpha1"} 1
"#;
        let before = ServerTime::parse(text, "leasedjobs", "status", "PUT");
        assert_eq!((before.seconds, before.count), (0.5, 20.0));
        assert_eq!(before.mean_ms(), Some(25.0));
        let after = ServerTime::parse(
            &text.replace("} 0.5", "} 1.5").replace("} 20", "} 30"),
            "leasedjobs",
            "status",
            "PUT",
        );
        assert_eq!(after.since(&before).mean_ms(), Some(100.0));
        assert_eq!(ServerTime::default().mean_ms(), None);
    }

    #[test]
    fn parses_and_subtracts() {
        let before = Requests::parse(SAMPLE);
        assert_eq!(before.0.len(), 4);
        let puts = |k: &Key| k.resource == "leasedjobs" && k.verb == "PUT";
        assert_eq!(before.sum(puts), 12.0);
        assert_eq!(before.sum(|k| puts(k) && k.code == "409"), 2.0);
        let after = Requests::parse(&SAMPLE.replace("} 7", "} 19"));
        let delta = after.since(&before);
        assert_eq!(delta.sum(|k| k.resource == "leases" && k.is_write()), 12.0);
        assert_eq!(delta.0.len(), 1);
        let both = delta.plus(&before);
        assert_eq!(both.sum(|k| k.resource == "leases" && k.is_write()), 19.0);
        assert_eq!(both.sum(puts), 12.0);
        let top = &before.by_resource_verb()[0];
        assert_eq!(
            (top.resource.as_str(), top.verb.as_str()),
            ("leasedjobs/status", "PUT")
        );
        assert_eq!(top.count, 12.0);
        assert_eq!(top.failed, vec![("409".to_string(), 2.0)]);
    }

    #[test]
    fn open_watches_counts_the_watches_of_one_resource() {
        let text = r#"
apiserver_longrunning_requests{component="apiserver",group="leasehold.dev",resource="leasedjobs",scope="cluster",subresource="",verb="WATCH",version="v1alpha1"} 1
apiserver_longrunning_requests{component="apiserver",group="leasehold.dev",resource="leasedjobs",scope="namespace",subresource="",verb="WATCH",version="v1alpha1"} 3
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="exec",verb="CONNECT",version="v1"} 2
apiserver_longrunning_requests{component="apiserver",group="coordination.k8s.io",resource="leases",scope="namespace",subresource="",verb="WATCH",version="v1"} 5
"#;
        assert_eq!(open_watches(text, "leasedjobs"), 4.0);
        assert_eq!(open_watches(text, "leases"), 5.0);
        assert_eq!(open_watches(text, "pods"), 0.0);
    }

    #[test]
    fn watch_sent_sums_one_resource() {
        let text = r#"
apiserver_watch_events_total{component="apiserver",group="leasehold.dev",resource="leasedjobs",version="v1alpha1"} 40
apiserver_watch_events_total{component="apiserver",group="coordination.k8s.io",resource="leases",version="v1"} 7
apiserver_watch_events_sizes_sum{group="leasehold.dev",resource="leasedjobs",version="v1alpha1"} 51200
apiserver_watch_events_sizes_count{group="leasehold.dev",resource="leasedjobs",version="v1alpha1"} 40
"#;
        let w = WatchSent::parse(text, "leasedjobs");
        assert_eq!(
            w,
            WatchSent {
                events: 40.0,
                bytes: 51200.0
            }
        );
        let later = WatchSent::parse(&text.replace("} 40\n", "} 50\n"), "leasedjobs");
        assert_eq!(later.since(&w).events, 10.0);
    }

    #[test]
    fn label_values_may_hold_escapes_and_commas() {
        let l = parse_labels(r#"a="x,y",b="q\"r\\s",c="""#);
        assert_eq!(l["a"], "x,y");
        assert_eq!(l["b"], "q\"r\\s");
        assert_eq!(l["c"], "");
    }
}
