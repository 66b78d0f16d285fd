//! Watches that one undecodable object cannot stall, below both roles.
//!
//! kube's watcher decodes a LIST as one typed `ObjectList<K>`, so a single item that `K`
//! cannot decode fails the whole list, and every re-list after it: one LeasedJob whose payload
//! nests deeper than serde_json's recursion limit (128), or one Lease whose renewTime is a year
//! no Rust time type holds, would keep the controller and every sidecar of its namespace from
//! ever syncing. Here the watcher lists and watches [`Raw<K>`] instead: the metadata decoded,
//! spec and status kept as undecoded JSON text. [`watch`] then decodes each object on its own;
//! one that fails is skipped (and removed from the cache if an earlier version was there),
//! logged with its kind and namespace/name, counted in
//! `leasehold_undecodable_objects_total{kind}`, and handed to the caller's `on_skip` (the
//! controller records a Warning Event on it).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::NamespaceResourceScope;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use serde::de::value::MapDeserializer;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use tracing::warn;

use crate::recorder::Recorder;
use leasehold_core::crd::LeasedJob;

/// A `K` as the API server sent it, decoded only as far as its metadata: the unit a LIST or
/// WATCH of `K` can always decode, whatever the spec or status holds.
///
/// serde_json skips over a raw value without recursing (its `ignore_value` is a loop), so a
/// spec nested 10,000 levels deep still decodes here. `metadata.managedFields` is dropped on
/// the way in: its `fieldsV1` mirrors the shape of the object and would carry a deep payload's
/// depth into the metadata (leasehold never reads managedFields).
#[derive(Clone, Debug)]
pub struct Raw<K> {
    metadata: ObjectMeta,
    spec: Option<Box<RawValue>>,
    status: Option<Box<RawValue>>,
    /// Why the metadata itself could not be read (only name, namespace, uid and
    /// resourceVersion were kept), if it could not.
    metadata_error: Option<String>,
    kind: PhantomData<fn() -> K>,
}

impl<K: Resource<DynamicType = ()>> Resource for Raw<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What is on the wire; everything but metadata, spec and status (apiVersion, kind) is skipped.
#[derive(Deserialize)]
struct Wire {
    #[serde(default)]
    metadata: Option<BTreeMap<String, Box<RawValue>>>,
    #[serde(default)]
    spec: Option<Box<RawValue>>,
    #[serde(default)]
    status: Option<Box<RawValue>>,
}

/// The identifying part of metadata, for an object whose full metadata cannot be read.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Identity {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
}

impl<'de, K> Deserialize<'de> for Raw<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let wire = Wire::deserialize(d)?;
        let mut fields = wire.metadata.unwrap_or_default();
        fields.remove("managedFields");
        let (metadata, metadata_error) = match from_fields::<ObjectMeta>(&fields) {
            Ok(m) => (m, None),
            Err(e) => {
                let id: Identity = from_fields(&fields).unwrap_or_default();
                let meta = ObjectMeta {
                    name: id.name,
                    namespace: id.namespace,
                    uid: id.uid,
                    resource_version: id.resource_version,
                    ..ObjectMeta::default()
                };
                (meta, Some(format!("metadata: {e}")))
            }
        };
        Ok(Raw {
            metadata,
            spec: wire.spec,
            status: wire.status,
            metadata_error,
            kind: PhantomData,
        })
    }
}

/// Decodes `T` from the fields of a JSON object, each still undecoded text: straight from
/// those texts, without writing the object out and reading it again.
fn from_fields<T: DeserializeOwned>(
    fields: &BTreeMap<String, Box<RawValue>>,
) -> serde_json::Result<T> {
    T::deserialize(MapDeserializer::new(
        fields.iter().map(|(k, v)| (k.as_str(), &**v)),
    ))
}

impl<K> Raw<K>
where
    K: Resource<DynamicType = ()> + FromParts,
{
    /// Decodes the whole object as `K` ([`FromParts`]).
    ///
    /// # Errors
    /// The decode error (as text, naming the part: `spec: ...`): a value nested deeper than
    /// serde_json's recursion limit of 128, a time outside what `k8s_openapi::jiff` represents
    /// (years -9999 to 9999, and not every RFC 3339 text the API server accepts), a field of
    /// the wrong type, a missing required part.
    pub fn decode(&self) -> Result<K, String> {
        let mut k = self.decode_body()?;
        *k.meta_mut() = self.metadata.clone();
        Ok(k)
    }

    /// Decodes the whole object, moving the metadata in rather than copying it (the watch
    /// path: one fewer copy of labels, annotations and owner references per event); gives
    /// `self` back with the error (boxed: the rare path), to report the object it could not
    /// decode.
    fn into_decoded(self) -> Result<K, Box<(Self, String)>> {
        match self.decode_body() {
            Ok(mut k) => {
                *k.meta_mut() = self.metadata;
                Ok(k)
            }
            Err(e) => Err(Box::new((self, e))),
        }
    }

    /// The object with its spec and status decoded and empty metadata, or why it cannot be.
    fn decode_body(&self) -> Result<K, String> {
        if let Some(e) = &self.metadata_error {
            return Err(e.clone());
        }
        K::from_parts(
            ObjectMeta::default(),
            self.spec.as_deref(),
            self.status.as_deref(),
        )
    }

    /// A `K` carrying only this object's metadata: enough for a reflector to find (and drop)
    /// the cached object of the same namespace/name.
    fn tombstone(&self) -> K
    where
        K: Default,
    {
        let mut k = K::default();
        *k.meta_mut() = self.metadata.clone();
        k
    }
}

/// A kind that [`Raw::decode`] builds from its parts: the metadata, already decoded, and the
/// spec and status, still JSON text, each decoded straight into its type. (Writing the whole
/// object out and reading it again cost a watching sidecar a tenth of its CPU at 32 claimers:
/// docs/benchmarks.md.)
pub trait FromParts: Sized {
    /// `metadata`, `spec` and `status` as one object.
    ///
    /// # Errors
    /// Why a part could not be decoded, prefixed with its name (`spec: `, `status: `), or that
    /// a part the kind requires is missing.
    fn from_parts(
        metadata: ObjectMeta,
        spec: Option<&RawValue>,
        status: Option<&RawValue>,
    ) -> Result<Self, String>;
}

