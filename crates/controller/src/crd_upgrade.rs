//! Installing and upgrading leasehold's CustomResourceDefinitions from the binary's own
//! definitions (`leasehold crd --apply`; the chart runs it as a pre-upgrade hook Job), so that
//! `helm upgrade` needs no manual `kubectl apply` of the CRDs.
//!
//! The rule, per CRD: one made by a newer release (its [`VERSION_ANNOTATION`] names a later
//! SemVer version than this binary's) is left alone, so that running an older release's job
//! (a downgrade, a stale hook) never takes a field, a version or a storage change away from
//! stored objects; a CRD without that annotation (made before it existed, or by hand) is
//! newer when it declares anything this binary's lacks (a version, a field, an unpruned value,
//! a selectable field: [`crate::crd_check::missing`] the other way round). Otherwise the binary's
//! definition is applied with server-side apply (field manager [`FIELD_MANAGER`], forcing
//! conflicts: the fields were owned by Helm or an earlier apply), whatever it adds or
//! removes, and the call waits until the API server has accepted its names and serves every
//! version in discovery.

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use thiserror::Error;

use crate::crd_check::{missing, Missing};
use leasehold_core::crd::VERSION_ANNOTATION;
use leasehold_kube::api::is_status;

/// The field manager of the applies.
pub const FIELD_MANAGER: &str = "leasehold-crd";

/// How long [`apply`] waits for the API server to establish an applied CRD.
pub const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(60);

/// What [`apply`] did with one CRD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It was not installed; now it is.
    Created,
    /// It lacked these; now it has them.
    Upgraded(Vec<Missing>),
    /// It had everything; applied again (descriptions, printer columns).
    Current,
    /// It declares these, which this binary's lacks: left as it was.
    Newer(Vec<Missing>),
    /// A newer release (this version) made it: left as it was.
    NewerRelease(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |items: &[Missing]| {
            items
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Outcome::Created => write!(f, "created"),
            Outcome::Upgraded(added) => write!(f, "upgraded: added {}", list(added)),
            Outcome::Current => write!(f, "already current; applied again"),
            Outcome::NewerRelease(version) => write!(
                f,
                "left as it is: leasehold {version} made it, newer than this leasehold {}",
                env!("CARGO_PKG_VERSION")
            ),
            Outcome::Newer(extra) => write!(
                f,
                "left as it is: it is newer than leasehold {} (it has {}, which this version lacks)",
                env!("CARGO_PKG_VERSION"),
                list(extra)
            ),
        }
    }
}

/// Why a CRD could not be applied.
#[derive(Debug, Error)]
pub enum CrdUpgradeError {
    /// The credentials may not read or write CRDs.
    #[error("not allowed to read or apply the CustomResourceDefinition {name}: the credentials need get, create and patch on customresourcedefinitions (apiextensions.k8s.io)")]
    Forbidden {
        /// The CRD's name.
        name: String,
    },
    /// The API server refused or failed.
    #[error("applying the CustomResourceDefinition {name} failed")]
    Api {
        /// The CRD's name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// Applied, but not established in time.
    #[error("the CustomResourceDefinition {name} was applied but is not Established with versions {versions} after {seconds} s")]
    NotEstablished {
        /// The CRD's name.
        name: String,
        /// The versions it should serve.
        versions: String,
        /// How long it was waited for.
        seconds: u64,
    },
}

/// The decision for a CRD, from the binary's definition and the installed one: pure.
pub fn decide(
    binary: &CustomResourceDefinition,
    installed: Option<&CustomResourceDefinition>,
) -> Outcome {
    let Some(installed) = installed else {
        return Outcome::Created;
    };
    let stamp = |crd: &CustomResourceDefinition| {
        crd.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VERSION_ANNOTATION))
            .and_then(|v| SemVer::parse(v).map(|parsed| (v.clone(), parsed)))
    };
    let added = missing(binary, installed);
    let applied = if added.is_empty() {
        Outcome::Current
    } else {
        Outcome::Upgraded(added)
    };
    if let (Some((text, theirs)), Some((_, ours))) = (stamp(installed), stamp(binary)) {
        return if theirs > ours {
            Outcome::NewerRelease(text)
        } else {
            applied
        };
    }
    // Versions no longer served are history the binary need not know.
    let mut served = installed.clone();
    served.spec.versions.retain(|v| v.served);
    let extra = missing(&served, binary);
    if extra.is_empty() {
        applied
    } else {
        Outcome::Newer(extra)
    }
}

/// A SemVer 2.0.0 version, ordered by its precedence rules (build metadata ignored; a
/// pre-release sorts before its release; pre-release identifiers are compared as one string,
/// which is exact for leasehold's `-rc.N` with N below 10).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct SemVer {
    core: (u64, u64, u64),
    /// False for a pre-release, which sorts before the release.
    release: bool,
    pre: String,
}

impl SemVer {
    fn parse(text: &str) -> Option<SemVer> {
        let text = text.split('+').next()?;
        let (core, pre) = match text.split_once('-') {
            Some((core, pre)) => (core, Some(pre)),
            None => (text, None),
        };
        let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
        let version = (parts.next()??, parts.next()??, parts.next()??);
        if parts.next().is_some() {
            return None;
        }
        Some(SemVer {
            core: version,
            release: pre.is_none(),
            pre: pre.unwrap_or_default().to_string(),
        })
    }
}

