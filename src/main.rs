//! `leasehold`: one binary: the controller, the sidecar, the CRD, and (also as the kubectl plugin
//! `kubectl-leasehold`) get, retry and cancel. It only parses and runs: see
//! `leasehold::cli`.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    leasehold::cli::Cli::parse_and_run().await
}