/// Decodes one part of an object, naming it in the error.
pub(crate) fn part<T: DeserializeOwned>(name: &str, text: &RawValue) -> Result<T, String> {
    serde_json::from_str(text.get()).map_err(|e| format!("{name}: {e}"))
}

impl FromParts for LeasedJob {
    fn from_parts(
        metadata: ObjectMeta,
        spec: Option<&RawValue>,
        status: Option<&RawValue>,
    ) -> Result<Self, String> {
        let spec = spec.ok_or_else(|| "missing field `spec`".to_string())?;
        Ok(LeasedJob {
            metadata,
            spec: part("spec", spec)?,
            status: status.map(|s| part("status", s)).transpose()?.flatten(),
        })
    }
}

impl FromParts for Lease {
    fn from_parts(
        metadata: ObjectMeta,
        spec: Option<&RawValue>,
        _status: Option<&RawValue>,
    ) -> Result<Self, String> {
        Ok(Lease {
            metadata,
            spec: spec.map(|s| part("spec", s)).transpose()?.flatten(),
        })
    }
}

/// An object that was skipped because it could not be decoded.
#[derive(Clone, Debug)]
pub struct Undecodable {
    /// Its kind, e.g. `LeasedJob`.
    pub kind: String,
    /// `namespace/name`.
    pub reference: String,
    /// Why it could not be decoded; tokens redacted, never the object itself.
    pub error: String,
    /// A reference to it, to record an Event on.
    pub object: ObjectReference,
}

impl Undecodable {
    fn of<K: Resource<DynamicType = ()>>(raw: &Raw<K>, error: &str) -> Self {
        Undecodable {
            kind: K::kind(&()).into_owned(),
            reference: format!("{}/{}", raw.namespace().unwrap_or_default(), raw.name_any()),
            error: leasehold_core::token::redact(error)
                .chars()
                .take(500)
                .collect(),
            object: ObjectReference {
                api_version: Some(K::api_version(&()).into_owned()),
                kind: Some(K::kind(&()).into_owned()),
                name: raw.metadata.name.clone(),
                namespace: raw.metadata.namespace.clone(),
                uid: raw.metadata.uid.clone(),
                resource_version: raw.metadata.resource_version.clone(),
                ..ObjectReference::default()
            },
        }
    }
}

/// Turns one watcher event over [`Raw<K>`] into the event over `K` to hand on, if any, and
/// the object it had to skip, if any:
/// - `Apply` / `InitApply` of an object that decodes: the same event over `K`.
/// - `InitApply` of one that does not: nothing (the re-list's new cache will lack it).
/// - `Apply` of one that does not: `Delete` of a metadata-only `K`, so that an older, readable
///   version leaves the cache instead of being acted on as if current (the reflector keys
///   objects by namespace/name alone).
/// - `Delete`: always handed on, as a metadata-only `K` if the object does not decode.
pub fn decode_event<K>(
    event: watcher::Event<Raw<K>>,
) -> (Option<watcher::Event<K>>, Option<Undecodable>)
where
    K: Resource<DynamicType = ()> + FromParts + Default,
{
    use watcher::Event;
    match event {
        Event::Init => (Some(Event::Init), None),
        Event::InitDone => (Some(Event::InitDone), None),
        Event::InitApply(raw) => match raw.into_decoded() {
            Ok(k) => (Some(Event::InitApply(k)), None),
            Err(b) => (None, Some(Undecodable::of(&b.0, &b.1))),
        },
        Event::Apply(raw) => match raw.into_decoded() {
            Ok(k) => (Some(Event::Apply(k)), None),
            Err(b) => (
                Some(Event::Delete(b.0.tombstone())),
                Some(Undecodable::of(&b.0, &b.1)),
            ),
        },
        Event::Delete(raw) => {
            let k = raw.into_decoded().unwrap_or_else(|b| b.0.tombstone());
            (Some(Event::Delete(k)), None)
        }
    }
}

