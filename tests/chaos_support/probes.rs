//! The two liveness probes run after every fault: dispatch and expiry.

use crate::*;

/// A claim through `sidecar`, retried on 204 (nothing yet) and 503 (watch not synced yet)
/// until `within` has passed; each request bounded, so a hung sidecar cannot hang the test.
/// Ok((claim, when it arrived)) or Err(what went wrong).
async fn claim_within(sidecar: &Sidecar, within: Duration) -> Result<(Value, Instant), String> {
    let deadline = Instant::now() + within;
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .as_secs()
            .clamp(1, 10);
        let answer = tokio::time::timeout(Duration::from_secs(wait + 5), sidecar.claim(wait)).await;
        match answer {
            Ok((200, body)) => return Ok((body, Instant::now())),
            Ok((204, _)) => last = "204 (nothing claimable)".into(),
            Ok((s, body)) => {
                last = format!("{s} {body}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => last = format!("claim?wait={wait} did not answer within {}s", wait + 5),
        }
    }
    Err(format!("no claim within {within:?}; last answer: {last}"))
}

impl Chaos {
    /// Waits until the API server answers /readyz with 200.
    pub(crate) async fn api_ready(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
            let r = tokio::time::timeout(Duration::from_secs(5), self.client.request_text(req));
            if let Ok(Ok(_)) = r.await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the API server was not ready within {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the API server accepts a write (an annotation of a Lease of the test's own,
    /// set to a new value each try): after an etcd restart it answered /readyz while its
    /// storage still refused requests for seconds. Answers how long that took; an error after
    /// `within`.
    pub(crate) async fn api_writes(&self, within: Duration) -> Result<Duration, String> {
        let began = Instant::now();
        let params = kube::api::PatchParams::apply("leasehold-chaos").force();
        loop {
            let lease = json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": "chaos-writes",
                    "annotations": {"leasehold.dev/chaos-write": Timestamp::now().to_string()}},
            });
            let patch = kube::api::Patch::Apply(&lease);
            let write = tokio::time::timeout(
                Duration::from_secs(5),
                self.leases.patch("chaos-writes", &params, &patch),
            );
            if let Ok(Ok(_)) = write.await {
                return Ok(began.elapsed());
            }
            if began.elapsed() > within {
                return Err(format!(
                    "the API server accepted no write within {within:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the leading controller renews its Lease after this call began: its writes
    /// land again. Expiry is judged by the leader on its own clock from when it sees each
    /// renewal (docs/protocol.md, "Expiry"), and a replica that (re)gains leadership first
    /// waits a whole leaseDurationSeconds from its first sighting, so a fault that cost the
    /// leader its term (an etcd restart during which its renewals failed) ends only when a
    /// leader renews again. Answers how long that took; an error after `within`.
    pub(crate) async fn leader_renewing(&self, within: Duration) -> Result<Duration, String> {
        let began = Instant::now();
        let from = Timestamp::now();
        loop {
            let lease = tokio::time::timeout(
                Duration::from_secs(5),
                self.leases.get_opt("leasehold-controller"),
            )
            .await;
            let renewed = match lease {
                Ok(Ok(Some(l))) => l
                    .spec
                    .and_then(|s| s.renew_time)
                    .is_some_and(|t| t.0 > from),
                _ => false,
            };
            if renewed && self.leader().await.is_some() {
                return Ok(began.elapsed());
            }
            if began.elapsed() > within {
                return Err(format!(
                    "no controller leader renewed its Lease within {within:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Dispatch probe: a claim already waiting in the probe sidecar's long poll, a job
    /// created for it; (create -> claimed, fault end -> claimed).
    pub(crate) async fn dispatch_probe(
        &self,
        name: &str,
        ended: Instant,
    ) -> Result<(Duration, Duration), String> {
        let claimer = claim_within(&self.probe, Duration::from_secs(30));
        let creator = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.create(
                json!({"metadata": {"name": name}, "spec": {"queue": "dispatch-probe",
                "leaseDurationSeconds": LEASE_SECONDS}}),
            )
            .await
        };
        let (claimed, t0) = tokio::join!(claimer, creator);
        let (claim, at) = claimed?;
        if claim["name"] != name {
            return Err(format!(
                "the probe claimed {} instead of {name}",
                claim["name"]
            ));
        }
        let token = claim["token"].as_str().unwrap_or_default();
        while_leased(&format!("completing {name}"), || {
            self.probe.complete(name, token, json!("probe"))
        })
        .await?;
        Ok((at.saturating_duration_since(t0), at - ended))
    }

    /// Expiry probe: a fresh sidecar claims a job, heartbeats once (the first renewal writes
    /// the Lease), is killed; the time from the Lease's last renewTime to the requeue seen.
    pub(crate) async fn expiry_probe(&self, n: usize) -> Result<Duration, String> {
        let name = format!("probe-e-{n}");
        let queue = format!("expiry-probe-{n}");
        self.create(json!({"metadata": {"name": name}, "spec": {"queue": queue,
            "leaseDurationSeconds": LEASE_SECONDS, "maxAttempts": 100}}))
            .await;
        let holder = Sidecar::start(&self.ns, &queue, &format!("probe-holder-{n}"), &[]).await;
        let (claim, _) = claim_within(&holder, Duration::from_secs(30)).await?;
        if claim["name"] != name {
            return Err(format!(
                "the holder claimed {} instead of {name}",
                claim["name"]
            ));
        }
        let token = claim["token"].as_str().unwrap_or_default();
        // Right after an etcd restart the API server may take a few seconds more to write
        // Leases than LeasedJobs. A heartbeat that cannot land within the lease is the
        // violation.
        while_leased(&format!("the first heartbeat of {name}"), || {
            holder.heartbeat(&name, json!({"token": token}))
        })
        .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.proc.signal("KILL");
        drop(holder);
        // A renewal in flight at the kill may still land.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let lease =
            tokio::time::timeout(Duration::from_secs(10), self.leases.get(&lease_name(&name)))
                .await
                .map_err(|_| format!("reading the Lease of {name} took over 10 s"))?
                .map_err(|e| format!("reading the Lease of {name}: {e}"))?;
        let renewed = lease
            .spec
            .and_then(|s| s.renew_time)
            .ok_or_else(|| format!("the Lease of {name} has no renewTime"))?
            .0;
        let limit = Duration::from_secs(3 * LEASE_SECONDS as u64 + 20);
        let start = Instant::now();
        loop {
            if let Ok(Ok(j)) =
                tokio::time::timeout(Duration::from_secs(5), self.jobs.get(&name)).await
            {
                let expired = j.status.as_ref().is_some_and(|s| {
                    s.failures
                        .iter()
                        .any(|f| f.attempt == 1 && f.reason == REASON_LEASE_EXPIRED)
                });
                if expired {
                    let took = Timestamp::now().duration_since(renewed).as_secs_f64();
                    return Ok(Duration::from_secs_f64(took.max(0.0)));
                }
            }
            if start.elapsed() > limit {
                return Err(format!(
                    "{name} was not requeued within {limit:?} of its holder's death"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A dispatch probe while a dispatcher fault holds (the leader frozen or killed, its path
    /// stalled, every replica dead): claims must not wait on the dispatcher, so the probe's
    /// create -> claimed is held to the same bound. Kept for the fault's row of the table.
    pub(crate) async fn probe_during(&mut self, fault: Fault) {
        self.probes += 1;
        let name = format!("probe-f-{}", self.probes);
        match self.dispatch_probe(&name, Instant::now()).await {
            Ok((d, _)) => {
                if d > DISPATCH_BOUND {
                    self.violations.push(format!(
                        "during {}: dispatch took {} ms, bound {} ms ({name}: create -> claimed \
                         by a worker waiting in a long poll, while the dispatcher could not answer)",
                        fault.label(),
                        d.as_millis(),
                        DISPATCH_BOUND.as_millis()
                    ));
                }
                self.during = Some(d);
            }
            Err(e) => self.violations.push(format!(
                "during {}: dispatch probe {name}: {e}",
                fault.label()
            )),
        }
    }

    /// Both probes at once, recorded as a row of the table; bounds checked.
    pub(crate) async fn probe_after(
        &mut self,
        fault: &str,
        detail: String,
        began: Instant,
        ended: Instant,
    ) {
        if let Err(e) = self.api_ready(Duration::from_secs(60)).await {
            self.violations.push(format!("after {fault}: {e}"));
        }
        let mut detail = detail;
        match self.api_writes(Duration::from_secs(60)).await {
            Ok(took) if took > Duration::from_secs(1) => {
                detail = format!("{detail}; writes {}s after /readyz", secs(took));
            }
            Ok(_) => {}
            Err(e) => self.violations.push(format!("after {fault}: {e}")),
        }
        // Once writes land, a leader renews within its retry period (0.5 s); one that lost its
        // term takes the Lease back at its next try (the Lease names its own pod), or a standby
        // takes it once it lapses (3 s): a bound of its own.
        let leader_bound = LEADER_LEASE + Duration::from_secs(1);
        match self.leader_renewing(Duration::from_secs(30)).await {
            Ok(took) => {
                if took > Duration::from_secs(1) {
                    detail = format!("{detail}; leader renewing {}s after", secs(took));
                }
                if took > leader_bound {
                    self.violations.push(format!(
                        "after {fault}: a controller leader renewed its Lease {} s after the API \
                         server accepted writes again, bound {} s (leader Lease + 1 s)",
                        secs(took),
                        leader_bound.as_secs()
                    ));
                }
            }
            Err(e) => self.violations.push(format!("after {fault}: {e}")),
        }
        self.probes += 1;
        let n = self.probes;
        let probe = format!("probe-d-{n}");
        let (dispatch, expiry) =
            tokio::join!(self.dispatch_probe(&probe, ended), self.expiry_probe(n));
        let mut fig = Figure {
            fault: fault.to_string(),
            detail,
            lasted: ended - began,
            recover: None,
            dispatch: None,
            during: self.during.take(),
            expiry: None,
        };
        let ld = Duration::from_secs(LEASE_SECONDS as u64);
        match dispatch {
            Ok((d, r)) => {
                fig.dispatch = Some(d);
                fig.recover = Some(r);
                if d > DISPATCH_BOUND {
                    self.violations.push(format!(
                        "after {fault}: dispatch took {} ms, bound {} ms (probe-d-{n}: create -> \
                         claimed by a worker waiting in a long poll)",
                        d.as_millis(),
                        DISPATCH_BOUND.as_millis()
                    ));
                }
            }
            Err(e) => self
                .violations
                .push(format!("after {fault}: dispatch probe probe-d-{n}: {e}")),
        }
        match expiry {
            Ok(e) => {
                fig.expiry = Some(e);
                if e > ld + EXPIRY_SLACK {
                    self.violations.push(format!(
                        "after {fault}: expiry took {} s, bound {} s = leaseDurationSeconds + {} s \
                         (probe-e-{n}: last renewTime of the killed holder -> requeue seen)",
                        secs(e),
                        (ld + EXPIRY_SLACK).as_secs(),
                        EXPIRY_SLACK.as_secs()
                    ));
                }
            }
            Err(e) => self
                .violations
                .push(format!("after {fault}: expiry probe probe-e-{n}: {e}")),
        }
        self.log(&format!(
            "{fault} ({}): lasted {}s, recover {}s, dispatch {} ms (during it {} ms), expiry {}s",
            fig.detail,
            secs(fig.lasted),
            opt_s(fig.recover),
            opt_ms(fig.dispatch),
            opt_ms(fig.during),
            opt_s(fig.expiry)
        ));
        self.figures.push(fig);
    }
}

/// Makes `call` (a holder's call with its token) until it is answered 200, repeating it while
/// it is answered 503 and the lease ([`LEASE_SECONDS`], from now) lasts, as a worker does:
/// 503 is the sidecar's transient answer, its API call ran out of its bound
/// (docs/protocol.md). Any other answer, or 503 past the lease, is the error, naming `what`.
async fn while_leased<F, A>(what: &str, mut call: F) -> Result<(), String>
where
    F: FnMut() -> A,
    A: std::future::Future<Output = (u16, Value)>,
{
    let lease_ends = Instant::now() + Duration::from_secs(LEASE_SECONDS as u64);
    loop {
        let (s, r) = call().await;
        if s == 200 {
            return Ok(());
        }
        if s != 503 || Instant::now() >= lease_ends {
            return Err(format!("{what} answered {s} {r}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
