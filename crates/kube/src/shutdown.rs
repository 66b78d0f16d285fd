//! The process's shutdown signal.

/// Resolves on SIGTERM (what Kubernetes sends a container it stops) or SIGINT. Any number of
/// tasks may wait on it at once.
pub async fn signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
