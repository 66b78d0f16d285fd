//! The flags that several subcommands share or that group well: leader election, HTTP bounds,
//! the admission webhook's TLS.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use leasehold_controller::leader;

use super::{check_dns_label, seconds};
use crate::{http, tls};

/// Leader election among controller replicas (client-go's defaults: 15 s, 10 s, 2 s).
#[derive(clap::Args)]
pub struct ElectionArgs {
    /// Elect one leader among replicas; only the leader writes. `false` runs as the only writer.
    #[arg(long, env = "LEASEHOLD_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Namespace of the leader Lease (default: POD_NAMESPACE, else --namespace, else default).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_namespace: Option<String>,
    /// Name of the leader Lease.
    #[arg(long, default_value = "leasehold-controller")]
    pub leader_lease_name: String,
    /// Seconds a leader's Lease stays valid without renewal, for the standbys.
    #[arg(long, default_value_t = 15.0)]
    pub leader_lease_duration: f64,
    /// Seconds the leader keeps leading without a successful renewal (< lease duration).
    #[arg(long, default_value_t = 10.0)]
    pub leader_renew_deadline: f64,
    /// Seconds between the leader's renewals and a standby's tries.
    #[arg(long, default_value_t = 2.0)]
    pub leader_retry_period: f64,
}

/// Bounds on what an HTTP client can make a server wait for (see `leasehold::http`).
#[derive(clap::Args)]
pub struct HttpArgs {
    /// Seconds a client may take to send a request's headers, and may leave a keep-alive
    /// connection idle; then the connection is closed.
    #[arg(long, env = "LEASEHOLD_HEADER_TIMEOUT", default_value_t = http::DEFAULT_HEADER_TIMEOUT.as_secs_f64())]
    pub header_timeout: f64,
    /// Seconds a client may take to send a whole request body after its headers; then the
    /// request is answered 408.
    #[arg(long, env = "LEASEHOLD_BODY_TIMEOUT", default_value_t = http::DEFAULT_BODY_TIMEOUT.as_secs_f64())]
    pub body_timeout: f64,
}

impl HttpArgs {
    /// The bounds, checked.
    pub fn limits(&self) -> anyhow::Result<http::Limits> {
        Ok(http::Limits {
            header_timeout: seconds("--header-timeout", self.header_timeout)?,
            body_timeout: seconds("--body-timeout", self.body_timeout)?,
            ..http::Limits::default()
        })
    }
}

/// The admission webhook that refuses LeasedJobs too large to store (see
/// `leasehold::admission`). Off unless --admission-listen is given.
#[derive(clap::Args)]
pub struct AdmissionArgs {
    /// Serve the validating admission webhook (HTTPS, path /validate/leasedjobs) on this
    /// address. Needs --admission-cert and --admission-key.
    #[arg(long, env = "LEASEHOLD_ADMISSION_LISTEN", value_name = "ADDR", requires_all = ["admission_cert", "admission_key"])]
    pub admission_listen: Option<SocketAddr>,
    /// PEM file of the webhook's serving certificate (its chain after it); read again
    /// whenever it changes, so a rotated Secret needs no restart.
    #[arg(
        long,
        env = "LEASEHOLD_ADMISSION_CERT",
        value_name = "FILE",
        requires = "admission_listen"
    )]
    pub admission_cert: Option<PathBuf>,
    /// PEM file of the certificate's private key (PKCS#8, PKCS#1 or SEC1); read again whenever
    /// it changes.
    #[arg(
        long,
        env = "LEASEHOLD_ADMISSION_KEY",
        value_name = "FILE",
        requires = "admission_listen"
    )]
    pub admission_key: Option<PathBuf>,
    /// Also serve the sidecar injection webhook (path /mutate/pods), adding the sidecar this
    /// JSON template describes to pods annotated `leasehold.dev/queue` (see
    /// `leasehold::inject`). Read once at start.
    #[arg(
        long,
        env = "LEASEHOLD_INJECT_SIDECAR",
        value_name = "FILE",
        requires = "admission_listen"
    )]
    pub inject_sidecar: Option<PathBuf>,
}

/// The admission server's configuration: its address, TLS, and the injection template when
/// injection is on.
pub struct Admission {
    /// Where to listen.
    pub addr: SocketAddr,
    /// The serving certificate.
    pub tls: Arc<rustls::ServerConfig>,
    /// The sidecar to inject, with `--inject-sidecar`.
    pub injection: Option<Arc<crate::inject::Sidecar>>,
}

impl AdmissionArgs {
    /// The admission server's configuration, checked, when it is on.
    pub fn config(&self) -> anyhow::Result<Option<Admission>> {
        let (Some(addr), Some(cert), Some(key)) = (
            self.admission_listen,
            &self.admission_cert,
            &self.admission_key,
        ) else {
            return Ok(None);
        };
        let tls = tls::server_config(cert, key).context(
            "--admission-cert and --admission-key must name a PEM certificate and its key",
        )?;
        let injection = match &self.inject_sidecar {
            Some(path) => Some(Arc::new(
                crate::inject::Sidecar::load(path)
                    .with_context(|| format!("--inject-sidecar {}", path.display()))?,
            )),
            None => None,
        };
        Ok(Some(Admission {
            addr,
            tls,
            injection,
        }))
    }
}

impl ElectionArgs {
    /// The election's configuration, checked; `None` with `--leader-elect false`.
    pub fn config(
        self,
        identity: &str,
        namespace: Option<&str>,
    ) -> anyhow::Result<Option<leader::ElectionConfig>> {
        if !self.leader_elect {
            return Ok(None);
        }
        let namespace = self
            .leader_namespace
            .or_else(|| namespace.map(str::to_string))
            .unwrap_or_else(|| "default".to_string());
        check_dns_label("--leader-namespace", &namespace)?;
        if !leasehold_core::crd::is_dns_subdomain(&self.leader_lease_name) {
            bail!(
                "--leader-lease-name {:?} is not a valid object name: a lowercase RFC 1123 subdomain of at most 253 characters",
                self.leader_lease_name
            );
        }
        let config = leader::ElectionConfig {
            namespace,
            lease_name: self.leader_lease_name,
            identity: identity.to_string(),
            lease_duration: seconds("--leader-lease-duration", self.leader_lease_duration)?,
            renew_deadline: seconds("--leader-renew-deadline", self.leader_renew_deadline)?,
            retry_period: seconds("--leader-retry-period", self.leader_retry_period)?,
        };
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(config))
    }
}
