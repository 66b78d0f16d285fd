//! The worker against a mocked API server: kube's own test pattern, a `tower_test` mock as the
//! client's transport, so that each test sees every request the worker sends and answers it.
//!
//! Every test runs on tokio's paused clock, so that waiting out a request that must not come,
//! or a lease running out, takes no time.
//!
//! The worker is made by [`Worker::start`], whose watches get a second mock that is never
//! answered: the watch caches stay empty and unsynced, which is what these paths meet when
//! the watch has not brought a change yet. Claims are driven through [`Worker::try_claim`]
//! (the claim of one snapshot): [`Worker::claim`] waits for the queue watch to list first.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::Client;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::time::Instant;
use tower_test::mock::{self, Handle, SendResponse};

use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::progress::Progress;
use leasehold_core::token::Token;
use leasehold_core::Category;
use leasehold_kube::api::Clients;
use leasehold_kube::recorder::NoRecorder;

use super::job;
use crate::{Worker, WorkerConfig, WorkerError, DEFAULT_WORKER_TIMEOUT};

type ApiHandle = Handle<Request<Body>, Response<Body>>;

const JOBS: &str = "/apis/leasehold.dev/v1alpha1/namespaces/default/leasedjobs";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/default/leases";

/// The mocked cluster of one test: the requests the worker sends, and its watches' (never
/// answered; kept so that they stay pending rather than fail).
struct Cluster {
    api: ApiHandle,
    watches: ApiHandle,
    /// The watches seen so far, left open.
    open: Vec<SendResponse<Response<Body>>>,
}

fn worker(spread: usize) -> (Worker, Cluster) {
    let (requests, api) = mock::pair::<Request<Body>, Response<Body>>();
    let (watches, watch_handle) = mock::pair::<Request<Body>, Response<Body>>();
    let clients = Clients {
        requests: Client::new(requests, "default"),
        watches: Client::new(watches, "default"),
    };
    let config = WorkerConfig {
        namespace: "default".into(),
        queue: "q".into(),
        identity: "w-1".into(),
        spread,
        worker_timeout: DEFAULT_WORKER_TIMEOUT,
        dispatch: None,
    };
    let (worker, _task) = Worker::start(clients, config, Arc::new(NoRecorder));
    // The queue has no LeasedQueue (its watch is never answered here).
    worker
        .inner
        .queue_object_tx
        .send_replace(leasehold_kube::queue_object::Known::Absent);
    (
        worker,
        Cluster {
            api,
            watches: watch_handle,
            open: Vec::new(),
        },
    )
}

impl Cluster {
    /// The worker's next request, which must be `method` on `path`.
    async fn expect(&mut self, method: &str, path: &str) -> SendResponse<Response<Body>> {
        self.expect_body(method, path).await.1
    }

    /// As [`Cluster::expect`], with the request's body as JSON (Null when it has none).
    async fn expect_body(
        &mut self,
        method: &str,
        path: &str,
    ) -> (Value, SendResponse<Response<Body>>) {
        let (req, send) = tokio::time::timeout(Duration::from_secs(30), self.api.next_request())
            .await
            .unwrap_or_else(|_| panic!("no request came; expected {method} {path}"))
            .expect("the worker's client is gone");
        assert_eq!(
            (req.method().as_str(), req.uri().path()),
            (method, path),
            "unexpected request"
        );
        let bytes = req
            .into_body()
            .collect_bytes()
            .await
            .expect("a request body");
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (body, send)
    }

    /// The query of the worker's next watch of the jobs it holds, and the way to answer it;
    /// its other watches are left open as they come.
    async fn expect_held_watch(&mut self) -> (String, SendResponse<Response<Body>>) {
        loop {
            let (req, send) =
                tokio::time::timeout(Duration::from_secs(30), self.watches.next_request())
                    .await
                    .expect("no watch of the held jobs came")
                    .expect("the worker's client is gone");
            let query = req.uri().query().unwrap_or_default().to_string();
            if query.contains("status.holder%3Dw-1") {
                return (query, send);
            }
            self.open.push(send);
        }
    }

    /// Asserts that no watch of the jobs held starts (within a second of the paused clock);
    /// its other watches are left open as they come.
    async fn expect_no_held_watch(&mut self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while let Ok(Some((req, send))) =
            tokio::time::timeout_at(deadline, self.watches.next_request()).await
        {
            let query = req.uri().query().unwrap_or_default().to_string();
            assert!(
                !query.contains("status.holder%3Dw-1"),
                "unexpected watch: {query}"
            );
            self.open.push(send);
        }
    }

