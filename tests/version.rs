//! One version for every artefact (docs/versioning.md): `scripts/version --check` names a place
//! that disagrees with the workspace's version, and `--set` writes one version everywhere.

use std::path::Path;
use std::process::Command;

/// The files `scripts/version` reads, copied into a tree of their own.
const FILES: &[&str] = &[
    "scripts/version",
    "Cargo.toml",
    "CHANGELOG.md",
    "README.md",
    "clients/python/leasehold/__init__.py",
    "clients/typescript/package.json",
    "clients/typescript/package-lock.json",
    "clients/typescript/src/index.ts",
    "charts/leasehold/Chart.yaml",
    "docs/example-worker-manual.yaml",
    "docs/install.md",
    "docs/monitoring.md",
    "charts/leasehold/crds/leasedjob.yaml",
    "charts/leasehold/crds/leasedqueue.yaml",
];

/// A directory of its own under the temporary directory, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("leasehold-version.{}.{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn copy_tree(to: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in FILES {
        let target = to.join(file);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(root.join(file), &target).unwrap();
    }
}

fn version(tree: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(tree.join("scripts/version"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn the_version_is_the_same_everywhere_and_a_place_that_differs_is_named() {
    let tree = Scratch::new();
    copy_tree(tree.path());
    let (ok, out) = version(tree.path(), &["--check"]);
    assert!(ok, "{out}");
    let (_, current) = version(tree.path(), &[]);
    let current = current.trim().to_string();
    // The chart says another version: named, with both versions.
    let chart = tree.path().join("charts/leasehold/Chart.yaml");
    let text = std::fs::read_to_string(&chart).unwrap();
    std::fs::write(
        &chart,
        text.replace(&format!("version: {current}\n"), "version: 9.9.9\n"),
    )
    .unwrap();
    let (ok, out) = version(tree.path(), &["--check"]);
    assert!(!ok, "a different chart version passed: {out}");
    assert!(
        out.contains("charts/leasehold/Chart.yaml: the chart's version is 9.9.9")
            && out.contains(&current),
        "{out}"
    );
    // --set writes one version everywhere; a version that is not SemVer is refused.
    let (ok, out) = version(tree.path(), &["--set", "0.2.0-rc.1"]);
    assert!(ok, "{out}");
    let (ok, out) = version(tree.path(), &["--check"]);
    assert!(ok, "{out}");
    assert_eq!(version(tree.path(), &[]).1.trim(), "0.2.0-rc.1");
    let text = std::fs::read_to_string(&chart).unwrap();
    assert!(text.contains("appVersion: \"0.2.0-rc.1\""), "{text}");
    let (ok, out) = version(tree.path(), &["--set", "1.2"]);
    assert!(!ok && out.contains("not X.Y.Z"), "{out}");
}

/// The Python package carries the repository's license text (its `license-files`), the same.
#[test]
fn the_python_package_carries_the_repositorys_license() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ours = std::fs::read(root.join("LICENSE")).unwrap();
    let packaged = std::fs::read(root.join("clients/python/LICENSE")).unwrap();
    assert!(
        ours == packaged,
        "clients/python/LICENSE differs from LICENSE: copy it again (cp LICENSE clients/python/LICENSE)"
    );
}
