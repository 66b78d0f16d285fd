//! Logging set-up: `tracing` to stderr, filtered by `RUST_LOG` (default `info`), as text or as
//! JSON lines. Log calls put the job reference and attempt in fields (`job`, `attempt`), so each
//! JSON line carries them.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber. Call once, first thing in `main`.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