    /// Asserts that the worker sends no request (within a second of the paused clock).
    async fn expect_none(&mut self) {
        if let Ok(Some((req, _))) =
            tokio::time::timeout(Duration::from_secs(1), self.api.next_request()).await
        {
            panic!("unexpected request: {} {}", req.method(), req.uri());
        }
    }
}

fn answer(send: SendResponse<Response<Body>>, code: u16, body: &impl Serialize) {
    let body = serde_json::to_vec(body).unwrap();
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(body))
            .unwrap(),
    );
}

/// Answers 200 with `body` as it is (a watch's stream of events).
fn answer_raw(send: SendResponse<Response<Body>>, body: &str) {
    send.send_response(
        Response::builder()
            .status(200)
            .body(Body::from(body.as_bytes().to_vec()))
            .unwrap(),
    );
}

/// A heartbeat of `name` with `token` (no progress), running while the test answers its requests.
fn spawn_heartbeat(
    w: &Worker,
    name: &'static str,
    token: &Token,
) -> tokio::task::JoinHandle<Result<crate::Renewal, WorkerError>> {
    let (w, token) = (w.clone(), token.clone());
    tokio::spawn(async move {
        w.heartbeat(name, token.as_str(), None, Progress::default())
            .await
    })
}

/// Holds job `j1` for `token` with its Lease written (as after a restart's first renewal),
/// starts a heartbeat, and answers its renewal (a PATCH of the Lease) with `code` and `body`.
async fn heartbeat_answered(
    w: &Worker,
    cluster: &mut Cluster,
    token: &Token,
    code: u16,
    body: &impl Serialize,
) -> tokio::task::JoinHandle<Result<crate::Renewal, WorkerError>> {
    w.hold("j1", token.clone(), 30, None, Instant::now());
    let heartbeat = spawn_heartbeat(w, "j1", token);
    let send = cluster.expect("PATCH", &format!("{LEASES}/ljob-j1")).await;
    answer(send, code, body);
    heartbeat
}

/// A list of LeasedJobs read at `revision` (a LIST's answer).
fn job_list(revision: &str, items: &[LeasedJob]) -> Value {
    json!({
        "kind": "LeasedJobList", "apiVersion": "leasehold.dev/v1alpha1",
        "metadata": {"resourceVersion": revision}, "items": items,
    })
}

/// An API server's refusal with `code`.
fn status(code: u16, reason: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("refused: {reason}"), "reason": reason, "code": code,
    })
}

fn lease(name: &str, holder: &Token) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(format!("ljob-{name}")),
            namespace: Some("default".into()),
            resource_version: Some("7".into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.as_str().to_string()),
            lease_duration_seconds: Some(60),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..LeaseSpec::default()
        }),
    }
}

fn queued(name: &str) -> LeasedJob {
    job(name, Phase::Queued, 0, None)
}

#[tokio::test(start_paused = true)]
async fn a_claim_answered_409_marks_the_snapshot_stale_and_widens_the_window() {
    // With more claimable jobs than the window holds, a 409 widens it fourfold; with fewer,
    // a wider window would not spread claimers, and it stays.
    for (claimable, window) in [(100, 64), (10, 16)] {
        let (w, mut cluster) = worker(16);
        {
            let mut index = w.inner.queue.as_ref().unwrap().index.lock().unwrap();
            for i in 0..claimable {
                index.apply(&queued(&format!("j{i}")));
            }
        }
        let claim = tokio::spawn({
            let w = w.clone();
            async move { w.try_claim(&queued("j0"), None).await }
        });
        let send = cluster.expect("PUT", &format!("{JOBS}/j0/status")).await;
        answer(send, 409, &status(409, "Conflict"));
        let claimed = claim.await.unwrap().expect("a 409 is not an error");
        assert!(
            matches!(claimed, crate::pick::Tried::Lost),
            "a lost race claims nothing"
        );
        assert!(
            w.inner
                .queue
                .as_ref()
                .unwrap()
                .tried
                .lock()
                .unwrap()
                .contains("j0", "rv-j0"),
            "the snapshot is known stale and not tried again"
        );
        assert_eq!(
            w.inner.window.load(Ordering::Relaxed),
            window,
            "{claimable} claimable"
        );
        assert_eq!(w.held_count(), 0);
        cluster.expect_none().await;
    }
}

