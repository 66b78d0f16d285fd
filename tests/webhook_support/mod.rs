//! What the webhook tests share: a scratch directory and a CA with a serving certificate for
//! 127.0.0.1, made with the `openssl` CLI.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A directory of this test's own, emptied first.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Makes `<prefix>ca.crt`, and `<prefix>tls.crt` + `<prefix>tls.key` for IP 127.0.0.1 signed
/// by it (P-256 keys, valid for a day). Returns the CA's PEM.
pub fn make_certs(dir: &Path, prefix: &str) -> String {
    let (ca_key, ca_crt) = (format!("{prefix}ca.key"), format!("{prefix}ca.crt"));
    let (key, csr, crt) = (
        format!("{prefix}tls.key"),
        format!("{prefix}tls.csr"),
        format!("{prefix}tls.crt"),
    );
    let ext = format!("{prefix}ext.cnf");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &ca_key,
            "-out",
            &ca_crt,
            "-days",
            "1",
            "-subj",
            "/CN=leasehold-test-ca",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(
        dir.join(&ext),
        "subjectAltName = IP:127.0.0.1\nextendedKeyUsage = serverAuth\nbasicConstraints = CA:FALSE\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "1",
            "-extfile",
            &ext,
        ],
    );
    std::fs::read_to_string(dir.join(ca_crt)).unwrap()
}
