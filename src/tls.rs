//! A TLS server configuration whose certificate and key are read from PEM files and read again
//! whenever the files change, so that a rotated certificate is served without a restart.
//!
//! Kubernetes updates a Secret mounted as a volume in place: the kubelet writes the new files
//! into a fresh directory and swaps a symlink to it, within a minute or so of the Secret's
//! change. So at every handshake [`ReloadingCert`] looks at both files (one `stat` each,
//! following symlinks: microseconds, no read) and reads them again only when their
//! modification time, size, device or inode changed. A reload that fails (a half-written key,
//! a key that does not match the certificate) keeps the last good pair, is logged once as a
//! warning, and is tried again once the files change again.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use leasehold_core::Category;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use thiserror::Error;

/// Why a certificate and key could not be loaded.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The certificate file holds no PEM `CERTIFICATE` block, or a malformed one.
    #[error("{path} holds no PEM certificate (expected a `-----BEGIN CERTIFICATE-----` block, the serving certificate first)")]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// The key file holds no PEM private key (PKCS#8, PKCS#1 RSA or SEC1 EC), or a malformed one.
    #[error("{path} holds no PEM private key (expected `-----BEGIN PRIVATE KEY-----`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`)")]
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// The key is of a kind rustls cannot sign with, or does not belong to the certificate.
    #[error("the key in {key} cannot serve the certificate in {cert}")]
    Unusable {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason (e.g. the public keys do not match).
        source: rustls::Error,
    },
}

impl Category for TlsError {
    /// Stable category, for logs.
    fn category(&self) -> &'static str {
        match self {
            TlsError::Read { .. } => "unreadable",
            TlsError::NoCertificate { .. } | TlsError::NoKey { .. } => "invalid_pem",
            TlsError::Unusable { .. } => "unusable_key",
        }
    }
}

/// A server configuration for HTTP/1.1 over TLS 1.2 or 1.3 (ring), serving the certificate
/// chain in the PEM file `cert` (serving certificate first) with the private key in the PEM
/// file `key`, both read again whenever they change (see the module's documentation).
///
/// # Errors
/// [`TlsError`] when the files cannot be read, hold no certificate or key, or the key does not
/// match the certificate: checked here, so that a bad flag fails at start-up rather than at
/// the first handshake.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let resolver = ReloadingCert::new(cert, key, Arc::clone(&provider))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring's default provider supports the default protocol versions")
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The certificate and key of two PEM files, read again at a handshake after either changed.
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The pair served.
    current: Arc<CertifiedKey>,
    /// The files' stamps when `current` was read, or when a reload last failed (so that a bad
    /// pair is reported once, not at every handshake).
    seen: Option<Stamps>,
}

/// What identifies a version of a file without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    dev: u64,
    ino: u64,
}

impl From<&Metadata> for Stamp {
    fn from(m: &Metadata) -> Stamp {
        Stamp {
            modified: m.modified().ok(),
            len: m.len(),
            dev: m.dev(),
            ino: m.ino(),
        }
    }
}

type Stamps = (Stamp, Stamp);

impl ReloadingCert {
    /// Reads both files now.
    ///
    /// # Errors
    /// As [`server_config`].
    pub fn new(cert: &Path, key: &Path, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let seen = stamps(cert, key);
        let current = Arc::new(load(cert, key, &provider)?);
        Ok(ReloadingCert {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            state: Mutex::new(State { current, seen }),
        })
    }

    /// The pair to serve now: the last one read, after reading the files again if they changed
    /// since.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let now = stamps(&self.cert, &self.key);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // A file that cannot be looked at (removed for a moment during an update) keeps the
        // last pair; it is read again once both are back.
        if now.is_some() && now != state.seen {
            state.seen = now;
            match load(&self.cert, &self.key, &self.provider) {
                Ok(pair) => {
                    state.current = Arc::new(pair);
                    tracing::info!(cert = %self.cert.display(), "Loaded the rotated TLS certificate from {}", self.cert.display());
                }
                Err(e) => {
                    tracing::warn!(category = e.category(), error = %leasehold_kube::api::error_chain(&e), "Kept the previous TLS certificate: the changed files cannot be used");
                }
            }
        }
        Arc::clone(&state.current)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn stamps(cert: &Path, key: &Path) -> Option<Stamps> {
    let cert = std::fs::metadata(cert).ok()?;
    let key = std::fs::metadata(key).ok()?;
    Some(((&cert).into(), (&key).into()))
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn load(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, TlsError> {
    let no_certificate = || TlsError::NoCertificate {
        path: cert.to_path_buf(),
    };
    let chain = CertificateDer::pem_slice_iter(&read(cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| no_certificate())?;
    if chain.is_empty() {
        return Err(no_certificate());
    }
    let private_key = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|_| TlsError::NoKey {
        path: key.to_path_buf(),
    })?;
    CertifiedKey::from_der(chain, private_key, provider).map_err(|source| TlsError::Unusable {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_without_pem_blocks_are_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("leasehold-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert, "not a certificate").unwrap();
        std::fs::write(&key, "not a key").unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let e = ReloadingCert::new(&cert, &key, Arc::clone(&provider)).unwrap_err();
        assert!(matches!(e, TlsError::NoCertificate { .. }), "{e}");
        assert!(e.to_string().contains("tls.crt"), "{e}");
        let e = ReloadingCert::new(&dir.join("missing.crt"), &key, provider).unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