/// A claim the API server refuses as outside its copy of the queue's limits writes nothing and
/// holds claims under the same copy of the LeasedQueue for the hold, asking nothing meanwhile;
/// a new copy (the watch caught up) claims at once.
#[tokio::test(start_paused = true)]
async fn a_claim_refused_outside_the_limits_holds_claims_under_that_copy() {
    let (w, mut cluster) = worker(16);
    let refusal = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "reason": "Invalid", "code": 422,
        "message": "leasedjobs.leasehold.dev \"j0\" is forbidden: ValidatingAdmissionPolicy \
            'leasehold-worker-limits' with binding 'leasehold-worker-limits' denied request: \
            leasehold rule limits-obeyed: a claim of LeasedJob j0 in queue q records ...",
    });
    let claim = |w: &Worker| {
        let w = w.clone();
        tokio::spawn(async move { w.try_claim(&queued("j0"), None).await })
    };
    let first = claim(&w);
    let send = cluster.expect("PUT", &format!("{JOBS}/j0/status")).await;
    answer(send, 422, &refusal);
    let tried = first
        .await
        .unwrap()
        .expect("a refusal under the limits is not an error");
    assert!(matches!(tried, crate::pick::Tried::HeldBack));
    assert_eq!(w.held_count(), 0);
    // Under the same copy (none): held, nothing asked.
    let held = claim(&w);
    cluster.expect_none().await;
    assert!(matches!(
        held.await.unwrap().unwrap(),
        crate::pick::Tried::HeldBack
    ));
    // After the hold, asked again.
    tokio::time::advance(crate::limited::OUTSIDE_LIMITS_HOLD).await;
    let again = claim(&w);
    let send = cluster.expect("PUT", &format!("{JOBS}/j0/status")).await;
    answer(send, 422, &refusal);
    assert!(matches!(
        again.await.unwrap().unwrap(),
        crate::pick::Tried::HeldBack
    ));
    // A new copy of the LeasedQueue: at once.
    let mut queue = leasehold_core::queue::LeasedQueue::new("q", Default::default());
    queue.metadata.resource_version = Some("9".into());
    w.inner
        .queue_object_tx
        .send_replace(leasehold_kube::queue_object::Known::Present(Arc::new(
            queue,
        )));
    let fresh = claim(&w);
    let send = cluster.expect("PUT", &format!("{JOBS}/j0/status")).await;
    answer(send, 409, &status(409, "Conflict"));
    assert!(matches!(
        fresh.await.unwrap().unwrap(),
        crate::pick::Tried::Lost
    ));
}