/// Applies `binary` (a CRD this binary defines) unless the installed one is newer, then waits
/// until it is established; returns what was done.
///
/// # Errors
/// [`CrdUpgradeError`] naming the CRD.
pub async fn apply(
    client: &Client,
    binary: &CustomResourceDefinition,
) -> Result<Outcome, CrdUpgradeError> {
    let name = binary.metadata.name.clone().unwrap_or_default();
    let failed = |source: kube::Error| {
        if is_status(&source, 403) {
            CrdUpgradeError::Forbidden { name: name.clone() }
        } else {
            CrdUpgradeError::Api {
                name: name.clone(),
                source,
            }
        }
    };
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let installed = api.get_opt(&name).await.map_err(failed)?;
    let outcome = decide(binary, installed.as_ref());
    if matches!(outcome, Outcome::Newer(_) | Outcome::NewerRelease(_)) {
        return Ok(outcome);
    }
    let mut body = binary.clone();
    body.metadata.managed_fields = None;
    body.metadata.resource_version = None;
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(failed)?;
    let versions: Vec<String> = binary
        .spec
        .versions
        .iter()
        .filter(|v| v.served)
        .map(|v| v.name.clone())
        .collect();
    let start = tokio::time::Instant::now();
    loop {
        let crd = api.get(&name).await.map_err(failed)?;
        if accepted(&crd) && served(client, &crd, &versions).await {
            return Ok(outcome);
        }
        if start.elapsed() > ESTABLISH_TIMEOUT {
            return Err(CrdUpgradeError::NotEstablished {
                name,
                versions: versions.join(", "),
                seconds: ESTABLISH_TIMEOUT.as_secs(),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Whether the API server accepted `crd`'s names and established it (its conditions
/// `NamesAccepted` and `Established` are True).
fn accepted(crd: &CustomResourceDefinition) -> bool {
    let conditions = crd.status.as_ref().and_then(|s| s.conditions.as_ref());
    let is_true = |kind: &str| {
        conditions
            .into_iter()
            .flatten()
            .any(|c| c.type_ == kind && c.status == "True")
    };
    is_true("NamesAccepted") && is_true("Established")
}

/// Whether discovery lists `crd`'s resource in each of `versions`: the API server serves
/// them (a condition set before the apply may still be True while handlers are replaced).
async fn served(client: &Client, crd: &CustomResourceDefinition, versions: &[String]) -> bool {
    for version in versions {
        let group_version = format!("{}/{version}", crd.spec.group);
        match client.list_api_group_resources(&group_version).await {
            Ok(list)
                if list
                    .resources
                    .iter()
                    .any(|r| r.name == crd.spec.names.plural) => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::crd::{definition, BETA_VERSION};

    #[test]
    fn an_older_crd_is_upgraded_a_newer_one_left_alone() {
        let binary = definition();
        assert_eq!(decide(&binary, None), Outcome::Created);
        assert_eq!(decide(&binary, Some(&binary)), Outcome::Current);

        let mut older = binary.clone();
        older.spec.versions.retain(|v| v.name != BETA_VERSION);
        assert_eq!(
            decide(&binary, Some(&older)),
            Outcome::Upgraded(vec![Missing::Version(BETA_VERSION.into())])
        );

        // Without the release stamps, by the fields: the installed CRD serves a version the
        // binary does not know, so it is newer.
        let unstamped = |crd: &CustomResourceDefinition| {
            let mut crd = crd.clone();
            crd.metadata.annotations = None;
            crd
        };
        let outcome = decide(&unstamped(&older), Some(&unstamped(&binary)));
        assert_eq!(
            outcome,
            Outcome::Newer(vec![Missing::Version(BETA_VERSION.into())])
        );
        assert!(
            outcome
                .to_string()
                .starts_with("left as it is: it is newer than leasehold"),
            "{outcome}"
        );
    }

    fn stamped(mut crd: CustomResourceDefinition, version: &str) -> CustomResourceDefinition {
        crd.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(VERSION_ANNOTATION.into(), version.into());
        crd
    }

    #[test]
    fn the_release_stamps_decide_when_both_crds_carry_one() {
        let ours = env!("CARGO_PKG_VERSION");
        let binary = definition();
        // A later release dropped a version: still newer, left alone.
        let mut later = stamped(binary.clone(), "99.0.0");
        later.spec.versions.retain(|v| v.name == BETA_VERSION);
        assert_eq!(
            decide(&binary, Some(&later)),
            Outcome::NewerRelease("99.0.0".into())
        );
        // An earlier release that served one more version: the binary's CRD replaces it.
        let mut earlier = stamped(binary.clone(), "0.0.1");
        let mut extra = earlier.spec.versions[0].clone();
        extra.name = "v1alpha0".into();
        extra.storage = false;
        earlier.spec.versions.push(extra);
        assert_eq!(decide(&binary, Some(&earlier)), Outcome::Current);
        assert_eq!(
            decide(&binary, Some(&stamped(binary.clone(), ours))),
            Outcome::Current
        );
    }

    #[test]
    fn semver_precedence() {
        let v = |t: &str| SemVer::parse(t).unwrap();
        assert!(v("0.2.0") > v("0.1.9"));
        assert!(v("1.0.0") > v("1.0.0-rc.1"));
        assert!(v("1.0.0-rc.2") > v("1.0.0-rc.1"));
        assert!(v("0.10.0") > v("0.9.0"));
        assert_eq!(v("1.2.3+build.5"), v("1.2.3"));
        for bad in ["1.2", "1.2.3.4", "v1.2.3", "x.y.z", ""] {
            assert!(SemVer::parse(bad).is_none(), "{bad}");
        }
    }
}
