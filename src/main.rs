//! The `graviton` command line.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use graviton::config::{Config, LogFormat};
use graviton::ids::SessionKey;

#[derive(Parser)]
#[command(
    name = "graviton",
    version,
    about = "Upload path of a content-addressed blob store"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node. With no configuration: a complete single node under ./graviton-data.
    Serve {
        /// TOML configuration file.
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
        /// Public listen address (overrides node.listen).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Data directory (overrides storage.data_dir).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Log format: human or json (overrides log.format).
        #[arg(long, value_parser = ["human", "json"])]
        log_format: Option<String>,
    },
    /// Run the shard manager as its own process (cluster mode). Fails closed, with exit
    /// status 3, when another manager holds the lock.
    Manager {
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: PathBuf,
    },
    /// Apply the PostgreSQL migrations (placement and manifests) and exit.
    Migrate {
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Cluster operations.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Move every shard off NODE now (the node keeps serving until it is stopped).
    Drain {
        node: String,
        /// Wait until NODE holds no shard (owned or moving to it); exit status 3 if
        /// `--timeout` passes first.
        #[arg(long)]
        wait: bool,
        /// How long `--wait` waits (e.g. "30s"; in-flight uploads on a moving shard get
        /// `cluster.handoff_grace` to finish).
        #[arg(long, default_value = "60s", requires = "wait")]
        timeout: graviton::config::HumanDuration,
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Validate a configuration without starting anything: the same checks as `serve`
    /// (without the network), every problem at once. With no `--config`, the defaults
    /// plus the environment are checked.
    CheckConfig {
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Upload a file; prints its key and deduplication figures.
    Put {
        file: PathBuf,
        /// Server URL.
        #[arg(long, env = "GRAVITON_SERVER", default_value = graviton::client::SERVER_DEFAULT)]
        server: String,
        /// Tenant of the upload session, a UUID such as
        /// 0b4f3c2e-8d1a-4c5e-9f7b-2a6d8e1c3b5a (with --session).
        #[arg(long, requires = "session", value_name = "TENANT_UUID")]
        tenant: Option<String>,
        /// Upload session, a UUID (with --tenant); uploads of one session run one at a time.
        #[arg(long, requires = "tenant", value_name = "SESSION_UUID")]
        session: Option<String>,
        /// Bearer token, when the server has `auth.enabled`.
        #[arg(long, env = "GRAVITON_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Collect unreferenced blocks of a stopped single node (see docs/storage.md).
    Gc {
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
        /// Report what would be collected; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Also delete quarantined entries and retired packs past storage.gc.retention.
        #[arg(long)]
        purge: bool,
        /// Put every quarantined block back instead of collecting.
        #[arg(long, conflicts_with_all = ["dry_run", "purge"])]
        restore: bool,
    },
    /// Check every pack (name, directory, block hashes) and the index; exit 1 on damage.
    Verify {
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Move blocks of the old file-per-block layout (`blocks/`) into packs.
    MigrateBlocks {
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Download a blob by key, verifying its content.
    Get {
        key: String,
        /// Output file (default: stdout).
        #[arg(short, long)]
        output: Option<PathBuf>,
        #[arg(long, env = "GRAVITON_SERVER", default_value = graviton::client::SERVER_DEFAULT)]
        server: String,
        /// Tenant the download's egress is charged to, a UUID.
        #[arg(long, value_name = "TENANT_UUID")]
        tenant: Option<String>,
        /// Bearer token, when the server has `auth.enabled`.
        #[arg(long, env = "GRAVITON_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Print nodes, shard counts and the manager term.
    Status {
        #[arg(long, env = "GRAVITON_CONFIG")]
        config: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// The placement database URL from the configuration (file and environment).
fn database_url(config: Option<&std::path::Path>) -> anyhow::Result<(Config, String)> {
    let config = Config::load(config)?;
    let url = config
        .cluster
        .database_url
        .as_ref()
        .map(|s| s.expose().to_string())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "cluster.database_url is not set (config file or GRAVITON_CLUSTER__DATABASE_URL)"
            )
        })?;
    Ok((config, url))
}

fn print_status(status: &graviton::cli::ClusterStatus) {
    println!(
        "shards {}  manager term {}  manager {}  unassigned {}  moving {}",
        status.shard_count,
        status.manager_term,
        status.manager_node.as_deref().unwrap_or("-"),
        status.unassigned_shards,
        status.moving_shards
    );
    println!(
        "{:<24} {:<10} {:>7} {:>14}  {:<width$}  internal address",
        "node",
        "state",
        "shards",
        "heartbeat age",
        "distribution",
        width = BAR_WIDTH + 6
    );
    for node in &status.nodes {
        println!(
            "{:<24} {:<10} {:>7} {:>12}ms  {}  {}",
            node.id.to_string(),
            format!("{:?}", node.state).to_lowercase(),
            node.shards,
            node.heartbeat_age_ms,
            shard_bar(node.shards, status.shard_count as usize, BAR_WIDTH),
            node.internal_addr
        );
    }
}

/// Width of the shard-distribution bars of `graviton cluster status`, in cells.
const BAR_WIDTH: usize = 30;

/// `shards` of `total` as a bar of `width` cells (eighths of a cell with Unicode block
/// elements, padded with spaces) followed by the share in percent.
fn shard_bar(shards: usize, total: usize, width: usize) -> String {
    const PARTIAL: [char; 8] = [' ', '▏', '▎', '▍', '▌', '▋', '▊', '▉'];
    let eighths = (shards.min(total) * width * 8 + total / 2)
        .checked_div(total)
        .unwrap_or(0);
    let (full, partial) = (eighths / 8, eighths % 8);
    let mut bar: String = "█".repeat(full);
    if partial > 0 {
        bar.push(PARTIAL[partial]);
    }
    let used = full + usize::from(partial > 0);
    bar.push_str(&" ".repeat(width - used));
    let percent = (shards * 100).checked_div(total).unwrap_or(0);
    format!("{bar} {percent:>3}%")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: start runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", describe(&err));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause once: many of our errors already
/// show their source in their own message (`"{op}: {source}"`), and printing the chain
/// as well would repeat it ("pack missing: pack missing").
fn describe(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let message = cause.to_string();
        if text.contains(&message) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    text
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve {
            config,
            listen,
            data_dir,
            log_format,
        } => {
            let overrides = graviton::config::Overrides {
                listen,
                data_dir,
                log_format: log_format.map(|format| {
                    if format == "json" {
                        LogFormat::Json
                    } else {
                        LogFormat::Human
                    }
                }),
            };
            // The same validation as `check-config`, flags included.
            let config = Config::load_to_serve(config.as_deref(), &overrides)?;
            graviton::telemetry::init(config.log.format, &config.log.level);
            let node = graviton::node::start(config).await?;
            match node.run_until_signal().await {
                (graviton::node::StopCause::Signal, _) => Ok(ExitCode::SUCCESS),
                // The control plane could not be kept up: exit so a supervisor restarts us.
                (graviton::node::StopCause::ControlPlaneLost, _) => Ok(ExitCode::from(1)),
            }
        }
        Command::Manager { config } => {
            let config = Config::load(Some(&config))?;
            graviton::telemetry::init(config.log.format, &config.log.level);
            let node = graviton::ids::NodeId::parse(config.node.id.as_str())
                .map_err(|e| anyhow::anyhow!("node.id in the config: {e}"))?;
            match graviton::actors::run_standalone_manager(node, &config.cluster).await {
                Ok(manager) => {
                    tracing::info!(
                        term = manager.term().await.0,
                        "standalone shard manager acting"
                    );
                    tokio::select! {
                        _ = manager_signal() => {
                            tracing::info!("shutdown signal received; releasing the manager lock");
                            manager.shutdown().await;
                            Ok(ExitCode::SUCCESS)
                        }
                        _ = manager.stopped() => {
                            // Never idle without a manager: exit so a supervisor restarts us.
                            tracing::error!("the manager election stopped; exiting");
                            Ok(ExitCode::from(1))
                        }
                    }
                }
                Err(graviton::actors::ClusterError::ManagerLockHeld) => {
                    eprintln!(
                        "error: another shard manager holds the lock; refusing to start a second one"
                    );
                    Ok(ExitCode::from(3))
                }
                Err(err) => Err(err.into()),
            }
        }
        Command::Migrate { config } => {
            let (_, url) = database_url(config.as_deref())?;
            graviton::cli::migrate(&url).await?;
            println!("migrations applied");
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster {
            command: ClusterCommand::Status { config, json },
        } => {
            let (_, url) = database_url(config.as_deref())?;
            let status = graviton::cli::cluster_status(&url).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print_status(&status);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Drain {
            node,
            wait,
            timeout,
            config,
        } => {
            let (_, url) = database_url(config.as_deref())?;
            let node = graviton::ids::NodeId::parse(node).map_err(|e| {
                anyhow::anyhow!(
                    "the node id {e} (node ids are the `node.id` values of the cluster's nodes)"
                )
            })?;
            let terminal = std::io::stderr().is_terminal();
            let progress = |held: usize| {
                if terminal {
                    eprintln!("{node}: {held} shard(s) still to move");
                }
            };
            let wait = wait.then_some(timeout.0);
            use graviton::cli::DrainOutcome;
            match graviton::cli::drain(&url, &node, wait, progress).await? {
                DrainOutcome::UnknownNode => {
                    eprintln!("error: no node {node} in the cluster");
                    Ok(ExitCode::from(2))
                }
                DrainOutcome::Requested => {
                    println!(
                        "drain of {node} requested; its shards move on the manager's next round"
                    );
                    Ok(ExitCode::SUCCESS)
                }
                DrainOutcome::Drained => {
                    println!("{node} drained: it owns no shard");
                    Ok(ExitCode::SUCCESS)
                }
                DrainOutcome::TimedOut { held } => {
                    eprintln!(
                        "error: {node} still holds {held} shard(s) after {timeout}; the drain stays requested (is a manager running? see `graviton cluster status`)"
                    );
                    Ok(ExitCode::from(3))
                }
            }
        }
        Command::Gc {
            config,
            dry_run,
            purge,
            restore,
        } => {
            let config = Config::load(config.as_deref())?;
            let report = graviton::cli::run_gc(&config, dry_run, purge, restore).await?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { config } => {
            let config = Config::load(config.as_deref())?;
            let report = graviton::cli::run_verify(&config).await?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(
                if report.damaged.is_empty() && report.entries_affected == 0 {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                },
            )
        }
        Command::MigrateBlocks { config } => {
            let config = Config::load(config.as_deref())?;
            let moved = graviton::cli::run_migrate_blocks(&config).await?;
            println!("moved {moved} blocks into packs");
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { config } => {
            let shown = match &config {
                Some(path) => format!("{}", path.display()),
                None => "defaults and environment".to_string(),
            };
            // Exactly what `serve` checks before it starts (flags aside).
            match Config::load_to_serve(config.as_deref(), &Default::default()) {
                Ok(_) => {
                    println!("{shown}: ok");
                    Ok(ExitCode::SUCCESS)
                }
                Err(err) => {
                    eprintln!("{shown}: {err}");
                    Ok(ExitCode::from(2))
                }
            }
        }
        Command::Put {
            file,
            server,
            tenant,
            session,
            token,
        } => {
            let session = match (tenant, session) {
                (Some(tenant), Some(session)) => Some(SessionKey {
                    tenant: tenant
                        .parse()
                        .map_err(|e| anyhow::anyhow!("--tenant {e}"))?,
                    session: session
                        .parse()
                        .map_err(|e| anyhow::anyhow!("--session {e}"))?,
                }),
                _ => None,
            };
            let credentials = graviton::client::Credentials {
                token: token.map(graviton::config::Secret::new),
                tenant: None,
            };
            let answer = graviton::client::put(&server, &file, session, &credentials).await?;
            println!("{}", answer.key);
            eprintln!(
                "{} bytes, {} blocks ({} new, {} already stored), chunker {}, owner {}",
                answer.size,
                answer.blocks,
                answer.fresh_blocks,
                answer.duplicate_blocks,
                answer.chunker,
                answer.owner
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Get {
            key,
            output,
            server,
            tenant,
            token,
        } => {
            let credentials = graviton::client::Credentials {
                token: token.map(graviton::config::Secret::new),
                tenant: tenant
                    .map(|t| t.parse())
                    .transpose()
                    .map_err(|e| anyhow::anyhow!("--tenant {e}"))?,
            };
            let bytes =
                graviton::client::get(&server, &key, output.as_deref(), &credentials).await?;
            if let Some(path) = output {
                eprintln!("{bytes} bytes written to {} (verified)", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn manager_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::{describe, shard_bar};

    #[derive(Debug, thiserror::Error)]
    #[error("open storage under /d: {source}")]
    struct Outer {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn an_error_chain_prints_each_cause_once() {
        let inner = std::io::Error::other("probe the S3 bucket: pack missing");
        let err = anyhow::Error::from(Outer { source: inner });
        assert_eq!(
            describe(&err),
            "open storage under /d: probe the S3 bucket: pack missing"
        );
        let err = anyhow::anyhow!("root cause").context("outer step");
        assert_eq!(describe(&err), "outer step: root cause");
    }

    #[test]
    fn shard_bars_are_proportional_and_fixed_width() {
        // 8 cells, a space, the percentage right-aligned in 3 columns
        assert_eq!(shard_bar(0, 1024, 8), format!("{}   0%", " ".repeat(8)));
        assert_eq!(shard_bar(1024, 1024, 8), "████████ 100%");
        assert_eq!(
            shard_bar(512, 1024, 8),
            format!("████{}  50%", " ".repeat(4))
        );
        // a third of 8 cells is 2 cells and 5 eighths
        assert_eq!(
            shard_bar(341, 1024, 8),
            format!("██▋{}  33%", " ".repeat(5))
        );
        for shards in 0..=64 {
            assert_eq!(shard_bar(shards, 64, 30).chars().count(), 35, "{shards}");
        }
        assert_eq!(shard_bar(3, 0, 4), format!("{}   0%", " ".repeat(4)));
    }
}