#[tokio::test(start_paused = true)]
async fn a_refused_lease_renewal_makes_every_later_call_lease_lost_without_asking() {
    for refused in [422, 409] {
        let (w, mut cluster) = worker(16);
        let t1 = Token::issue(1);
        let t2 = Token::issue(2);
        let heartbeat =
            heartbeat_answered(&w, &mut cluster, &t1, refused, &status(refused, "Invalid")).await;
        // The renewal's refusal is told from a passing fault by a fresh read of the Lease...
        let send = cluster.expect("GET", &format!("{LEASES}/ljob-j1")).await;
        answer(send, 200, &lease("j1", &t2));
        // ...and explained by the job.
        let send = cluster.expect("GET", &format!("{JOBS}/j1")).await;
        answer(send, 200, &job("j1", Phase::Leased, 2, Some(&t2)));
        let e = heartbeat.await.unwrap().unwrap_err();
        assert_eq!(e.category(), "lease_lost", "{refused}: {e}");
        assert!(
            !e.to_string().contains(t2.as_str()),
            "names the new token: {e}"
        );
        assert_eq!(w.held_count(), 0, "a lost attempt is not held");
        // From now on the attempt's calls are answered here.
        let again = w
            .heartbeat("j1", t1.as_str(), None, Progress::default())
            .await
            .unwrap_err();
        let complete = w.complete("j1", t1.as_str(), json!(1)).await.unwrap_err();
        let release = w.release("j1", t1.as_str()).await.unwrap_err();
        for e in [again, complete, release] {
            assert!(
                matches!(
                    e,
                    WorkerError::LeaseLost {
                        code: "lease_lost",
                        ..
                    }
                ),
                "{refused}: {e:?}"
            );
        }
        cluster.expect_none().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_complete_with_a_stale_token_is_refused_by_the_read_and_writes_nothing() {
    let t1 = Token::issue(1);
    let t2 = Token::issue(2);
    // What the read finds, and the refusal's category.
    let cases: [(Option<LeasedJob>, &str); 4] = [
        (Some(job("j1", Phase::Leased, 2, Some(&t2))), "lease_lost"),
        (Some(job("j1", Phase::Queued, 1, Some(&t1))), "lease_lost"),
        (Some(job("j1", Phase::Cancelled, 1, Some(&t1))), "cancelled"),
        (
            Some(job("j1", Phase::Succeeded, 2, Some(&t2))),
            "job_finished",
        ),
    ];
    for (found, category) in cases.into_iter().chain([(None, "job_not_found")]) {
        let (w, mut cluster) = worker(16);
        let complete = tokio::spawn({
            let (w, t1) = (w.clone(), t1.clone());
            async move { w.complete("j1", t1.as_str(), json!({"n": 1})).await }
        });
        let send = cluster.expect("GET", &format!("{JOBS}/j1")).await;
        match &found {
            Some(j) => answer(send, 200, j),
            None => answer(send, 404, &status(404, "NotFound")),
        }
        let e = complete.await.unwrap().unwrap_err();
        assert!(matches!(e, WorkerError::Refused(_)), "{e:?}");
        assert_eq!(e.category(), category, "{e}");
        // No status patch follows the refusal.
        cluster.expect_none().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_heartbeat_after_this_process_completed_the_attempt_is_refused_without_asking() {
    let (w, mut cluster) = worker(16);
    let t1 = Token::issue(1);
    let leased = job("j1", Phase::Leased, 1, Some(&t1));
    // Claimed here: its Lease is not written yet, and the claim's answer is the snapshot.
    w.hold("j1", t1.clone(), 30, Some(leased), Instant::now());
    let complete = tokio::spawn({
        let (w, t1) = (w.clone(), t1.clone());
        async move { w.complete("j1", t1.as_str(), json!("done")).await }
    });
    // One write, built from the claim's answer: no read, and no Lease written.
    let send = cluster.expect("PUT", &format!("{JOBS}/j1/status")).await;
    answer(send, 200, &job("j1", Phase::Succeeded, 1, Some(&t1)));
    let done = complete.await.unwrap().unwrap();
    assert_eq!(done.phase(), Phase::Succeeded);
    assert_eq!(w.held_count(), 0);
    let e = w
        .heartbeat("j1", t1.as_str(), None, Progress::default())
        .await
        .unwrap_err();
    assert!(matches!(e, WorkerError::Refused(_)), "{e:?}");
    assert_eq!(e.category(), "job_finished", "{e}");
    cluster.expect_none().await;
}

#[tokio::test(start_paused = true)]
async fn a_completion_replaces_the_status_under_the_snapshots_version_and_patches_after_a_conflict()
{
    let (w, mut cluster) = worker(16);
    let t1 = Token::issue(1);
    let mut leased = job("j1", Phase::Leased, 1, Some(&t1));
    leased.spec.payload = json!({"audio": "long"});
    let held = leased.status.as_mut().unwrap();
    held.claimed_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        Timestamp::UNIX_EPOCH,
    ));
    held.checkpoint = Some(json!({"offset": 7}));
    w.hold("j1", t1.clone(), 30, Some(leased), Instant::now());
    let complete = tokio::spawn({
        let (w, t1) = (w.clone(), t1.clone());
        async move { w.complete("j1", t1.as_str(), json!("done")).await }
    });
    // The replace carries the snapshot's resourceVersion and the ended status, not the
    // payload (the status subresource keeps the stored spec).
    let (body, send) = cluster
        .expect_body("PUT", &format!("{JOBS}/j1/status"))
        .await;
    assert_eq!(body["metadata"]["resourceVersion"], json!("rv-j1"));
    assert_eq!(body["status"]["phase"], json!("Succeeded"));
    assert_eq!(body["status"]["result"], json!("done"));
    assert_eq!(body["status"]["token"], json!(t1.as_str()));
    assert!(body["spec"]["payload"].is_null(), "{body}");
    // What the ending does not change is sent as it was.
    assert_eq!(body["status"]["attempt"], json!(1));
    assert_eq!(body["status"]["holder"], json!("w-1"));
    assert_eq!(body["status"]["claimedTime"], json!("1970-01-01T00:00:00Z"));
    assert_eq!(body["status"]["checkpoint"], json!({"offset": 7}));
    // Something changed since the snapshot (a label, say): the attempt is ended from a
    // fresh read by the patch that tests the token and phase.
    answer(send, 409, &status(409, "Conflict"));
    let send = cluster.expect("GET", &format!("{JOBS}/j1")).await;
    let mut newer = job("j1", Phase::Leased, 1, Some(&t1));
    newer.metadata.resource_version = Some("rv-j1-2".into());
    answer(send, 200, &newer);
    let (patch, send) = cluster
        .expect_body("PATCH", &format!("{JOBS}/j1/status"))
        .await;
    assert_eq!(
        patch[0],
        json!({"op": "test", "path": "/status/token", "value": t1.as_str()})
    );
    answer(send, 200, &job("j1", Phase::Succeeded, 1, Some(&t1)));
    let done = complete.await.unwrap().unwrap();
    assert_eq!(done.phase(), Phase::Succeeded);
    cluster.expect_none().await;
}

/// Completes `j1` held by `t1` from the snapshot `held`, answering the worker's requests in
/// turn with `answers` (method, answer code, answer body), each checked against the path of
/// the job or its status; returns the completion's outcome. No request may follow.
async fn complete_answered(
    held: LeasedJob,
    t1: &Token,
    answers: Vec<(&str, u16, Value)>,
) -> Result<LeasedJob, WorkerError> {
    let (w, mut cluster) = worker(16);
    w.hold("j1", t1.clone(), 30, Some(held), Instant::now());
    let complete = tokio::spawn({
        let (w, t1) = (w.clone(), t1.clone());
        async move { w.complete("j1", t1.as_str(), json!("done")).await }
    });
    for (method, code, body) in answers {
        let path = match method {
            "GET" => format!("{JOBS}/j1"),
            _ => format!("{JOBS}/j1/status"),
        };
        let send = cluster.expect(method, &path).await;
        answer(send, code, &body);
    }
    let outcome = complete.await.unwrap();
    cluster.expect_none().await;
    outcome
}

#[tokio::test(start_paused = true)]
async fn a_snapshot_without_a_version_or_with_a_large_status_is_ended_by_the_patch_unread() {
    let t1 = Token::issue(1);
    let done = serde_json::to_value(job("j1", Phase::Succeeded, 1, Some(&t1))).unwrap();
    let mut unversioned = job("j1", Phase::Leased, 1, Some(&t1));
    unversioned.metadata.resource_version = None;
    let mut large = job("j1", Phase::Leased, 1, Some(&t1));
    large.status.as_mut().unwrap().checkpoint = Some(json!(
        "x".repeat(leasehold_kube::fence::MAX_REPLACED_STATUS_BYTES,)
    ));
    for held in [unversioned, large] {
        let ended = complete_answered(held, &t1, vec![("PATCH", 200, done.clone())]).await;
        assert_eq!(ended.unwrap().phase(), Phase::Succeeded);
    }
}

#[tokio::test(start_paused = true)]
async fn a_replace_that_landed_but_lost_its_answer_is_found_applied_after_its_conflict() {
    let t1 = Token::issue(1);
    let mut done = job("j1", Phase::Succeeded, 1, Some(&t1));
    done.status.as_mut().unwrap().result = Some(json!("done"));
    let ended = complete_answered(
        job("j1", Phase::Leased, 1, Some(&t1)),
        &t1,
        vec![
            ("PUT", 409, status(409, "Conflict")),
            ("GET", 200, serde_json::to_value(&done).unwrap()),
        ],
    )
    .await;
    assert_eq!(ended.unwrap().phase(), Phase::Succeeded);
}

#[tokio::test(start_paused = true)]
async fn a_replace_failing_with_a_server_error_is_unavailable_and_not_patched() {
    let t1 = Token::issue(1);
    let e = complete_answered(
        job("j1", Phase::Leased, 1, Some(&t1)),
        &t1,
        vec![("PUT", 500, status(500, "InternalError"))],
    )
    .await
    .unwrap_err();
    assert_eq!(e.category(), "unavailable", "{e}");
}

#[tokio::test(start_paused = true)]
async fn a_completion_from_a_superseded_snapshot_is_refused_after_its_conflict() {
    let (w, mut cluster) = worker(16);
    let t1 = Token::issue(1);
    w.hold(
        "j1",
        t1.clone(),
        30,
        Some(job("j1", Phase::Leased, 1, Some(&t1))),
        Instant::now(),
    );
    let complete = tokio::spawn({
        let (w, t1) = (w.clone(), t1.clone());
        async move { w.complete("j1", t1.as_str(), json!("late")).await }
    });
    let send = cluster.expect("PUT", &format!("{JOBS}/j1/status")).await;
    answer(send, 409, &status(409, "Conflict"));
    // The job expired and was claimed again meanwhile: the read explains, nothing is written.
    let send = cluster.expect("GET", &format!("{JOBS}/j1")).await;
    let t2 = Token::issue(2);
    answer(send, 200, &job("j1", Phase::Leased, 2, Some(&t2)));
    let e = complete.await.unwrap().unwrap_err();
    assert!(matches!(e, WorkerError::Refused(_)), "{e:?}");
    assert!(!e.to_string().contains(t2.as_str()), "{e}");
    cluster.expect_none().await;
}

/// Answers every request with 500, or the first Lease renewal with success when
/// `first_succeeds`, until no request comes for a minute (the renewer stopped). Reads of the
/// job (made because the held-jobs cache, never filled here, does not show it) find it Leased
/// to `t1`. Returns when each renewal was sent (from the start) and the worker's held count
/// then.
async fn fail_renewals(
    w: &Worker,
    cluster: &mut Cluster,
    start: Instant,
    t1: &Token,
    first_succeeds: bool,
) -> Vec<(Duration, usize)> {
    let mut renewals = Vec::new();
    while let Ok(Some((req, send))) =
        tokio::time::timeout(Duration::from_secs(60), cluster.api.next_request()).await
    {
        if (req.method().as_str(), req.uri().path()) == ("GET", JOBS) {
            answer(
                send,
                200,
                &job_list("9", &[job("j1", Phase::Leased, 1, Some(t1))]),
            );
            continue;
        }
        assert_eq!(req.uri().path(), format!("{LEASES}/ljob-j1"));
        if req.method() == "PATCH" {
            renewals.push((start.elapsed(), w.held_count()));
            if first_succeeds && renewals.len() == 1 {
                answer(send, 200, &lease("j1", t1));
                continue;
            }
        }
        answer(send, 500, &status(500, "InternalError"));
    }
    renewals
}

#[tokio::test(start_paused = true)]
async fn renewals_failing_for_a_whole_lease_duration_declare_the_lease_lost() {
    // A 6 s lease: renewed every 2 s, retried every 1 s after a failure, lost 6 s after the
    // last confirmed renewal (the start, or the one success).
    for (first_succeeds, lost_at) in [(false, 6), (true, 8)] {
        let (w, mut cluster) = worker(16);
        let t1 = Token::issue(1);
        let start = Instant::now();
        w.hold("j1", t1.clone(), 6, None, start);
        let renewals = fail_renewals(&w, &mut cluster, start, &t1, first_succeeds).await;
        let times: Vec<u64> = renewals.iter().map(|(t, _)| t.as_secs()).collect();
        let expected: Vec<u64> = if first_succeeds {
            vec![2, 4, 5, 6, 7, 8]
        } else {
            vec![2, 3, 4, 5, 6]
        };
        assert_eq!(times, expected, "renewals sent at (s)");
        // Held through every renewal; the failure of the one at a whole lease declares it lost.
        assert!(renewals.iter().all(|(_, held)| *held == 1), "{renewals:?}");
        assert_eq!(*times.last().unwrap(), lost_at);
        assert_eq!(w.held_count(), 0, "lost after {lost_at} s");
        let e = w
            .heartbeat("j1", t1.as_str(), None, Progress::default())
            .await
            .unwrap_err();
        assert!(
            matches!(&e, WorkerError::LeaseLost { code: "lease_lost", message } if message.contains("a whole lease duration")),
            "{e:?}"
        );
        cluster.expect_none().await;
    }
}

#[tokio::test(start_paused = true)]
async fn the_held_jobs_are_watched_from_a_first_renewal_until_a_slice_passes_with_nothing_held() {
    let (w, mut cluster) = worker(16);
    let cached = |name: &str| {
        let key = kube::runtime::reflector::ObjectRef::new(name).within("default");
        w.inner.held_watch.store.get(&key)
    };
    let version = |name: &str| cached(name).and_then(|j| j.metadata.resource_version.clone());
    let at = |name: &str, version: &str| {
        let mut j = job(name, Phase::Leased, 1, Some(&Token::issue(1)));
        j.metadata.resource_version = Some(version.into());
        j
    };
    let hold = |name: &str, version: &str| {
        w.hold(
            name,
            Token::issue(1),
            30,
            Some(at(name, version)),
            Instant::now(),
        );
    };
    // A watch event, "type" first as the API server writes it.
    let event = |name: &str, version: &str, phase: Phase| {
        let mut j = job(name, phase, 1, Some(&Token::issue(1)));
        j.metadata.resource_version = Some(version.into());
        let object = serde_json::to_string(&j).unwrap();
        format!("{{\"type\":\"MODIFIED\",\"object\":{object}}}\n")
    };
    // The API server ends a slice of the watch.
    let end_slice = |send: SendResponse<Response<Body>>| answer_raw(send, "");
    hold("j1", "41");
    // A claim starts no watch: a job that ends before its first renewal costs none.
    cluster.expect_no_held_watch().await;
    assert!(cached("j1").is_none());
    // Its first renewal reads it (at revision 44), and the read starts the watch: cached, and
    // watched from that revision, with no list and a first slice of a second.
    w.inner.held_watch.renewing(&at("j1", "41"), 44);
    let (query, slice) = cluster.expect_held_watch().await;
    assert!(
        query.contains("watch=true")
            && query.contains("resourceVersion=44")
            && query.contains("timeoutSeconds=1")
            && !query.contains("sendInitialEvents"),
        "{query}"
    );
    assert_eq!(version("j1").as_deref(), Some("41"));
    // Claims while it runs add nothing to the cache. j2 was claimed at 40, before the watch
    // began, and is read at 48: cached, and its change at 46 (older than the read, still on
    // its way) is passed over, while its change at 50 is applied.
    hold("j2", "40");
    hold("j3", "45");
    w.inner.held_watch.renewing(&at("j2", "40"), 48);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(version("j2").as_deref(), Some("40"));
    answer_raw(
        slice,
        &(event("j3", "45", Phase::Leased) + &event("j2", "46", Phase::Failed)),
    );
    let (query, slice) = cluster.expect_held_watch().await;
    assert!(
        query.contains("resourceVersion=46") && query.contains("timeoutSeconds=2"),
        "{query}"
    );
    assert_eq!(version("j2").as_deref(), Some("40"));
    assert_eq!(version("j3").as_deref(), Some("45"));
    // A read from before the watch's start is not cached: a change between the two would never
    // come.
    hold("j5", "42");
    w.inner.held_watch.renewing(&at("j5", "42"), 43);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(cached("j5").is_none());
    // j3 left the cache (claimed by another holder, say): a read of it, even a later one, is
    // not cached (it may be older than that change).
    answer_raw(
        slice,
        &(event("j2", "50", Phase::Leased)
            + &event("j3", "47", Phase::Leased).replace("MODIFIED", "DELETED")),
    );
    let (_, slice) = cluster.expect_held_watch().await;
    assert_eq!(version("j2").as_deref(), Some("50"));
    assert!(cached("j3").is_none());
    w.inner.held_watch.renewing(&at("j3", "45"), 49);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(cached("j3").is_none());
    // Every attempt ends, and the slice passes with nothing held and no claim: the watch
    // stops and its cache empties.
    for h in w.inner.held.lock().unwrap().values() {
        crate::renew::mark_ended(h);
    }
    assert!(cached("j1").is_some());
    end_slice(slice);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(cached("j1").is_none() && cached("j2").is_none());
    // The next first renewal watches again, from its own read.
    hold("j4", "50");
    w.inner.held_watch.renewing(&at("j4", "50"), 52);
    let (query, _slice) = cluster.expect_held_watch().await;
    assert!(query.contains("resourceVersion=52"), "{query}");
    assert!(cached("j4").is_some());
}

#[tokio::test(start_paused = true)]
async fn a_first_renewal_starts_the_watch_only_with_a_read_that_shows_this_process_holding() {
    for (holder, watched) in [("w-1", true), ("w-2", false)] {
        let (w, mut cluster) = worker(16);
        let mut claimed = job("j1", Phase::Leased, 1, Some(&Token::issue(1)));
        claimed.metadata.resource_version = Some("41".into());
        w.hold(
            "j1",
            Token::issue(1),
            30,
            Some(claimed.clone()),
            Instant::now(),
        );
        let read = tokio::spawn({
            let w = w.clone();
            async move { w.read_if_uncached("j1").await }
        });
        // The cache is empty (no watch runs): the renewal reads the job, by name, at the
        // revision the list names...
        let send = cluster.expect("GET", JOBS).await;
        let mut now = claimed.clone();
        now.status.as_mut().unwrap().holder = Some(holder.into());
        answer(send, 200, &job_list("70", &[now]));
        assert!(read.await.unwrap().is_some());
        // ...and the watch starts from what it read, when that shows this process holding the
        // job (else the attempt is lost, and nothing is watched for it).
        if watched {
            let (query, _slice) = cluster.expect_held_watch().await;
            assert!(query.contains("resourceVersion=70"), "{query}");
        } else {
            cluster.expect_no_held_watch().await;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_held_job_the_cache_does_not_show_is_read_after_a_renewal_even_with_no_watch_synced() {
    // Held with its Lease written, as after a restart: the held-jobs watch lists, and its list
    // (never answered here) has not ended.
    let (w, mut cluster) = worker(16);
    let t1 = Token::issue(1);
    let t2 = Token::issue(2);
    // The Lease still names t1 (its new holder has not taken it over yet) and accepts...
    let heartbeat = heartbeat_answered(&w, &mut cluster, &t1, 200, &lease("j1", &t1)).await;
    // ...but the job, read because the cache does not show it, was claimed by t2.
    let send = cluster.expect("GET", JOBS).await;
    answer(
        send,
        200,
        &job_list("9", &[job("j1", Phase::Leased, 2, Some(&t2))]),
    );
    let e = heartbeat.await.unwrap().unwrap_err();
    assert!(matches!(e, WorkerError::Refused(_)), "{e:?}");
    assert_eq!(w.held_count(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_first_renewal_reads_the_job_once_after_its_lease_write_and_watches_from_that_read() {
    let (w, mut cluster) = worker(16);
    let t1 = Token::issue(1);
    let claimed = job("j1", Phase::Leased, 1, Some(&t1));
    w.hold("j1", t1.clone(), 30, Some(claimed.clone()), Instant::now());
    let heartbeat = spawn_heartbeat(&w, "j1", &t1);
    // The first renewal writes the Lease...
    let send = cluster.expect("POST", LEASES).await;
    answer(send, 201, &lease("j1", &t1));
    // ...then reads the job by name, which shows it Leased to the token...
    let send = cluster.expect("GET", JOBS).await;
    answer(send, 200, &job_list("80", &[claimed]));
    heartbeat.await.unwrap().unwrap();
    // ...and that read is the one read of the heartbeat: it starts the watch, from its revision.
    let (query, _slice) = cluster.expect_held_watch().await;
    assert!(query.contains("resourceVersion=80"), "{query}");
    cluster.expect_none().await;
}

#[tokio::test(start_paused = true)]
async fn a_background_first_renewal_reads_the_job_only_after_its_lease_write() {
    let (w, mut cluster) = worker(16);
    let t1 = Token::issue(1);
    let claimed = job("j1", Phase::Leased, 1, Some(&t1));
    w.hold("j1", t1.clone(), 30, Some(claimed.clone()), Instant::now());
    // No heartbeat comes: the sidecar renews on its own, first writing the Lease (no read
    // before it)...
    let send = cluster.expect("POST", LEASES).await;
    answer(send, 201, &lease("j1", &t1));
    // ...then reading the job, which still shows the attempt: it stays held.
    let send = cluster.expect("GET", JOBS).await;
    answer(send, 200, &job_list("80", &[claimed]));
    let (query, _slice) = cluster.expect_held_watch().await;
    assert!(query.contains("resourceVersion=80"), "{query}");
    assert_eq!(w.held_count(), 1);
}
