//! Claim writes and their 409s, counted from the API server's requests
//! (`apiserver_request_total`): the conflict shares of rows 2, 2b, 2bk, 2d and 2k (each run's
//! and each part's in bench/src/claims.rs, each N's in bench/src/paired.rs) and of row 11
//! (bench/src/fleet.rs).

use crate::metrics::{Key, Requests};

/// True for a status replace: PUT on leasedjobs/status, a claim or a holder's completion (a
/// holder ends its attempt with a PUT under its snapshot's resourceVersion first;
/// docs/protocol.md).
pub fn is_status_put(k: &Key) -> bool {
    k.resource == "leasedjobs" && k.subresource == "status" && k.verb == "PUT"
}

/// Claim writes, and those answered 409, among `requests` of a window in which `completed`
/// jobs were completed: every status PUT but one per completed job (its completion). Every 409
/// is counted as a claim's: a completion refused for a stale snapshot is counted so too. In a
/// window whose status PUTs are claims and completions only (rows 2, 2b, 2bk, 2d, 2k) the share
/// so errs high, never low; where the controller writes initial statuses in the window (row 11), those
/// PUTs count as claim writes too, and the share errs low by them.
pub fn claim_writes(requests: &Requests, completed: f64) -> (f64, f64) {
    let puts = requests.sum(is_status_put);
    let conflicts = requests.sum(|k| is_status_put(k) && k.code == "409");
    ((puts - completed).max(conflicts), conflicts)
}

/// Claim writes, and those answered 409, among `requests` of one part of a run in which
/// `landed` claims were answered with the job (counted by the claimers): the landed claims and
/// every status PUT answered 409 (each counted as a claim's, as in [`claim_writes`]). A part's
/// marks are scraped between jobs, so a claim or completion in flight at a mark may fall on
/// either side of it; counting the claims that landed, rather than taking the part's
/// completions from its PUTs, keeps that from making a part's writes fewer than its 409s.
pub fn part_claim_writes(requests: &Requests, landed: f64) -> (f64, f64) {
    let conflicts = requests.sum(|k| is_status_put(k) && k.code == "409");
    (landed + conflicts, conflicts)
}

/// `conflicts / writes`, or 0 without writes.
pub fn share((writes, conflicts): (f64, f64)) -> f64 {
    if writes > 0.0 {
        conflicts / writes
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_puts(ok: u32, conflicts: u32) -> Requests {
        let line = |code: &str, n: u32| {
            format!(
                "apiserver_request_total{{code=\"{code}\",group=\"leasehold.dev\",resource=\"leasedjobs\",scope=\"resource\",subresource=\"status\",verb=\"PUT\",version=\"v1alpha1\"}} {n}\n"
            )
        };
        Requests::parse(&(line("200", ok) + &line("409", conflicts)))
    }

    #[test]
    fn a_run_counts_its_claims_as_its_status_puts_but_one_per_completion() {
        // 100 jobs: 100 claims and 100 completions landed, 2 claims refused.
        let (writes, conflicts) = claim_writes(&status_puts(200, 2), 100.0);
        assert_eq!((writes, conflicts), (102.0, 2.0));
        assert!((share((writes, conflicts)) - 2.0 / 102.0).abs() < 1e-12);
    }

    #[test]
    fn a_part_counts_its_landed_claims_not_its_puts_less_its_completions() {
        // The last part of a run: 3 claims landed and 1 was refused in it, while 8 jobs were
        // completed whose 8 completions were not all counted in it (a mark falls while some
        // are in flight): 7 of them, and the 3 claims, make 10 PUTs answered 200.
        let part = status_puts(10, 1);
        // Taking the part's completions from its PUTs: 11 - 8 = 3 writes for 4 claim writes
        // sent, a third of them 409.
        assert_eq!(share(claim_writes(&part, 8.0)), 1.0 / 3.0);
        // Counting the claims that landed: 4 claim writes, 1 of them 409.
        assert_eq!(part_claim_writes(&part, 3.0), (4.0, 1.0));
        assert_eq!(share(part_claim_writes(&part, 3.0)), 0.25);
        // Had 11 completions been counted in the part (read after its scrape, while some of
        // their PUTs fell in the next part), the old count fell under its 409s and was floored
        // to them: 100 %. The landed claims do not depend on the completions.
        assert_eq!(share(claim_writes(&part, 11.0)), 1.0);
        assert_eq!(share(part_claim_writes(&part, 3.0)), 0.25);
    }
}
