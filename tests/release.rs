//! The release (`scripts/release`, docs/install.md "Releases"): run on this clone into a
//! scratch directory, every artefact it makes is checked for what it claims to be. The binary
//! archives hold a static executable of their architecture (its ELF header), LICENSE and
//! README.md, and each binary that can run here (the host's; arm64's under qemu-user-static)
//! prints the version and the committed CRDs; SHA256SUMS covers every file and
//! verifies; the images are of their architecture and the multi-arch archive is an OCI image
//! index of both; helm renders the packaged chart at the version; the wheel installs and
//! imports at the version and is typed; the npm tarball is the version's build; the krew
//! manifest names both archives with their sha256. And a tree with uncommitted changes is
//! refused.
//!
//! It runs under `scripts/test` (which provides helm and a Python venv: LEASEHOLD_HELM and
//! LEASEHOLD_PYTHON), and is skipped without them. By default it builds both architectures;
//! LEASEHOLD_RELEASE_SMOKE=1 runs `scripts/release --smoke` (the host's architecture only).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;
use sha2::{Digest, Sha256};

/// A directory of its own under the temporary directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Scratch {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "leasehold-release-{what}.{}.{nanos}",
            std::process::id()
        ));
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

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `program args` in `dir`; panics with its output unless it succeeds; returns stdout.
fn run(dir: &Path, program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> String {
    let program = program.as_ref();
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", program.to_string_lossy()));
    assert!(
        out.status.success(),
        "{} {} failed:\n{}",
        program.to_string_lossy(),
        args.join(" "),
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn version() -> String {
    run(root(), root().join("scripts/version"), &[])
        .trim()
        .to_string()
}

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Every file under `dir`, as paths relative to it.
fn files_under(dir: &Path) -> BTreeSet<String> {
    fn walk(base: &Path, dir: &Path, into: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(base, &path, into);
            } else {
                let rel = path.strip_prefix(base).unwrap();
                into.insert(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut files = BTreeSet::new();
    walk(dir, dir, &mut files);
    files
}

/// The ELF facts a release binary is judged by: its machine, and whether it asks for a
/// program interpreter (a dynamically linked executable does; a static one, even static-pie,
/// does not).
struct Elf {
    machine: u16,
    interpreter: bool,
}

fn elf(path: &Path) -> Elf {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..4], b"\x7fELF", "{} is not ELF", path.display());
    assert_eq!(b[4], 2, "{} is not a 64-bit ELF", path.display());
    assert_eq!(b[5], 1, "{} is not little-endian", path.display());
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let (phoff, phentsize, phnum) = (u64_at(32) as usize, u16_at(54) as usize, u16_at(56));
    const PT_INTERP: u32 = 3;
    let interpreter = (0..phnum as usize).any(|i| u32_at(phoff + i * phentsize) == PT_INTERP);
    Elf {
        machine: u16_at(18),
        interpreter,
    }
}

/// qemu for `arch`'s binaries on this host, when installed.
fn qemu(arch: &str) -> Option<PathBuf> {
    let name = match arch {
        "arm64" => "aarch64",
        _ => "x86_64",
    };
    [format!("qemu-{name}-static"), format!("qemu-{name}")]
        .iter()
        .flat_map(|n| ["/usr/bin", "/usr/local/bin"].map(|d| Path::new(d).join(n)))
        .find(|p| p.exists())
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => panic!("no release for host architecture {other}"),
    }
}

/// The image config (its JSON) of the single image in a docker-archive.
fn docker_archive_config(archive: &Path, scratch: &Path) -> (Vec<String>, Value) {
    let dir = scratch.join(archive.file_stem().unwrap());
    std::fs::create_dir_all(&dir).unwrap();
    run(&dir, "tar", &["-xf", archive.to_str().unwrap()]);
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let image = &manifest.as_array().expect("manifest.json is a list")[0];
    let tags = image["RepoTags"]
        .as_array()
        .map(|t| t.iter().map(|t| t.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    let config = dir.join(image["Config"].as_str().unwrap());
    let config = serde_json::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
    (tags, config)
}

fn blob(oci: &Path, digest: &str) -> Value {
    let path = oci
        .join("blobs/sha256")
        .join(digest.strip_prefix("sha256:").unwrap());
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `scripts/release --out DIR` on this clone (its working tree as it is, committed or not:
/// --allow-dirty) makes every artefact of the version, each what it claims to be.
#[test]
fn release_builds_every_artefact_of_the_version() {
    let (Some(helm), Some(python)) = (
        std::env::var_os("LEASEHOLD_HELM"),
        std::env::var_os("LEASEHOLD_PYTHON"),
    ) else {
        eprintln!(
            "SKIPPED the release test: LEASEHOLD_HELM and LEASEHOLD_PYTHON are unset \
             (`scripts/test --test release` sets them)"
        );
        return;
    };
    let smoke = std::env::var("LEASEHOLD_RELEASE_SMOKE").is_ok_and(|v| v == "1");
    let version = version();
    let scratch = Scratch::new("out");
    let out_dir = scratch.path().join("dist");
    let mut args = vec!["--out", out_dir.to_str().unwrap(), "--allow-dirty"];
    if smoke {
        args.push("--smoke");
    }
    let started = std::time::Instant::now();
    let out = Command::new(root().join("scripts/release"))
        .args(&args)
        .current_dir(root())
        .stdin(Stdio::null())
        .output()
        .expect("scripts/release");
    let said = text(&out);
    println!(
        "scripts/release {} took {:.0?}:\n{said}",
        args.join(" "),
        started.elapsed()
    );
    assert!(out.status.success(), "scripts/release failed:\n{said}");

    let archs: Vec<&str> = if smoke {
        vec![host_arch()]
    } else {
        vec!["amd64", "arm64"]
    };
    let mut expected: BTreeSet<String> = [
        format!("leasehold-{version}.tgz"),
        format!("leasehold-{version}.tar.gz"),
        format!("leasehold-{version}-py3-none-any.whl"),
        format!("leasehold-{version}-npm.tgz"),
        "krew/leasehold.yaml".to_string(),
        "SHA256SUMS".to_string(),
    ]
    .into();
    for arch in &archs {
        expected.insert(format!("leasehold-{version}-linux-{arch}.tar.gz"));
        expected.insert(format!("leasehold-{version}-image-{arch}.tar"));
    }
    if archs.len() > 1 {
        expected.insert(format!("leasehold-{version}-image.oci.tar"));
    }
    let made = files_under(&out_dir);
    assert_eq!(made, expected, "the files scripts/release made");

    // SHA256SUMS: every other file, and each sum right.
    let sums = std::fs::read_to_string(out_dir.join("SHA256SUMS")).unwrap();
    let listed: BTreeSet<String> = sums
        .lines()
        .map(|l| {
            l.split_once("  ")
                .expect("sha256sum's format")
                .1
                .to_string()
        })
        .collect();
    let mut others = expected.clone();
    others.remove("SHA256SUMS");
    assert_eq!(listed, others, "the files SHA256SUMS covers");
    run(&out_dir, "sha256sum", &["--strict", "-c", "SHA256SUMS"]);
    for line in sums.lines() {
        let (sum, name) = line.split_once("  ").unwrap();
        assert!(
            said.contains(name) && said.contains(sum),
            "the summary lacks {name}"
        );
    }

    // The binary archives: leasehold, LICENSE and README.md; a static executable of the
    // archive's architecture that says the version.
    let license = std::fs::read(root().join("LICENSE")).unwrap();
    let readme = std::fs::read(root().join("README.md")).unwrap();
    for arch in &archs {
        let tarball = out_dir.join(format!("leasehold-{version}-linux-{arch}.tar.gz"));
        let dir = scratch.path().join(format!("unpacked-{arch}"));
        std::fs::create_dir_all(&dir).unwrap();
        run(&dir, "tar", &["-xzf", tarball.to_str().unwrap()]);
        let unpacked = files_under(&dir);
        assert_eq!(
            unpacked,
            ["LICENSE", "README.md", "leasehold"]
                .map(String::from)
                .into(),
            "{arch} archive"
        );
        assert!(std::fs::read(dir.join("LICENSE")).unwrap() == license);
        assert!(std::fs::read(dir.join("README.md")).unwrap() == readme);
        let binary = dir.join("leasehold");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&binary).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755, "{arch} binary's mode");
        let header = elf(&binary);
        let (machine, file_says) = match *arch {
            "amd64" => (62, "x86-64"),
            _ => (183, "ARM aarch64"),
        };
        assert_eq!(header.machine, machine, "{arch} binary's e_machine");
        assert!(
            !header.interpreter,
            "the {arch} binary asks for a program interpreter"
        );
        let file = run(&dir, "file", &["-b", "leasehold"]);
        assert!(
            file.contains(file_says) && file.contains("static"),
            "file says of the {arch} binary: {file}"
        );
        let runner = if *arch == host_arch() {
            None
        } else {
            match qemu(arch) {
                Some(q) => Some(q),
                None => {
                    eprintln!("the {arch} binary not run: no qemu-user-static here");
                    continue;
                }
            }
        };
        let said = match &runner {
            None => run(&dir, &binary, &["--version"]),
            Some(q) => run(&dir, q, &[binary.to_str().unwrap(), "--version"]),
        };
        assert_eq!(
            said.trim(),
            format!("leasehold {version}"),
            "{arch} --version"
        );
        // More of it than argument parsing: the CRDs it generates are the committed ones.
        let crds = match &runner {
            None => run(&dir, &binary, &["crd"]),
            Some(q) => run(&dir, q, &[binary.to_str().unwrap(), "crd"]),
        };
        assert!(
            crds == leasehold_testkit::committed_crds(),
            "`crd` of the {arch} binary differs from charts/leasehold/crds/"
        );
    }

    // The images: a docker-archive per architecture, tagged and of that platform.
    for arch in &archs {
        let archive = out_dir.join(format!("leasehold-{version}-image-{arch}.tar"));
        let (tags, config) = docker_archive_config(&archive, scratch.path());
        assert!(
            tags.iter().any(|t| t.starts_with("localhost/leasehold:")),
            "{arch} image tags: {tags:?}"
        );
        assert_eq!(config["architecture"], *arch, "{arch} image");
        assert_eq!(config["os"], "linux", "{arch} image");
        assert_eq!(config["config"]["User"], "65532:65532", "{arch} image");
        assert_eq!(
            config["config"]["Entrypoint"],
            serde_json::json!(["/usr/local/bin/leasehold"]),
            "{arch} image"
        );
    }
    if archs.len() > 1 {
        let archive = out_dir.join(format!("leasehold-{version}-image.oci.tar"));
        let oci = scratch.path().join("oci");
        std::fs::create_dir_all(&oci).unwrap();
        run(&oci, "tar", &["-xf", archive.to_str().unwrap()]);
        let index: Value =
            serde_json::from_str(&std::fs::read_to_string(oci.join("index.json")).unwrap())
                .unwrap();
        let top = &index["manifests"][0];
        assert_eq!(
            top["mediaType"], "application/vnd.oci.image.index.v1+json",
            "{index}"
        );
        let list = blob(&oci, top["digest"].as_str().unwrap());
        let mut platforms: Vec<String> = Vec::new();
        for m in list["manifests"].as_array().unwrap() {
            let arch = m["platform"]["architecture"].as_str().unwrap();
            let manifest = blob(&oci, m["digest"].as_str().unwrap());
            let config = blob(&oci, manifest["config"]["digest"].as_str().unwrap());
            assert_eq!(config["architecture"], arch, "the index's {arch} image");
            platforms.push(format!("{}/{arch}", m["platform"]["os"].as_str().unwrap()));
        }
        platforms.sort();
        assert_eq!(platforms, ["linux/amd64", "linux/arm64"], "{list}");
    }

    // The chart: packaged at the version, and helm renders it with the version's image.
    let chart = out_dir.join(format!("leasehold-{version}.tgz"));
    let chart_yaml = run(
        scratch.path(),
        "tar",
        &["-xzOf", chart.to_str().unwrap(), "leasehold/Chart.yaml"],
    );
    let chart_meta: serde_yaml::Value = serde_yaml::from_str(&chart_yaml).unwrap();
    assert_eq!(chart_meta["version"].as_str(), Some(version.as_str()));
    assert_eq!(chart_meta["appVersion"].as_str(), Some(version.as_str()));
    run(scratch.path(), &helm, &["lint", chart.to_str().unwrap()]);
    let rendered = run(
        scratch.path(),
        &helm,
        &[
            "template",
            "leasehold",
            chart.to_str().unwrap(),
            "--namespace",
            "leasehold-system",
        ],
    );
    assert!(
        rendered.contains(&format!(":{version}\"")) || rendered.contains(&format!(":{version}\n")),
        "the rendered chart names no image of version {version}"
    );

    // The Python client: the wheel is typed, installs and imports at the version; the sdist
    // holds the package and its metadata.
    let wheel = out_dir.join(format!("leasehold-{version}-py3-none-any.whl"));
    let listing = run(
        scratch.path(),
        &python,
        &["-m", "zipfile", "-l", wheel.to_str().unwrap()],
    );
    assert!(listing.contains("leasehold/py.typed"), "{listing}");
    let target = scratch.path().join("site");
    run(
        scratch.path(),
        &python,
        &[
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-index",
            "--target",
            target.to_str().unwrap(),
            wheel.to_str().unwrap(),
        ],
    );
    let out = Command::new(&python)
        .args([
            "-c",
            "import leasehold, os; print(leasehold.__version__); print(leasehold.__file__)",
        ])
        .env("PYTHONPATH", &target)
        .current_dir(scratch.path())
        .output()
        .unwrap();
    let imported = text(&out);
    let mut lines = imported.lines();
    assert_eq!(lines.next(), Some(version.as_str()), "{imported}");
    assert!(
        Path::new(lines.next().unwrap()).starts_with(&target),
        "leasehold imported from elsewhere: {imported}"
    );
    let sdist = out_dir.join(format!("leasehold-{version}.tar.gz"));
    let members = run(scratch.path(), "tar", &["-tzf", sdist.to_str().unwrap()]);
    for member in [
        "PKG-INFO",
        "pyproject.toml",
        "leasehold/__init__.py",
        "leasehold/py.typed",
    ] {
        assert!(
            members
                .lines()
                .any(|l| l == format!("leasehold-{version}/{member}")),
            "the sdist lacks {member}:\n{members}"
        );
    }

    // The TypeScript client: npm's tarball of the build, at the version.
    let npm = out_dir.join(format!("leasehold-{version}-npm.tgz"));
    let members = run(scratch.path(), "tar", &["-tzf", npm.to_str().unwrap()]);
    for member in [
        "package.json",
        "README.md",
        "dist/index.js",
        "dist/index.d.ts",
    ] {
        assert!(
            members.lines().any(|l| l == format!("package/{member}")),
            "the npm tarball lacks {member}:\n{members}"
        );
    }
    let package: Value = serde_json::from_str(&run(
        scratch.path(),
        "tar",
        &["-xzOf", npm.to_str().unwrap(), "package/package.json"],
    ))
    .unwrap();
    assert_eq!(package["name"], "leasehold");
    assert_eq!(package["version"], version.as_str());
    let index_js = run(
        scratch.path(),
        "tar",
        &["-xzOf", npm.to_str().unwrap(), "package/dist/index.js"],
    );
    assert!(
        index_js.contains(&format!("\"{version}\"")),
        "dist/index.js has no VERSION {version}"
    );

    // The krew manifest: a Plugin naming each linux archive with its sha256.
    let krew: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(out_dir.join("krew/leasehold.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        krew["apiVersion"].as_str(),
        Some("krew.googlecontainertools.github.com/v1alpha2")
    );
    assert_eq!(krew["kind"].as_str(), Some("Plugin"));
    assert_eq!(krew["metadata"]["name"].as_str(), Some("leasehold"));
    assert_eq!(
        krew["spec"]["version"].as_str(),
        Some(format!("v{version}").as_str())
    );
    let platforms = krew["spec"]["platforms"].as_sequence().unwrap();
    assert_eq!(platforms.len(), archs.len());
    for (platform, arch) in platforms.iter().zip(&archs) {
        let labels = &platform["selector"]["matchLabels"];
        assert_eq!(labels["os"].as_str(), Some("linux"));
        assert_eq!(labels["arch"].as_str(), Some(*arch));
        let tarball = format!("leasehold-{version}-linux-{arch}.tar.gz");
        let uri = platform["uri"].as_str().unwrap();
        assert!(uri.ends_with(&format!("/{tarball}")), "{uri}");
        assert_eq!(
            platform["sha256"].as_str(),
            Some(sha256_hex(&out_dir.join(&tarball)).as_str()),
            "the krew manifest's sha256 of {tarball}"
        );
        assert_eq!(platform["bin"].as_str(), Some("leasehold"));
        let from: Vec<&str> = platform["files"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|f| f["from"].as_str().unwrap())
            .collect();
        assert!(from.contains(&"leasehold"), "{from:?}");
    }
}

/// A tree with uncommitted changes is refused, before anything is built, unless
/// --allow-dirty: tried on a scratch clone of this repository's HEAD.
#[test]
fn release_refuses_a_dirty_tree() {
    let scratch = Scratch::new("clone");
    let clone = scratch.path().join("clone");
    run(
        scratch.path(),
        "git",
        &[
            "clone",
            "-q",
            "--no-hardlinks",
            root().to_str().unwrap(),
            clone.to_str().unwrap(),
        ],
    );
    // The scripts under test are this tree's, which may not be committed yet.
    for script in ["scripts/release", "scripts/env.sh", "scripts/version"] {
        std::fs::copy(root().join(script), clone.join(script)).unwrap();
    }
    std::fs::write(clone.join("README.md"), "changed\n").unwrap();
    let out = Command::new(clone.join("scripts/release"))
        .args(["--out", scratch.path().join("dist").to_str().unwrap()])
        .current_dir(&clone)
        // No target directory for the scratch clone's path.
        .env("CARGO_TARGET_DIR", scratch.path().join("target"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("uncommitted changes"), "{said}");
    assert!(said.contains("README.md"), "{said}");
    assert!(!scratch.path().join("dist").exists(), "it made {said}");
}
