//! Logging setup (`tracing`): human-readable by default, JSON on request. Human logs are
//! coloured only when stderr is a terminal: a file, a pipe or a journal gets plain text.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Log output format (`[log] format`).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// Install the global subscriber. `RUST_LOG` overrides `level` when set.
pub fn init(format: LogFormat, level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