/// Watches `api` (a namespace, or all) with `config`, decoding each object on its own (see the
/// module documentation): every watch leasehold runs goes through here. Lists with a streaming
/// list, falling back to paged LISTs (see `relisting_watcher` in this module); uses
/// [`crate::api::WatchBackoff`] and drops `metadata.managedFields` from every object.
///
/// Each skipped object is logged (warn, with its kind, namespace/name and the decode error),
/// reported to `metrics` ([`Recorder::undecodable`]), and passed to `on_skip`. It is skipped again, and
/// reported again, at every re-list until it is fixed or deleted.
pub fn watch<K>(
    api: &Api<K>,
    config: watcher::Config,
    metrics: Arc<dyn Recorder>,
    mut on_skip: impl FnMut(Undecodable) + Send + 'static,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Watched,
{
    let raw = raw_api(api);
    relisting_watcher(raw, config)
        .backoff(crate::api::WatchBackoff::default())
        .filter_map(move |event| {
            let out = match event {
                Ok(event) => {
                    if matches!(event, watcher::Event::InitDone) {
                        crate::memory::release_freed();
                    }
                    decoded(event, &*metrics, &mut on_skip).map(Ok)
                }
                Err(e) => Some(Err(e)),
            };
            futures::future::ready(out)
        })
        .modify(|o| o.managed_fields_mut().clear())
}

/// What [`watch`] and [`watch_from`] watch: a namespaced kind that decodes from its parts.
pub trait Watched:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + FromParts
    + Default
    + Clone
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + FromParts
        + Default
        + Clone
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// `api`'s namespace (or all), read as [`Raw<K>`].
fn raw_api<K: Watched>(api: &Api<K>) -> Api<Raw<K>> {
    let client: kube::Client = api.clone().into();
    match api.namespace() {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    }
}

/// [`decode_event`], logging and reporting what it skipped (see [`watch`]).
fn decoded<K>(
    event: watcher::Event<Raw<K>>,
    metrics: &dyn Recorder,
    on_skip: &mut impl FnMut(Undecodable),
) -> Option<watcher::Event<K>>
where
    K: Resource<DynamicType = ()> + FromParts + Default,
{
    let (event, skipped) = decode_event(event);
    if let Some(s) = skipped {
        warn!(kind = %s.kind, object = %s.reference, error = %s.error,
            "Skipped {} {}: it cannot be decoded ({}); other objects are handled as usual",
            s.kind, s.reference, s.error);
        metrics.undecodable(&s.kind);
        on_skip(s);
    }
    event
}

/// Watches `api` for the objects matching `fields` (a field selector) from `resource_version`
/// on, without listing first, in slices: only `Apply` and `Delete` events, for the changes
/// after that version, decoded and stripped of managedFields as [`watch`] does.
///
/// For a cache seeded with an object as a write answered it (a sidecar's claim, whose
/// resourceVersion is `resource_version`): a LIST with a field selector that no index serves
/// makes the API server walk every object of the namespace, and this needs none.
///
/// Each slice is one WATCH request that the API server ends after the seconds `slice()`
/// returns when it is sent (its `timeoutSeconds`); the next goes on from the last version
/// seen. `slice()` returning `None` ends the stream instead. A watch ended by the server, not
/// dropped by the client, leaves its connection open for the client's next request: a watch
/// that comes and goes costs no new TLS connection. Asks for bookmarks, so that the version it
/// goes on from stays recent while nothing matches. Ends after the first error, which it
/// yields (a 410 Gone among them: the version was compacted away): the caller lists instead
/// ([`watch`]).
pub fn watch_from<K>(
    api: &Api<K>,
    fields: &str,
    resource_version: &str,
    slice: impl FnMut() -> Option<u32> + Send + 'static,
    metrics: Arc<dyn Recorder>,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Watched,
{
    use kube::api::{WatchEvent, WatchParams};
    type Events<K> = futures::stream::BoxStream<'static, kube::Result<WatchEvent<Raw<K>>>>;
    struct From<K, S> {
        api: Api<Raw<K>>,
        slice: S,
        fields: String,
        version: String,
        current: Option<Events<K>>,
        ended: bool,
    }
    let from = From {
        api: raw_api(api),
        slice,
        fields: fields.to_string(),
        version: resource_version.to_string(),
        current: None,
        ended: false,
    };
    futures::stream::unfold(from, move |mut from| {
        let metrics = Arc::clone(&metrics);
        async move {
            loop {
                if from.ended {
                    return None;
                }
                let current = match &mut from.current {
                    Some(current) => current,
                    None => {
                        let secs = (from.slice)()?;
                        let params = WatchParams::default().fields(&from.fields).timeout(secs);
                        match from.api.watch(&params, &from.version).await {
                            Ok(events) => from.current.insert(events.boxed()),
                            Err(e) => {
                                from.ended = true;
                                return Some((Err(watcher::Error::WatchStartFailed(e)), from));
                            }
                        }
                    }
                };
                let event = match current.next().await {
                    // The API server ended the slice: the next goes on from the last version seen.
                    None => {
                        from.current = None;
                        continue;
                    }
                    Some(Err(e)) => {
                        from.ended = true;
                        return Some((Err(watcher::Error::WatchFailed(e)), from));
                    }
                    Some(Ok(WatchEvent::Error(status))) => {
                        from.ended = true;
                        return Some((Err(watcher::Error::WatchError(status)), from));
                    }
                    Some(Ok(WatchEvent::Bookmark(b))) => {
                        from.version = b.metadata.resource_version;
                        continue;
                    }
                    Some(Ok(WatchEvent::Added(o) | WatchEvent::Modified(o))) => {
                        watcher::Event::Apply(o)
                    }
                    Some(Ok(WatchEvent::Deleted(o))) => watcher::Event::Delete(o),
                };
                if let watcher::Event::Apply(o) | watcher::Event::Delete(o) = &event {
                    if let Some(v) = &o.metadata.resource_version {
                        from.version.clone_from(v);
                    }
                }
                if let Some(mut event) = decoded(event, &*metrics, &mut |_| {}) {
                    if let watcher::Event::Apply(o) | watcher::Event::Delete(o) = &mut event {
                        o.managed_fields_mut().clear();
                    }
                    return Some((Ok(event), from));
                }
            }
        }
    })
}

/// Whether a watch's cache has had its first complete listing: set when the watch yields its
/// first `InitDone` after the reflector ([`Synced::track`]), read and awaited by any number of
/// tasks.
///
/// Why not kube's `Store::wait_until_ready`: it is a futures oneshot receiver behind a mutex,
/// which keeps the waker of only the last task that polled it. With two waiters (a sidecar's
/// readiness task and a claim waiting for the cache) one was never woken: a sidecar served
/// claims while its `/readyz` said "watches have not synced yet" forever (seen in the long
/// chaos run); and polling it with `now_or_never` from a reconcile would steal the waker of
/// whoever awaited it. Here every waiter has its own `tokio::sync::watch` receiver.
#[derive(Clone, Debug)]
pub struct Synced {
    tx: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Default for Synced {
    fn default() -> Self {
        Synced {
            tx: Arc::new(tokio::sync::watch::channel(false).0),
        }
    }
}

impl Synced {
    /// True once the cache has listed everything.
    pub fn is_synced(&self) -> bool {
        *self.tx.borrow()
    }

    /// Waits until the cache has listed everything (at once if it has).
    pub async fn wait(&self) {
        let mut rx = self.tx.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = rx.wait_for(|synced| *synced).await;
    }

    /// Marks the cache complete (`true`) or not (`false`: a watch that stopped and emptied its
    /// cache, [`crate::queue_watch`]), waking every waiter when it becomes complete.
    pub fn set(&self, synced: bool) {
        self.tx
            .send_if_modified(|s| std::mem::replace(s, synced) != synced);
    }

    /// `stream` (a watch after its reflector) marking this synced at its first `InitDone`.
    pub fn track<K, E>(
        &self,
        stream: impl Stream<Item = Result<watcher::Event<K>, E>> + Send + 'static,
    ) -> impl Stream<Item = Result<watcher::Event<K>, E>> + Send + 'static
    where
        K: Send + 'static,
        E: Send + 'static,
    {
        let tx = Arc::clone(&self.tx);
        stream.inspect(move |event| {
            if matches!(event, Ok(watcher::Event::InitDone)) {
                tx.send_if_modified(|synced| !std::mem::replace(synced, true));
            }
        })
    }
}

/// Objects per page of a watch's paged LIST (kube's default is 500), which a watch falls back
/// to when a streaming list fails or the API server was lost (`relisting_watcher`). A page is held three times
/// over while it is decoded (the response, the raw objects, the decoded ones before
/// `modify` drops their payloads): at 500 jobs of 64 KiB that was about 100 MiB at once, at
/// 100 it is about 20 MiB. The price is more LIST requests at start-up and after each re-list
/// (one per 100 objects).
pub const LIST_PAGE_SIZE: u32 = 100;

/// Logs a watch error (warn, `what` failed; the text redacted of tokens and cut at 500
/// characters): the one way every role reports a watch that failed and is being retried.
pub fn log_error(what: &str, err: &watcher::Error) {
    // Errors may quote the objects they failed on: never log a token.
    let shown: String = leasehold_core::token::redact(&err.to_string())
        .chars()
        .take(500)
        .collect();
    warn!(error = %shown, "{what} watch failed; retrying");
}

/// `stream` with its errors logged ([`log_error`]) and dropped, for a consumer that must
/// never see them: kube-runtime's `Controller` answers any error of any of its trigger
/// streams by pausing *all* of them under one client-go backoff (0.8 s doubling to 30 s, reset
/// only after two quiet minutes), so an API-server restart, whose outage fails every watch a
/// few times, left the controller blind to jobs and renewals for 5 s and more after the API
/// server was back. Each stream from [`watch`] already retries under its own
/// [`crate::api::WatchBackoff`].
pub fn errors_logged<T>(
    what: &'static str,
    stream: impl Stream<Item = Result<T, watcher::Error>> + Send + 'static,
) -> impl Stream<Item = Result<T, watcher::Error>> + Send + 'static
where
    T: Send + 'static,
{
    stream.filter_map(move |item| {
        futures::future::ready(match item {
            Ok(v) => Some(Ok(v)),
            Err(e) => {
                log_error(what, &e);
                None
            }
        })
    })
}

/// True when a watch error means the API server was lost or is (re)starting: no connection,
/// a broken stream, or a 5xx or 429 answer to the watch request.
pub fn lost_the_api_server(err: &watcher::Error) -> bool {
    match err {
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => match e {
            kube::Error::Api(status) => status.code >= 500 || status.code == 429,
            kube::Error::Service(_) | kube::Error::HyperError(_) | kube::Error::ReadEvents(_) => {
                true
            }
            _ => false,
        },
        _ => false,
    }
}

/// How a watch lists what is already there before it watches for changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InitialList {
    /// A streaming list (Kubernetes' WatchList: one WATCH with `sendInitialEvents=true`, its
    /// objects served one by one from the API server's watch cache, then a bookmark).
    Streaming,
    /// A paged LIST of [`LIST_PAGE_SIZE`] objects a page, then a WATCH from its
    /// resourceVersion: what every API server serves.
    Paged,
}

/// What a watch that began with a streaming list does about `err`, seen before (`synced`
/// false) or after its first complete list: go on as it is, or start over with paged lists.
///
/// An error before the first complete list most likely means this API server does not serve
/// streaming lists (older than Kubernetes 1.32, or the `WatchList` feature gate off) or is not
/// serving its watch cache yet; an error that means the API server was lost means the next one
/// may be starting with an empty watch cache ([`relisting_watcher`]). Either way a paged LIST,
/// which the API server answers from etcd when its cache is not ready, is served at once. Any
/// other error before the first list (a refused connection, a 403) is taken the same way: it
/// costs that watch the speed of streaming lists, nothing else.
fn after_error(mode: InitialList, synced: bool, err: &watcher::Error) -> InitialList {
    match mode {
        InitialList::Streaming if !synced || lost_the_api_server(err) => InitialList::Paged,
        _ => mode,
    }
}

/// kube's watcher, started with a streaming list, and started over from a fresh paged LIST
/// whenever it loses the API server ([`lost_the_api_server`]), instead of resuming the watch
/// from the last resourceVersion it saw.
///
/// Why streaming first: at 100,000 jobs a paged list took 1,000 requests, each waiting for the
/// objects of the one before it to be decoded, and the controller was ready 30 to 39 s after
/// its start (docs/benchmarks.md, row 10f); a streaming list sends the same objects in one
/// response while they are decoded. If the first streaming list fails (an API server that
/// does not serve them), the watch goes on with paged lists ([`after_error`]).
///
/// A streaming list that ends before its last object without an error (the API server closes
/// a watch whose buffer of new changes filled while it was still sending the list, and kube's
/// watcher then starts a streaming list over, with a new `Init`) gives way to paged lists as
/// well: under a steady stream of changes it could otherwise start over for ever.
///
/// Why a fresh paged LIST after losing the API server: a kube-apiserver that just restarted
/// rebuilds its watch cache from etcd's current revision, so a watch resumed from an older
/// resourceVersion is answered 410 Gone; but it is answered only once that cache is ready,
/// which took 8 to 19 s after the API server was ready, while the watch (and every job or
/// expiry behind it) waited. A paged LIST is served at once (from etcd while the cache is not
/// ready; a streaming list would wait for the cache too), and the watch that follows starts
/// from a resourceVersion the new cache has. The price is one LIST per outage, which the 410
/// would have cost anyway.
fn relisting_watcher<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + std::fmt::Debug + Send + 'static,
{
    let start = move |mode: InitialList| {
        let config = match mode {
            InitialList::Streaming => config.clone().streaming_lists(),
            InitialList::Paged => config.clone().page_size(LIST_PAGE_SIZE),
        };
        watcher(api.clone(), config).boxed()
    };
    let progress = Progress {
        mode: InitialList::Streaming,
        synced: false,
        listing: false,
    };
    let first = start(progress.mode);
    futures::stream::unfold(
        (first, start, progress),
        |(mut current, start, progress)| async move {
            let item = current.next().await?;
            let seen = match &item {
                Ok(watcher::Event::Init) => Seen::Init,
                Ok(watcher::Event::InitDone) => Seen::InitDone,
                Ok(_) => Seen::Other,
                Err(e) => Seen::Error(e),
            };
            let (progress, next) = progress.after(seen);
            if let Next::Restart { why } = next {
                if let Some(why) = why {
                    // An error itself reaches the consumer, which logs it redacted.
                    warn!("{why}; this watch lists in pages from now on");
                }
                current = start(progress.mode);
            }
            Some((item, (current, start, progress)))
        },
    )
}

/// Where a watch of [`relisting_watcher`] stands: how it lists, whether a list ended once,
/// and whether one is under way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Progress {
    mode: InitialList,
    synced: bool,
    listing: bool,
}

/// What [`relisting_watcher`] saw of one item of its watch.
#[derive(Clone, Copy, Debug)]
enum Seen<'a> {
    /// A list began.
    Init,
    /// A list ended with its last object.
    InitDone,
    /// An error.
    Error(&'a watcher::Error),
    /// Anything else.
    Other,
}

/// What [`relisting_watcher`] does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    /// Goes on with the watch it has.
    GoOn,
    /// Starts a new watch, listing in the mode of the new [`Progress`]; `why` is the warning
    /// when that mode is new.
    Restart { why: Option<&'static str> },
}

impl Progress {
    /// The decision of [`relisting_watcher`] after `seen`, with the progress that follows.
    fn after(self, seen: Seen<'_>) -> (Progress, Next) {
        let restart = |mode, why| {
            let progress = Progress {
                mode,
                listing: false,
                ..self
            };
            (progress, Next::Restart { why })
        };
        match seen {
            Seen::Init if self.mode == InitialList::Streaming && self.listing => restart(
                InitialList::Paged,
                Some("A streaming list ended before its last object"),
            ),
            Seen::Init => (
                Progress {
                    listing: true,
                    ..self
                },
                Next::GoOn,
            ),
            Seen::InitDone => (
                Progress {
                    synced: true,
                    listing: false,
                    ..self
                },
                Next::GoOn,
            ),
            Seen::Error(e) => match after_error(self.mode, self.synced, e) {
                mode if mode != self.mode => restart(
                    mode,
                    Some(if self.synced {
                        "The API server was lost"
                    } else {
                        "A streaming list failed"
                    }),
                ),
                mode if lost_the_api_server(e) => restart(mode, None),
                _ => (self, Next::GoOn),
            },
            Seen::Other => (self, Next::GoOn),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::ObjectList;

    fn nested_array(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    fn job_json(name: &str, payload: &str) -> String {
        format!(
            r#"{{"apiVersion":"leasehold.dev/v1alpha1","kind":"LeasedJob","metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"7","managedFields":[{{"manager":"kubectl","fieldsV1":{{"f:spec":{{}}}}}}]}},"spec":{{"queue":"q","payload":{payload}}},"status":{{"phase":"Queued"}}}}"#
        )
    }

    fn list_json(items: &[String]) -> String {
        format!(
            r#"{{"apiVersion":"leasehold.dev/v1alpha1","kind":"LeasedJobList","metadata":{{"resourceVersion":"9"}},"items":[{}]}}"#,
            items.join(",")
        )
    }

    fn api_error(code: u16) -> watcher::Error {
        watcher::Error::WatchFailed(kube::Error::Api(Box::new(kube::core::Status {
            code,
            ..Default::default()
        })))
    }

    #[test]
    fn a_streaming_list_that_fails_before_its_first_sync_gives_way_to_paged_lists() {
        // 422/400: an API server without streaming lists; 429: its watch cache not ready.
        for code in [400, 403, 422, 429, 500] {
            assert_eq!(
                after_error(InitialList::Streaming, false, &api_error(code)),
                InitialList::Paged,
                "{code}"
            );
        }
    }

    #[test]
    fn a_synced_streaming_watch_keeps_streaming_unless_the_api_server_was_lost() {
        // 410 Gone after compaction: the watcher lists again, still streaming.
        assert_eq!(
            after_error(InitialList::Streaming, true, &api_error(410)),
            InitialList::Streaming
        );
        // A restarted API server's watch cache may be empty: paged, as for any lost server.
        for code in [429, 500, 503] {
            assert_eq!(
                after_error(InitialList::Streaming, true, &api_error(code)),
                InitialList::Paged,
                "{code}"
            );
        }
    }

    #[test]
    fn paged_lists_stay_paged() {
        for (synced, code) in [(false, 410), (true, 500), (true, 422)] {
            assert_eq!(
                after_error(InitialList::Paged, synced, &api_error(code)),
                InitialList::Paged
            );
        }
    }

    /// A watch's progress: how it lists, whether a list ended once, whether one is under way.
    fn at(mode: InitialList, synced: bool, listing: bool) -> Progress {
        Progress {
            mode,
            synced,
            listing,
        }
    }

    #[test]
    fn a_watch_restarts_only_to_list_in_pages_or_after_losing_the_api_server() {
        use InitialList::{Paged, Streaming};
        use Next::{GoOn, Restart};
        let gone = api_error(410);
        let lost = api_error(503);
        let refused = api_error(422);
        let warned = |why| Restart { why: Some(why) };
        let cut = "A streaming list ended before its last object";
        let failed = "A streaming list failed";
        let lost_it = "The API server was lost";
        // One case a line: rustfmt would spread each over six.
        #[rustfmt::skip]
        let cases: [(Progress, Seen<'_>, Progress, Next); 10] = [
            // A list begins, and ends.
            (at(Streaming, false, false), Seen::Init, at(Streaming, false, true), GoOn),
            (at(Streaming, false, true), Seen::InitDone, at(Streaming, true, false), GoOn),
            // A second Init while streaming a list: it was cut short.
            (at(Streaming, true, true), Seen::Init, at(Paged, true, false), warned(cut)),
            // Paged lists may start over: kube's watcher does so after a 410.
            (at(Paged, true, true), Seen::Init, at(Paged, true, true), GoOn),
            // The first streaming list refused.
            (at(Streaming, false, true), Seen::Error(&refused), at(Paged, false, false), warned(failed)),
            // The API server lost after a list: paged, with a warning the first time.
            (at(Streaming, true, false), Seen::Error(&lost), at(Paged, true, false), warned(lost_it)),
            (at(Paged, true, false), Seen::Error(&lost), at(Paged, true, false), Restart { why: None }),
            // 410 after compaction: kube's watcher lists again by itself, still streaming.
            (at(Streaming, true, false), Seen::Error(&gone), at(Streaming, true, false), GoOn),
            (at(Paged, true, false), Seen::Error(&refused), at(Paged, true, false), GoOn),
            (at(Streaming, true, false), Seen::Other, at(Streaming, true, false), GoOn),
        ];
        for (before, seen, after, next) in cases {
            assert_eq!(
                before.after(seen),
                (after, next),
                "{before:?} then {seen:?}"
            );
        }
    }

    #[tokio::test]
    async fn every_waiter_for_a_sync_is_woken() {
        // kube's Store::wait_until_ready woke only the last of several waiters.
        let synced = Synced::default();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let s = synced.clone();
                tokio::spawn(async move { s.wait().await })
            })
            .collect();
        tokio::task::yield_now().await;
        assert!(!synced.is_synced());
        let events = futures::stream::iter(vec![
            Ok::<_, ()>(watcher::Event::<LeasedJob>::Init),
            Ok(watcher::Event::InitDone),
        ]);
        let _: Vec<_> = synced.track(events).collect().await;
        assert!(synced.is_synced());
        for w in waiters {
            tokio::time::timeout(std::time::Duration::from_secs(5), w)
                .await
                .expect("woken")
                .unwrap();
        }
        // A later waiter returns at once.
        synced.wait().await;
    }

    #[test]
    fn a_typed_list_fails_whole_on_one_deep_payload() {
        // The failure this module exists for: kube decodes a LIST like this.
        let text = list_json(&[job_json("good", "1"), job_json("deep", &nested_array(130))]);
        let e = serde_json::from_str::<ObjectList<LeasedJob>>(&text).unwrap_err();
        assert!(e.to_string().contains("recursion limit"), "{e}");
    }

    #[test]
    fn a_raw_list_decodes_whatever_the_depth_and_only_the_deep_item_fails() {
        for depth in [130, 10_000] {
            let text = list_json(&[
                job_json("good", r#"{"n":1}"#),
                job_json("deep", &nested_array(depth)),
            ]);
            let list: ObjectList<Raw<LeasedJob>> =
                serde_json::from_str(&text).expect("a raw list decodes");
            assert_eq!(list.items.len(), 2);
            let good = list.items[0].decode().expect("the good job decodes");
            assert_eq!(good.spec.payload, serde_json::json!({"n": 1}));
            assert_eq!(good.resource_version().as_deref(), Some("7"));
            assert!(good.managed_fields().is_empty());
            let e = list.items[1].decode().unwrap_err();
            assert!(e.contains("recursion limit"), "{depth}: {e}");
            assert_eq!(list.items[1].name_any(), "deep");
        }
    }

    #[test]
    fn decoding_by_parts_gives_what_a_typed_decode_of_the_whole_gives() {
        // Every part filled: labels, owner references, times, status with failures and a
        // result. The typed decode of the same text (without managedFields) is the reference.
        let whole = r#"{"apiVersion":"leasehold.dev/v1alpha1","kind":"LeasedJob",
            "metadata":{"name":"j","namespace":"ns","uid":"u1","resourceVersion":"42",
              "generation":3,"creationTimestamp":"2026-01-02T03:04:05Z",
              "labels":{"a":"b"},"annotations":{"c":"d"},"finalizers":["f"],
              "ownerReferences":[{"apiVersion":"v1","kind":"ConfigMap","name":"o","uid":"u2"}]},
            "spec":{"queue":"q","priority":5,"payload":{"n":[1,2,{"x":null}]},
              "leaseDurationSeconds":30,"notBefore":"2026-01-02T03:04:06Z"},
            "status":{"phase":"Failed","attempt":2,"holder":"h","queuedTime":"2026-01-02T03:04:07Z",
              "retryAfter":"2026-01-02T03:04:08Z","result":{"ok":true},"checkpoint":[1],
              "failures":[{"attempt":1,"holder":"h","reason":"WorkerFailed","message":"m",
                "time":"2026-01-02T03:04:09Z"}]}}"#;
        let reference: LeasedJob = serde_json::from_str(whole).unwrap();
        let with_fields = whole.replacen(
            r#""name":"j","#,
            r#""name":"j","managedFields":[{"manager":"m","fieldsV1":{"f:spec":{}}}],"#,
            1,
        );
        let raw: Raw<LeasedJob> = serde_json::from_str(&with_fields).unwrap();
        let decoded = raw.decode().unwrap();
        assert_eq!(
            serde_json::to_value(&decoded).unwrap(),
            serde_json::to_value(&reference).unwrap()
        );
        assert!(decoded.managed_fields().is_empty());

        // No status, and a null one, are both None.
        for status in ["", r#","status":null"#] {
            let text = format!(r#"{{"metadata":{{"name":"n"}},"spec":{{"queue":"q"}}{status}}}"#);
            let raw: Raw<LeasedJob> = serde_json::from_str(&text).unwrap();
            assert!(raw.decode().unwrap().status.is_none(), "{text}");
        }
        // A missing spec, and a bad field, are named.
        let raw: Raw<LeasedJob> = serde_json::from_str(r#"{"metadata":{"name":"n"}}"#).unwrap();
        assert_eq!(raw.decode().unwrap_err(), "missing field `spec`");
        let raw: Raw<LeasedJob> = serde_json::from_str(
            r#"{"metadata":{"name":"n"},"spec":{"queue":"q"},"status":{"attempt":"x"}}"#,
        )
        .unwrap();
        let e = raw.decode().unwrap_err();
        assert!(e.starts_with("status: invalid type"), "{e}");
    }

    #[test]
    fn deep_managed_fields_do_not_make_the_metadata_unreadable() {
        let deep_fields = format!(
            "{}{}",
            r#"{"f:a":"#.repeat(200),
            "{}".to_string() + &"}".repeat(200)
        );
        let text = format!(
            r#"{{"metadata":{{"name":"x","namespace":"ns","managedFields":[{{"fieldsV1":{deep_fields}}}]}},"spec":{{}}}}"#
        );
        let raw: Raw<LeasedJob> = serde_json::from_str(&text).unwrap();
        assert!(raw.decode().is_ok());
    }

    #[test]
    fn a_lease_renewed_in_year_9999_is_skipped_alone() {
        let text = r#"{"items":[
            {"metadata":{"name":"ok","namespace":"ns"},"spec":{"renewTime":"2026-01-01T00:00:00.000000Z"}},
            {"metadata":{"name":"odd","namespace":"ns"},"spec":{"renewTime":"9999-12-31T23:59:59.000000Z"}}]}"#;
        let list: ObjectList<Raw<Lease>> = serde_json::from_str(text).unwrap();
        assert!(list.items[0].decode().is_ok());
        let e = list.items[1].decode().unwrap_err();
        assert!(e.contains("range") || e.contains("civil"), "{e}");
    }

    #[test]
    fn events_of_undecodable_objects_are_skipped_or_become_deletes() {
        use watcher::Event;
        let raw = |name: &str, payload: &str| -> Raw<LeasedJob> {
            serde_json::from_str(&job_json(name, payload)).unwrap()
        };
        let deep = nested_array(130);
        let (e, s) = decode_event(Event::InitApply(raw("a", "1")));
        assert!(matches!(e, Some(Event::InitApply(ref k)) if k.name_any() == "a") && s.is_none());
        let (e, s) = decode_event(Event::InitApply(raw("b", &deep)));
        assert!(e.is_none());
        let s = s.expect("reported");
        assert_eq!(
            (s.kind.as_str(), s.reference.as_str()),
            ("LeasedJob", "ns/b")
        );
        assert_eq!(s.object.name.as_deref(), Some("b"));
        let (e, s) = decode_event(Event::Apply(raw("c", &deep)));
        match e {
            Some(Event::Delete(k)) => assert_eq!(k.name_any(), "c"),
            other => panic!("expected a Delete, got {other:?}"),
        }
        assert!(s.is_some());
        let (e, s) = decode_event(Event::Delete(raw("d", &deep)));
        assert!(matches!(e, Some(Event::Delete(ref k)) if k.name_any() == "d") && s.is_none());
    }

    #[test]
    fn decode_errors_never_carry_a_token() {
        let text = r#"{"metadata":{"name":"t","namespace":"ns"},"spec":{"queue":"q"},"status":{"attempt":"3.9f86d081884c7d659a2feaa0c55ad015"}}"#;
        let raw: Raw<LeasedJob> = serde_json::from_str(text).unwrap();
        let e = raw.decode().unwrap_err();
        assert!(
            e.contains("9f86d081884c7d659a2feaa0c55ad015"),
            "serde quotes it: {e}"
        );
        let s = Undecodable::of(&raw, &e);
        assert!(
            !s.error.contains("9f86d081884c7d659a2feaa0c55ad015"),
            "{}",
            s.error
        );
    }

    /// [`watch`] against a mocked API server (a `tower_test` service as the client's
    /// transport): which list it asks for first, and when it falls back to paged lists.
    mod initial_list {
        use std::time::Duration;

        use http::{Request, Response};
        use kube::client::Body;
        use tower_test::mock::{self, Handle, SendResponse};

        use super::{job_json, list_json};
        use crate::recorder::NoRecorder;
        use crate::watch::*;

        type ApiHandle = Handle<Request<Body>, Response<Body>>;
        type Events = std::pin::Pin<
            Box<dyn Stream<Item = Result<watcher::Event<LeasedJob>, watcher::Error>> + Send>,
        >;

        fn watched() -> (Events, ApiHandle) {
            let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<LeasedJob> = Api::namespaced(kube::Client::new(service, "ns"), "ns");
            let events = watch(
                &api,
                watcher::Config::default(),
                Arc::new(NoRecorder),
                |_| {},
            );
            (Box::pin(events), handle)
        }

        /// The next request's query string, and the way to answer it.
        async fn next(handle: &mut ApiHandle) -> (String, SendResponse<Response<Body>>) {
            let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
                .await
                .expect("a request within 10 s")
                .expect("the client is alive");
            (req.uri().query().unwrap_or_default().to_string(), send)
        }

        fn answer(send: SendResponse<Response<Body>>, code: u16, body: String) {
            send.send_response(
                Response::builder()
                    .status(code)
                    .body(Body::from(body.into_bytes()))
                    .unwrap(),
            );
        }

        fn refusal(code: u16) -> String {
            format!(
                r#"{{"kind":"Status","apiVersion":"v1","metadata":{{}},"status":"Failure","message":"refused","reason":"Refused","code":{code}}}"#
            )
        }

        /// A streaming list's answer: one job, then the bookmark that ends the list at "9".
        fn streamed() -> String {
            format!(
                "{{\"type\":\"ADDED\",\"object\":{}}}\n{}\n",
                job_json("a", "1"),
                r#"{"type":"BOOKMARK","object":{"apiVersion":"leasehold.dev/v1alpha1","kind":"LeasedJob","metadata":{"resourceVersion":"9","annotations":{"k8s.io/initial-events-end":"true"}}}}"#
            )
        }

        fn is_streaming_list(query: &str) -> bool {
            query.contains("watch=true") && query.contains("sendInitialEvents=true")
        }

        fn is_paged_list(query: &str) -> bool {
            !query.contains("watch=true") && query.contains("limit=100")
        }

        /// A watch from "9", no list.
        fn is_watch_from_9(query: &str) -> bool {
            query.contains("watch=true")
                && query.contains("resourceVersion=9")
                && !query.contains("sendInitialEvents=true")
        }

        /// The names the next events list: Init, each InitApply, up to InitDone.
        async fn listed(events: &mut Events) -> Vec<String> {
            let mut names = Vec::new();
            loop {
                let event = tokio::time::timeout(Duration::from_secs(10), events.next())
                    .await
                    .expect("an event within 10 s")
                    .expect("the stream goes on");
                match event.expect("no error") {
                    watcher::Event::Init => names.clear(),
                    watcher::Event::InitApply(job) => names.push(job.name_any()),
                    watcher::Event::InitDone => return names,
                    other => panic!("unexpected event during a list: {other:?}"),
                }
            }
        }

        async fn an_error(events: &mut Events) {
            let event = tokio::time::timeout(Duration::from_secs(10), events.next())
                .await
                .expect("an event within 10 s")
                .expect("the stream goes on");
            assert!(event.is_err(), "expected the refusal, got {event:?}");
        }

        /// One request the mocked API server expects, in turn: its kind, and its answer (none:
        /// the request is left open, as a watch that waits).
        struct Step {
            what: &'static str,
            is: fn(&str) -> bool,
            answer: Option<(u16, String)>,
        }

        fn answered(what: &'static str, is: fn(&str) -> bool, code: u16, body: String) -> Step {
            Step {
                what,
                is,
                answer: Some((code, body)),
            }
        }

        fn left_open(what: &'static str, is: fn(&str) -> bool) -> Step {
            Step {
                what,
                is,
                answer: None,
            }
        }

        /// Serves `steps` in order, checking each request's kind.
        fn serve(mut api: ApiHandle, steps: Vec<Step>) -> tokio::task::JoinHandle<()> {
            tokio::spawn(async move {
                let mut open = Vec::new();
                for step in steps {
                    let (query, send) = next(&mut api).await;
                    assert!((step.is)(&query), "expected {}, got {query}", step.what);
                    match step.answer {
                        Some((code, body)) => answer(send, code, body),
                        None => open.push(send),
                    }
                }
            })
        }

        /// Lets the watch run on until the server has seen every step.
        async fn finish(mut events: Events, server: tokio::task::JoinHandle<()>) {
            tokio::spawn(async move { while events.next().await.is_some() {} });
            server.await.unwrap();
        }

        /// A paged list's answer: the one job `name`.
        fn paged_list_of(name: &str) -> Step {
            answered(
                PAGED_LIST,
                is_paged_list,
                200,
                list_json(&[job_json(name, "1")]),
            )
        }

        const STREAMING_LIST: &str = "a streaming list";
        const PAGED_LIST: &str = "a paged list";
        const WATCH_FROM_9: &str = "a watch from 9";

        #[tokio::test]
        async fn a_watch_lists_with_one_streaming_list() {
            let (mut events, api) = watched();
            let server = serve(
                api,
                vec![
                    answered(STREAMING_LIST, is_streaming_list, 200, streamed()),
                    // The list's answer ended: the watch goes on from its bookmark, no list.
                    left_open(WATCH_FROM_9, is_watch_from_9),
                ],
            );
            assert_eq!(listed(&mut events).await, ["a"]);
            finish(events, server).await;
        }

        #[tokio::test]
        async fn a_refused_streaming_list_gives_way_to_paged_lists() {
            let (mut events, api) = watched();
            let server = serve(
                api,
                vec![
                    // 422: an API server without streaming lists.
                    answered(STREAMING_LIST, is_streaming_list, 422, refusal(422)),
                    paged_list_of("a"),
                    left_open(WATCH_FROM_9, is_watch_from_9),
                ],
            );
            an_error(&mut events).await;
            assert_eq!(listed(&mut events).await, ["a"]);
            finish(events, server).await;
        }

        #[tokio::test]
        async fn a_streaming_list_cut_short_without_an_error_gives_way_to_paged_lists() {
            let (mut events, api) = watched();
            let cut = format!("{{\"type\":\"ADDED\",\"object\":{}}}\n", job_json("a", "1"));
            let server = serve(
                api,
                vec![
                    // The API server closes the list after one object, before its bookmark.
                    answered(STREAMING_LIST, is_streaming_list, 200, cut),
                    // kube's watcher starts a streaming list over, with no error in between.
                    answered(STREAMING_LIST, is_streaming_list, 200, String::new()),
                    paged_list_of("b"),
                    left_open(WATCH_FROM_9, is_watch_from_9),
                ],
            );
            assert_eq!(listed(&mut events).await, ["b"]);
            finish(events, server).await;
        }

        #[tokio::test]
        async fn after_losing_the_api_server_a_watch_lists_in_pages() {
            let (mut events, api) = watched();
            let server = serve(
                api,
                vec![
                    answered(STREAMING_LIST, is_streaming_list, 200, streamed()),
                    // The watch from its bookmark meets an API server that is (re)starting.
                    answered(WATCH_FROM_9, is_watch_from_9, 503, refusal(503)),
                    paged_list_of("b"),
                    left_open(WATCH_FROM_9, is_watch_from_9),
                ],
            );
            assert_eq!(listed(&mut events).await, ["a"]);
            an_error(&mut events).await;
            assert_eq!(listed(&mut events).await, ["b"]);
            finish(events, server).await;
        }

        /// [`watch_from`] "9", in slices of 3 s and then 4 s, then no more.
        fn watched_from_9() -> (Events, ApiHandle) {
            let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<LeasedJob> = Api::namespaced(kube::Client::new(service, "ns"), "ns");
            let mut slices = vec![4, 3];
            let events = watch_from(
                &api,
                "status.holder=w",
                "9",
                move || slices.pop(),
                Arc::new(NoRecorder),
            );
            (Box::pin(events), handle)
        }

        /// A watch from "9" (as [`is_watch_from_9`]) with bookmarks, the selector and a
        /// 3-second slice.
        fn is_selected_watch_from_9(query: &str) -> bool {
            is_watch_from_9(query)
                && query.contains("allowWatchBookmarks=true")
                && query.contains("fieldSelector=status.holder%3Dw")
                && query.contains("timeoutSeconds=3")
        }

        fn is_watch_from_15(query: &str) -> bool {
            query.contains("watch=true")
                && query.contains("resourceVersion=15")
                && query.contains("timeoutSeconds=4")
                && !query.contains("sendInitialEvents=true")
        }

        async fn applied(events: &mut Events) -> String {
            let event = tokio::time::timeout(Duration::from_secs(10), events.next())
                .await
                .expect("an event within 10 s")
                .expect("the stream goes on");
            match event.expect("no error") {
                watcher::Event::Apply(job) => job.name_any(),
                other => panic!("expected an Apply, got {other:?}"),
            }
        }

        #[tokio::test]
        async fn a_watch_from_a_version_lists_nothing_and_slices_go_on_from_the_last_version_seen()
        {
            let (mut events, api) = watched_from_9();
            let changed =
                job_json("a", "1").replace(r#""resourceVersion":"7""#, r#""resourceVersion":"12""#);
            let answer = format!(
                "{{\"type\":\"MODIFIED\",\"object\":{changed}}}\n{}\n",
                r#"{"type":"BOOKMARK","object":{"apiVersion":"leasehold.dev/v1alpha1","kind":"LeasedJob","metadata":{"resourceVersion":"15"}}}"#
            );
            let server = serve(
                api,
                vec![
                    answered(WATCH_FROM_9, is_selected_watch_from_9, 200, answer),
                    // The API server ended the slice: the next goes on from the bookmark's
                    // version; it ends too, and no slice follows.
                    answered("a watch from 15", is_watch_from_15, 200, String::new()),
                ],
            );
            assert_eq!(applied(&mut events).await, "a");
            let end = tokio::time::timeout(Duration::from_secs(10), events.next()).await;
            assert!(matches!(end, Ok(None)), "expected the end, got {end:?}");
            server.await.unwrap();
        }

        #[tokio::test]
        async fn a_watch_from_a_version_ends_after_its_first_error() {
            let (mut events, api) = watched_from_9();
            let gone = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 9 (20)","reason":"Expired","code":410}}"#;
            let server = serve(
                api,
                vec![answered(
                    WATCH_FROM_9,
                    is_selected_watch_from_9,
                    200,
                    format!("{gone}\n"),
                )],
            );
            an_error(&mut events).await;
            let end = tokio::time::timeout(Duration::from_secs(10), events.next()).await;
            assert!(matches!(end, Ok(None)), "expected the end, got {end:?}");
            server.await.unwrap();
        }
    }
}
