//! `tracing` setup shared by every binary.

use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines on stderr.
    Text,
    /// One JSON object per line on stderr (for log shippers).
    Json,
}

/// Installs a global subscriber on stderr. The filter comes from `RUST_LOG`, else `default_filter`
/// (e.g. `"info"`); `K3_LOG_FORMAT=json` selects JSON. Safe to call twice (the second is a no-op).
pub fn init(default_filter: &str) {
    let format = match std::env::var("K3_LOG_FORMAT").as_deref() {
        Ok("json") => LogFormat::Json,
        _ => LogFormat::Text,
    };
    init_with(default_filter, format);
}

/// Like [`init`] with an explicit format.
pub fn init_with(default_filter: &str, format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
