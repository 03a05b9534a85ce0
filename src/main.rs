//! The `graviton` command line.

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
    /// Validate a configuration file without starting anything.
    CheckConfig {
        #[arg(long)]
        config: PathBuf,
    },
    /// Upload a file; prints its key and deduplication figures.
    Put {
        file: PathBuf,
        /// Server URL.
        #[arg(long, env = "GRAVITON_SERVER", default_value = graviton::client::SERVER_DEFAULT)]
        server: String,
        /// Tenant of the upload session (with --session).
        #[arg(long, requires = "session")]
        tenant: Option<String>,
        /// Upload session (with --tenant).
        #[arg(long, requires = "tenant")]
        session: Option<String>,
    },
    /// Download a blob by key, verifying its content.
    Get {
        key: String,
        /// Output file (default: stdout).
        #[arg(short, long)]
        output: Option<PathBuf>,
        #[arg(long, env = "GRAVITON_SERVER", default_value = graviton::client::SERVER_DEFAULT)]
        server: String,
    },
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
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve {
            config,
            listen,
            data_dir,
            log_format,
        } => {
            let mut config = Config::load(config.as_deref())?;
            if let Some(listen) = listen {
                config.node.listen = listen;
            }
            if let Some(dir) = data_dir {
                config.storage.data_dir = dir;
            }
            if let Some(format) = log_format {
                config.log.format = if format == "json" {
                    LogFormat::Json
                } else {
                    LogFormat::Human
                };
            }
            config.validate()?;
            graviton::telemetry::init(config.log.format, &config.log.level);
            let node = graviton::node::start(config).await?;
            node.run_until_signal().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { config } => match Config::load(Some(&config)) {
            Ok(_) => {
                println!("{}: ok", config.display());
                Ok(ExitCode::SUCCESS)
            }
            Err(err) => {
                eprintln!("{}: {err}", config.display());
                Ok(ExitCode::from(2))
            }
        },
        Command::Put {
            file,
            server,
            tenant,
            session,
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
            let answer = graviton::client::put(&server, &file, session).await?;
            println!("{}", answer.key);
            eprintln!(
                "{} bytes, {} blocks ({} new, {} already stored), owner {}",
                answer.size,
                answer.blocks,
                answer.fresh_blocks,
                answer.duplicate_blocks,
                answer.owner
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Get {
            key,
            output,
            server,
        } => {
            let bytes = graviton::client::get(&server, &key, output.as_deref()).await?;
            if let Some(path) = output {
                eprintln!("{bytes} bytes written to {} (verified)", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
