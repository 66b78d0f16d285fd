//! Injecting each kind of fault, and picking its target.

use crate::*;

impl Chaos {
    /// After a compaction's probes: a watch of LeasedJobs resumed from a resourceVersion
    /// before the compaction must get 410 Gone (a violation otherwise), and which leasehold
    /// processes logged a watch answered 410 since the compaction is recorded (none is
    /// expected: a watch that lost the API server re-lists instead of resuming from its old
    /// resourceVersion, watch.rs; the test's own watch proves the 410). Waits up to 5 s for
    /// such lines.
    pub(crate) async fn finish_gone_check(&mut self) {
        let Some((before, revision, old_rv)) = self.pending_gone_check.take() else {
            return;
        };
        let (code, gone) = self.watch_is_gone(&old_rv).await;
        self.gone_checks.push(format!(
            "compacted etcd at revision {revision}; a watch of LeasedJobs from resourceVersion \
             {old_rv} then got: {gone}"
        ));
        if code != Some(410) {
            self.violations.push(format!(
                "after compaction at revision {revision}: a watch from resourceVersion {old_rv} \
                 did not get 410 Gone but {gone}"
            ));
        }
        let seen = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let after = self.gone_lines();
                let who: Vec<String> = after
                    .iter()
                    .filter(|(w, n)| before.get(*w).is_some_and(|b| *n > b))
                    .map(|(w, n)| format!("{w} ({})", n - before[w]))
                    .collect();
                if !who.is_empty() {
                    return who;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        self.gone_checks.push(match seen {
            Ok(who) => format!(
                "leasehold processes that logged a watch answered 410 after it: {}",
                who.join(", ")
            ),
            Err(_) => format!(
                "after compaction at revision {revision}: no leasehold process logged a 410 (they \
                 re-listed after losing the API server instead of resuming)"
            ),
        });
    }

    /// A random pod whose worker seems to hold a job right now (its last event is a claim or
    /// a heartbeat), among the `--insist` ones when `insisting`; any pod when none is busy.
    /// Returns the pod and, when busy, the job and attempt of that last event. The events
    /// only suggest it: the worker may be sending its result at this very moment, so what
    /// the attempt became is judged at the end from the job itself ([`Zombie`]).
    pub(crate) fn pick_pod(&mut self, insisting: bool) -> (usize, Option<(String, i64)>) {
        let events = self.events.all();
        let busy: Vec<(usize, (String, i64))> = (0..self.pods.len())
            .filter(|&i| !insisting || self.pods[i].worker_flags.contains(&"--insist"))
            .filter_map(|i| {
                let worker = format!("worker-{}", self.pods[i].id);
                let last = events
                    .iter()
                    .rev()
                    .find(|e| e.worker == worker && e.kind() != "error")?;
                let holds = matches!(last.kind(), "claimed" | "heartbeat");
                let job = last.job().filter(|_| holds)?;
                Some((i, (job.to_string(), last.attempt())))
            })
            .collect();
        match busy.choose(&mut self.rng) {
            Some((i, held)) => (*i, Some(held.clone())),
            None => (self.rng.random_range(0..self.pods.len()), None),
        }
    }

    /// Lines of each leasehold process's log that report a watch answered 410 Gone.
    pub(crate) fn gone_lines(&self) -> BTreeMap<String, usize> {
        let mut logs: Vec<(String, String)> = self
            .controllers
            .iter()
            .map(|(id, c)| (id.clone(), c.log_text()))
            .collect();
        logs.extend(
            self.pods
                .iter()
                .map(|p| (p.id.clone(), p.sidecar.proc.log_text())),
        );
        logs.push(("probe-dispatch".into(), self.probe.proc.log_text()));
        logs.into_iter()
            .map(|(who, text)| {
                let n = text
                    .lines()
                    .filter(|l| l.contains("too old resource version") || l.contains("410 Gone"))
                    .count();
                (who, n)
            })
            .collect()
    }

    pub(crate) fn respawn_worker(&mut self, i: usize) {
        let ns = self.ns.clone();
        let pod = &mut self.pods[i];
        pod.restarts += 1;
        pod.worker = spawn_worker(
            &format!("{ns}-{}-worker-{}", pod.id, pod.restarts),
            &format!("worker-{}", pod.id),
            &pod.sidecar.base,
            &pod.worker_flags,
            &self.events,
        );
    }

    /// Injects `fault`; returns a description and the moment it ended.
    pub(crate) async fn inject(&mut self, fault: Fault) -> (String, Instant) {
        let ld = Duration::from_secs(LEASE_SECONDS as u64);
        match fault {
            Fault::WorkerStop | Fault::SidecarStop => {
                // A frozen insisting worker completes anyway when it wakes: a superseded write.
                let (i, held) = self.pick_pod(fault == Fault::WorkerStop);
                let busy = held.is_some();
                if let (Some((job, attempt)), Fault::WorkerStop) = (held, fault) {
                    self.zombies.push(Zombie {
                        worker: format!("worker-{}", self.pods[i].id),
                        job,
                        attempt,
                    });
                }
                let pod = &self.pods[i];
                let target = if fault == Fault::WorkerStop {
                    &pod.worker
                } else {
                    &pod.sidecar.proc
                };
                let hold = ld + Duration::from_secs(self.rng.random_range(2..=4));
                target.signal("STOP");
                tokio::time::sleep(hold).await;
                target.signal("CONT");
                let busy = if busy { "busy" } else { "idle" };
                (
                    format!("{} ({busy}) frozen {}s", target.name, hold.as_secs()),
                    Instant::now(),
                )
            }
            Fault::WorkerKill => {
                let (i, _) = self.pick_pod(false);
                self.pods[i].worker.signal("KILL");
                let _ = self.pods[i].worker.child.wait();
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.respawn_worker(i);
                (
                    format!("worker-{} killed, restarted", self.pods[i].id),
                    Instant::now(),
                )
            }
            Fault::SidecarKill => {
                let (i, _) = self.pick_pod(false);
                let ns = self.ns.clone();
                let flags: Vec<&str> = self.sidecar_flags.iter().map(String::as_str).collect();
                let pod = &mut self.pods[i];
                pod.sidecar.proc.signal("KILL");
                let _ = pod.sidecar.proc.child.wait();
                pod.restarts += 1;
                let id = format!("{}-r{}", pod.id, pod.restarts);
                pod.sidecar = Sidecar::start_at(
                    &ns,
                    "work",
                    &id,
                    pod.port,
                    &pod.kubeconfig,
                    &flags,
                    Duration::from_secs(60),
                )
                .await;
                (
                    format!("sidecar of {} killed, restarted as {id}", pod.id),
                    Instant::now(),
                )
            }
            Fault::LeaderStop | Fault::LeaderKill => {
                let (i, leader) = self.leader_index().await;
                if fault == Fault::LeaderStop {
                    self.controllers[i].1.signal("STOP");
                    self.probe_during(fault).await;
                    let new = self.wait_leader(Some(&leader)).await;
                    tokio::time::sleep(LEADER_LEASE).await;
                    self.controllers[i].1.signal("CONT");
                    (
                        format!("{leader} frozen until {new} led, +3s"),
                        Instant::now(),
                    )
                } else {
                    self.controllers[i].1.signal("KILL");
                    let _ = self.controllers[i].1.child.wait();
                    self.probe_during(fault).await;
                    let new = self.wait_leader(Some(&leader)).await;
                    let ended = Instant::now();
                    self.controller_restarts += 1;
                    let id = format!("ctl-r{}", self.controller_restarts);
                    let restarted = spawn_controller(&self.ns, &id, &self.dispatchers[i]);
                    self.controllers[i] = (id.clone(), restarted);
                    (
                        format!("{leader} killed, {new} took over; {id} started"),
                        ended,
                    )
                }
            }
            Fault::ApiserverTerm | Fault::ApiserverKill => {
                let sig = if fault == Fault::ApiserverTerm {
                    "TERM"
                } else {
                    "KILL"
                };
                let down = Duration::from_secs(self.rng.random_range(1..=3));
                tokio::task::spawn_blocking(move || restart_apiserver(sig, down))
                    .await
                    .unwrap();
                (format!("down {}s", down.as_secs()), Instant::now())
            }
            Fault::EtcdRestart => {
                let sig = if self.rng.random_bool(0.5) {
                    "TERM"
                } else {
                    "KILL"
                };
                let down = Duration::from_secs(self.rng.random_range(1..=3));
                tokio::task::spawn_blocking(move || restart_etcd(sig, down))
                    .await
                    .unwrap();
                let ready = self.api_ready(Duration::from_secs(60)).await;
                if let Err(e) = ready {
                    self.violations.push(format!("after etcd restart: {e}"));
                }
                (format!("{sig}, down {}s", down.as_secs()), Instant::now())
            }
            Fault::Compaction => {
                // A resourceVersion from before the compaction, to resume a watch from.
                let old_rv = self
                    .jobs
                    .list_metadata(&ListParams::default().limit(1))
                    .await
                    .expect("list jobs")
                    .metadata
                    .resource_version
                    .expect("list resourceVersion");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let before = self.gone_lines();
                let c = compact_etcd().await;
                if !c.old_read_error.contains("compacted") {
                    self.violations.push(format!(
                        "compaction at revision {} did not take: a read at the revision before \
                         answered {:?}",
                        c.revision, c.old_read_error
                    ));
                }
                // A restart empties the API server's watch cache, so every resumed watch
                // must be served from the compacted etcd: 410 Gone.
                tokio::task::spawn_blocking(|| restart_apiserver("TERM", Duration::ZERO))
                    .await
                    .unwrap();
                let ended = Instant::now();
                // The test's own watch from before the compaction, and whether the leasehold
                // processes' watches met the 410 too, are looked at after the probes
                // (finish_gone_check), so that neither wait is counted as the system's
                // recovery. A compacted revision stays compacted: the watch gets 410 then too.
                self.pending_gone_check = Some((before, c.revision, old_rv));
                (
                    format!("revision {}, apiserver restarted", c.revision),
                    ended,
                )
            }
            Fault::RelayStall => {
                let hold = ld + Duration::from_secs(self.rng.random_range(2..=4));
                let pod = self.pods.iter().find(|p| p.relayed).unwrap();
                let id = pod.id.clone();
                self.relay.stall();
                tokio::time::sleep(hold).await;
                self.relay.resume();
                (
                    format!("{id}'s API connections held {}s", hold.as_secs()),
                    Instant::now(),
                )
            }
            Fault::DispatcherStall => {
                // The sidecars' path to the leading dispatcher holds every byte: polls go
                // unanswered, so the sidecars set it aside and choose on their own.
                let (i, leader) = self.leader_index().await;
                let hold = Duration::from_secs(self.rng.random_range(3..=5));
                self.dispatchers[i].1.stall();
                let stalled = Instant::now();
                self.probe_during(fault).await;
                tokio::time::sleep(hold.saturating_sub(stalled.elapsed())).await;
                self.dispatchers[i].1.resume();
                (
                    format!("{leader}'s dispatcher path held {}s", hold.as_secs()),
                    Instant::now(),
                )
            }
            Fault::DispatchersRestart => {
                // Both replicas die at once: the next leader starts with an empty view.
                for (_, c) in &mut self.controllers {
                    c.signal("KILL");
                    let _ = c.child.wait();
                }
                self.probe_during(fault).await;
                let mut ids = Vec::new();
                for i in 0..self.controllers.len() {
                    self.controller_restarts += 1;
                    let id = format!("ctl-r{}", self.controller_restarts);
                    let restarted = spawn_controller(&self.ns, &id, &self.dispatchers[i]);
                    self.controllers[i] = (id.clone(), restarted);
                    ids.push(id);
                }
                let new = self.wait_leader(None).await;
                (
                    format!("both killed; {} started, {new} leads", ids.join(", ")),
                    Instant::now(),
                )
            }
        }
    }

    /// Waits for a leader (as [`Self::wait_leader`]) and answers its index in `controllers`
    /// with its identity.
    async fn leader_index(&self) -> (usize, String) {
        let leader = self.wait_leader(None).await;
        let i = self
            .controllers
            .iter()
            .position(|(id, _)| *id == leader)
            .unwrap_or_else(|| panic!("the leader {leader} is none of the replicas started"));
        (i, leader)
    }

    /// Waits (up to 30 s) for a leader among the replicas, other than `not` when given.
    pub(crate) async fn wait_leader(&self, not: Option<&str>) -> String {
        wait_for(
            &format!("a controller leader other than {not:?}"),
            Duration::from_secs(30),
            || async { self.leader().await.filter(|l| Some(l.as_str()) != not) },
        )
        .await
    }

    /// Resumes a watch of LeasedJobs from `rv`: the status code of the first definite answer
    /// (None for an answer without one) and what it was. A restarted API server may not serve
    /// yet (429 while its storage initialises, a 5xx, a refused or cut connection, no
    /// answer): such answers are asked again until 30 s have passed, each try bounded by what
    /// is left, and the last is said if none is definite.
    pub(crate) async fn watch_is_gone(&self, rv: &str) -> (Option<u16>, String) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (answer, definite) = self.watch_once(rv, deadline).await;
            if definite || Instant::now() >= deadline {
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// One watch of LeasedJobs from `rv`, bounded by `deadline`: its first answer (a status
    /// code if it has one, and a description), and whether that answer is definite: a status
    /// other than 0, 429 and 5xx (as the answer to the request or as an ERROR event), an
    /// object event, or the end of a stream the server kept open for most of its 5 s
    /// timeout. Anything else (an error of the connection, a stream cut early, no answer
    /// in time) is not.
    async fn watch_once(&self, rv: &str, deadline: Instant) -> ((Option<u16>, String), bool) {
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(8))
        };
        let definite_code = |code: u16| code != 0 && code != 429 && code < 500;
        let wp = WatchParams::default().timeout(5);
        let started = Instant::now();
        let watched = tokio::time::timeout(left(), self.jobs.watch(&wp, rv)).await;
        let stream = match watched {
            Err(_) => return ((None, "no answer to the watch in time".into()), false),
            Ok(Err(kube::Error::Api(s))) => {
                let said = format!("HTTP {} {}", s.code, s.message);
                return ((Some(s.code), said), definite_code(s.code));
            }
            Ok(Err(e)) => return ((None, format!("error {e}")), false),
            Ok(Ok(stream)) => stream,
        };
        let mut stream = stream.boxed();
        match tokio::time::timeout(left(), stream.try_next()).await {
            Ok(Ok(Some(WatchEvent::Error(e)))) => (
                (
                    Some(e.code),
                    format!("watch event ERROR {} {}", e.code, e.message),
                ),
                definite_code(e.code),
            ),
            Ok(Ok(Some(_))) => ((None, "an object event (no 410)".into()), true),
            Ok(Ok(None)) => {
                let kept = started.elapsed();
                let said = format!("the end of the stream after {kept:?} (no 410)");
                ((None, said), kept >= Duration::from_millis(4500))
            }
            Ok(Err(kube::Error::Api(s))) => {
                let said = format!("stream error HTTP {} {}", s.code, s.message);
                ((Some(s.code), said), definite_code(s.code))
            }
            Ok(Err(e)) => ((None, format!("stream error {e}")), false),
            Err(_) => ((None, "nothing in time".into()), false),
        }
    }
}
