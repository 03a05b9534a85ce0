//! Configuration: one TOML file plus `GRAVITON_<SECTION>__<KEY>` environment overrides.
//!
//! Every key has a documented default (see `docs/configuration.md`), so `graviton serve`
//! with no file is a complete single node. Loading merges, in order: built-in defaults,
//! the TOML file (if given), then environment variables whose names contain `__`
//! (`GRAVITON_NODE__LISTEN=0.0.0.0:7070`, `GRAVITON_SESSIONS__MAX_HOT=10000`). Unknown
//! keys are errors, and every error names the offending key and where it was set.
//! The loading and the one validation `serve` and `check-config` share live in [`load`]
//! (all problems in one run) and [`files`] (the checks that read local files).

pub mod files;
pub mod load;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use load::{Finding, Overrides, Source};
// The value types live in the leaf `values` (sections use them without importing
// `config`); re-exported here for the binaries and tests that name them through `config`.
pub use crate::telemetry::LogFormat;
pub use crate::values::{ByteSize, HumanDuration, Problem, Secret, UnitError};

/// Default public listen address of `graviton serve`.
pub const LISTEN_DEFAULT: &str = "127.0.0.1:7070";
/// Default data directory (blocks and manifests of the embedded store).
pub const DATA_DIR_DEFAULT: &str = "./graviton-data";
/// Default bound on session-owner actors kept in memory per node.
pub const HOT_SESSIONS_MAX_DEFAULT: usize = 4096;

/// The whole configuration of one `graviton` process.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub node: NodeConfig,
    pub storage: StorageConfig,
    pub sessions: SessionsConfig,
    pub upload: UploadConfig,
    pub log: LogConfig,
    pub admin: AdminConfig,
    pub admission: crate::admission::AdmissionConfig,
    /// `[control]`: cluster control plane and internal listener (see `control::config`).
    pub control: crate::control::config::ControlConfig,
    pub cluster: crate::placement::config::ClusterConfig,
    /// `[http]`: connection limits of every listener, CORS, TLS (see `http::config`).
    pub http: crate::http::config::HttpConfig,
    /// `[auth]`: JWT bearer authentication of the public API (see `auth::config`).
    pub auth: crate::auth::AuthConfig,
    /// `[grpc]`: the gRPC listener, off unless `listen` is set (see `grpc::config`).
    pub grpc: crate::grpc::config::GrpcConfig,
    /// `[health]`: the schedule of the dependency probes (see `health`).
    pub health: crate::health::HealthConfig,
    /// `[ingest]`: how bodies are cut into blocks (`[ingest.pdf]`).
    pub ingest: IngestConfig,
}

/// `[ingest]`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct IngestConfig {
    /// `[ingest.pdf]`: the PDF-aware chunker (see `cas::pdf`, docs/storage.md).
    pub pdf: PdfIngestConfig,
}

/// `[ingest.pdf]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct PdfIngestConfig {
    /// Select the PDF-aware chunker for PDF bodies (and check the PDF Content-Type rules).
    pub enabled: bool,
    /// Cut at the first object boundary at or after this many bytes (16 KiB ..= max).
    pub target: ByteSize,
    /// Largest block (16 KiB ..= 256 KiB).
    pub max: ByteSize,
    /// A PDF the scanner does not follow: `fallback` (store it) or `reject` (422).
    pub unsupported: PdfUnsupported,
}

/// `[ingest.pdf] unsupported`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum PdfUnsupported {
    #[default]
    Fallback,
    Reject,
}

impl Default for PdfIngestConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            target: ByteSize::kib(64),
            max: ByteSize::kib(256),
            unsupported: PdfUnsupported::Fallback,
        }
    }
}

impl PdfIngestConfig {
    /// The policy in force, or what is wrong with the sizes.
    pub fn policy(&self) -> Result<crate::cas::pdf::PdfPolicy, Problem> {
        let size = |b: ByteSize| usize::try_from(b.bytes()).unwrap_or(usize::MAX);
        let sizes = crate::cas::pdf::PdfSizes::new(size(self.target), size(self.max))
            .map_err(|e| Problem::new("ingest.pdf", e))?;
        Ok(crate::cas::pdf::PdfPolicy {
            enabled: self.enabled,
            sizes,
            unsupported: match self.unsupported {
                PdfUnsupported::Fallback => crate::cas::pdf::UnsupportedPolicy::Fallback,
                PdfUnsupported::Reject => crate::cas::pdf::UnsupportedPolicy::Reject,
            },
        })
    }
}

/// `[node]`: identity and listeners.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Node id shown in responses (`owner`) and in cluster tables.
    pub id: String,
    /// Public HTTP listener.
    pub listen: SocketAddr,
    /// How long SIGTERM/SIGINT waits for in-flight requests before aborting them.
    pub shutdown_grace: HumanDuration,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            id: "local".to_string(),
            listen: LISTEN_DEFAULT
                .parse()
                .expect("valid default listen address"),
            shutdown_grace: HumanDuration::secs(30),
        }
    }
}

/// `[storage]`: the block store (packs, index) and the embedded manifest store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageConfig {
    /// Root of `packs/`, `index.redb` and `manifests/` (and the legacy `blocks/`).
    pub data_dir: PathBuf,
    /// Sync pack data and manifests before acknowledging an upload (the redb index
    /// commits durably whatever this says).
    pub fsync: bool,
    /// `fs` or `s3`; unset: `fs` on one node, `s3` in cluster mode.
    pub backend: Option<crate::storage::config::Backend>,
    /// Seal a pack at this size.
    pub pack_size: ByteSize,
    /// Cluster mode with `backend = "fs"`: the operator declares `data_dir` one shared mount.
    pub shared_mount: bool,
    pub s3: crate::storage::config::S3Config,
    pub gc: crate::storage::config::GcConfig,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from(DATA_DIR_DEFAULT),
            fsync: true,
            backend: None,
            pack_size: crate::storage::config::default_pack_size(),
            shared_mount: false,
            s3: Default::default(),
            gc: Default::default(),
        }
    }
}

impl StorageConfig {
    /// The backend in force (`s3` by default in cluster mode).
    pub fn backend_in(&self, cluster: bool) -> crate::storage::config::Backend {
        use crate::storage::config::Backend;
        self.backend
            .unwrap_or(if cluster { Backend::S3 } else { Backend::Fs })
    }
}

/// `[sessions]`: hot state of upload sessions owned by this node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionsConfig {
    /// Most session-owner actors alive at once; idle ones are evicted first at the bound.
    pub max_hot: usize,
    /// An owner with no activity for this long stops itself.
    pub idle_timeout: HumanDuration,
    /// How often the region looks for idle owners.
    pub sweep_interval: HumanDuration,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            max_hot: HOT_SESSIONS_MAX_DEFAULT,
            idle_timeout: HumanDuration::secs(300),
            sweep_interval: HumanDuration::secs(5),
        }
    }
}

/// `[upload]`: limits on one upload.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UploadConfig {
    /// Largest accepted blob; a larger `Content-Length` is refused before the body is read.
    pub max_blob_size: ByteSize,
    /// An upload whose body delivers nothing for this long is aborted.
    pub body_idle_timeout: HumanDuration,
    /// The admission footprint of one resumable (tus) PATCH is
    /// `min(resumable_part_footprint, remaining length)`, never less than the upload
    /// footprint (`admission::Footprint::for_part`).
    pub resumable_part_footprint: ByteSize,
    /// A resumable upload expires this long after its last progress.
    pub resumable_expiry: HumanDuration,
    /// How often expired resumable uploads are swept.
    pub resumable_sweep_interval: HumanDuration,
}

impl Default for UploadConfig {
    fn default() -> Self {
        Self {
            max_blob_size: ByteSize::gib(64),
            body_idle_timeout: HumanDuration::secs(60),
            resumable_part_footprint: ByteSize::mib(128),
            resumable_expiry: HumanDuration::secs(24 * 3600),
            resumable_sweep_interval: HumanDuration::secs(60),
        }
    }
}

/// `[log]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    pub format: LogFormat,
    /// `tracing` filter directive; `RUST_LOG` wins when set.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Human,
            level: "info".to_string(),
        }
    }
}

/// `[admin]`
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Bearer token for `/v1/admin/...`. Unset: admin endpoints answer 403.
    pub token: Option<Secret>,
}

/// A configuration problem, naming the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {message}")]
    File { path: PathBuf, message: String },
    /// Every problem found, each naming its key and where the key was set.
    #[error("invalid configuration:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Finding>),
}

impl Config {
    /// Load defaults, then `file` (when given; it must exist, and may be empty, as
    /// `/dev/null` is), then the environment, and validate the values and their
    /// combinations. Every problem is reported at once. For the tool subcommands (`gc`,
    /// `migrate`, `drain`, ...), which may run on another host than the node and do not
    /// open its certificates: `serve` and `check-config` use [`Config::load_to_serve`].
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_inner(file, &Overrides::default(), false)
    }

    /// The one validation of `serve` and `check-config`: [`Config::load`] with `serve`'s
    /// flags applied over every other layer, plus the checks of the local files the
    /// configuration names (`config::files`).
    pub fn load_to_serve(file: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        Self::load_inner(file, overrides, true)
    }

    fn load_inner(
        file: Option<&Path>,
        overrides: &Overrides,
        check_files: bool,
    ) -> Result<Self, ConfigError> {
        let text = match file {
            Some(path) => Some(read_file(path)?),
            None => None,
        };
        let layer = match (file, &text) {
            (Some(path), Some(text)) => Some(load::FileLayer { path, text }),
            _ => None,
        };
        let env: Vec<(String, String)> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
            .filter(|(k, _)| load::env_key(k).is_some())
            .collect();
        load::collect(layer, &env, overrides, check_files).map_err(ConfigError::Invalid)
    }

    /// Parse a TOML document (no environment) and validate it. Used by tests and tools.
    /// The files it names are not read: see [`Config::load_to_serve`].
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let layer = load::FileLayer {
            path: Path::new("(inline TOML)"),
            text,
        };
        load::collect(Some(layer), &[], &Overrides::default(), false).map_err(ConfigError::Invalid)
    }

    /// Every validation problem at once, so an operator fixes the file in one pass.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if let Err(err) = crate::ids::NodeId::parse(self.node.id.as_str()) {
            problems.push(Problem::new("node.id", err.to_string()));
        }
        problems.extend(self.health.problems());
        if self.storage.data_dir.as_os_str().is_empty() {
            problems.push(Problem::new("storage.data_dir", "must not be empty"));
        }
        problems.extend(crate::storage::config::problems(
            self.storage.backend_in(self.cluster.enabled),
            self.storage.pack_size,
            &self.storage.s3,
            self.cluster.enabled,
            self.storage.shared_mount,
        ));
        problems.extend(self.storage.gc.problems());
        if self.sessions.max_hot == 0 {
            problems.push(Problem::new("sessions.max_hot", "must be at least 1"));
        }
        if self.sessions.idle_timeout.get().is_zero() {
            problems.push(Problem::new(
                "sessions.idle_timeout",
                "must be greater than zero",
            ));
        }
        if self.sessions.sweep_interval.get().is_zero() {
            problems.push(Problem::new(
                "sessions.sweep_interval",
                "must be greater than zero",
            ));
        }
        if self.upload.max_blob_size.bytes() == 0 {
            problems.push(Problem::new(
                "upload.max_blob_size",
                "must be greater than zero",
            ));
        }
        for (key, zero) in [
            (
                "upload.body_idle_timeout",
                self.upload.body_idle_timeout.get().is_zero(),
            ),
            (
                "upload.resumable_part_footprint",
                self.upload.resumable_part_footprint.bytes() == 0,
            ),
            (
                "upload.resumable_expiry",
                self.upload.resumable_expiry.get().is_zero(),
            ),
            (
                "upload.resumable_sweep_interval",
                self.upload.resumable_sweep_interval.get().is_zero(),
            ),
        ] {
            if zero {
                problems.push(Problem::new(key, "must be greater than zero"));
            }
        }
        if let Some(token) = &self.admin.token
            && token.expose().len() < 16
        {
            problems.push(Problem::new(
                "admin.token",
                "must be at least 16 characters",
            ));
        }
        problems.extend(self.admission.problems());
        problems.extend(self.http.problems());
        problems.extend(self.auth.problems());
        problems.extend(self.grpc.problems());
        if let Err(problem) = self.ingest.pdf.policy() {
            problems.push(problem);
        }
        if self.admission.tenant_mode && !self.auth.enabled {
            problems.push(Problem::new(
                "auth.enabled",
                "admission.tenant_mode requires authentication (auth.enabled = true with an issuer)",
            ));
        }
        problems.extend(self.control.problems_in(self.cluster.enabled));
        problems.extend(self.cluster.problems());
        problems
    }

    /// In cluster mode, the node's addresses in the node table that were left empty, from
    /// its listeners: `cluster.internal_addr` from `control.internal_listen` when that is
    /// a concrete address peers can dial (only a wildcard bind needs it spelled out),
    /// `cluster.control_addr` from `control.control_listen`, `cluster.public_addr` from
    /// `node.listen`. Done once, when the configuration is loaded (before validation).
    pub fn default_cluster_addresses(&mut self) {
        if !self.cluster.enabled {
            return;
        }
        let cluster = &mut self.cluster;
        if cluster.internal_addr.trim().is_empty()
            && !self.control.internal_listen.ip().is_unspecified()
        {
            cluster.internal_addr = self.control.internal_listen.to_string();
        }
        if cluster.control_addr.is_empty() {
            cluster.control_addr = self.control.control_listen.to_string();
        }
        if cluster.public_addr.is_empty() {
            cluster.public_addr = self.node.listen.to_string();
        }
    }

    /// [`Config::problems`] as an error (sources unknown: for a configuration built in
    /// code; a loaded one was validated with its sources by [`Config::load`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let problems = self.problems();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(
                problems
                    .into_iter()
                    .map(|p| Finding {
                        key: p.key.to_string(),
                        source: Source::Code,
                        message: p.message,
                    })
                    .collect(),
            ))
        }
    }

    /// A configuration for tests: random loopback port, the given data directory, no fsync.
    pub fn for_test(data_dir: &Path) -> Self {
        let mut config = Config::default();
        config.node.listen = "127.0.0.1:0".parse().expect("loopback");
        config.storage.data_dir = data_dir.to_path_buf();
        config.storage.fsync = false;
        config.node.shutdown_grace = HumanDuration::secs(5);
        config
    }
}

/// The text of the configuration file; empty (`/dev/null`) is the defaults.
fn read_file(path: &Path) -> Result<String, ConfigError> {
    let error = |message: String| ConfigError::File {
        path: path.to_path_buf(),
        message,
    };
    if path.is_dir() {
        return Err(error("is a directory, not a file".into()));
    }
    std::fs::read(path)
        .map_err(|e| {
            error(match e.kind() {
                std::io::ErrorKind::NotFound => "no such file".into(),
                _ => format!("cannot be read ({e})"),
            })
        })
        .and_then(|bytes| String::from_utf8(bytes).map_err(|_| error("is not UTF-8 text".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_complete() {
        let config = Config::default();
        assert!(config.problems().is_empty(), "{:?}", config.problems());
        assert_eq!(config.sessions.max_hot, HOT_SESSIONS_MAX_DEFAULT);
        assert_eq!(config.storage.data_dir, PathBuf::from(DATA_DIR_DEFAULT));
    }

    #[test]
    fn toml_values_use_human_units() {
        let config = Config::from_toml_str(
            "[sessions]\nidle_timeout = \"90s\"\nmax_hot = 10\n[upload]\nmax_blob_size = \"1GiB\"\n",
        )
        .unwrap();
        assert_eq!(config.sessions.idle_timeout, HumanDuration::secs(90));
        assert_eq!(config.upload.max_blob_size, ByteSize::gib(1));
    }

    #[test]
    fn the_pdf_section_is_validated_and_defaults_on() {
        let config = Config::default();
        let policy = config.ingest.pdf.policy().unwrap();
        assert!(policy.enabled);
        assert_eq!(policy.sizes, crate::cas::pdf::PdfSizes::default());
        let config = Config::from_toml_str(
            "[ingest.pdf]\nenabled = false\ntarget = \"32KiB\"\nmax = \"128KiB\"\nunsupported = \"reject\"\n",
        )
        .unwrap();
        let policy = config.ingest.pdf.policy().unwrap();
        assert!(!policy.enabled);
        assert_eq!(policy.sizes.target, 32 * 1024);
        assert_eq!(
            policy.unsupported,
            crate::cas::pdf::UnsupportedPolicy::Reject
        );
        for bad in [
            "[ingest.pdf]\nmax = \"1MiB\"\n",
            "[ingest.pdf]\ntarget = \"1KiB\"\n",
            "[ingest.pdf]\ntarget = \"200KiB\"\nmax = \"100KiB\"\n",
        ] {
            let err = Config::from_toml_str(bad).unwrap_err().to_string();
            assert!(err.contains("ingest.pdf"), "{bad}: {err}");
        }
        let err = Config::from_toml_str("[ingest.pdf]\nunsupported = \"maybe\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("ingest.pdf.unsupported"), "{err}");
    }

    #[test]
    fn errors_name_the_offending_key() {
        let err = Config::from_toml_str("[upload]\nmax_blob_size = \"lots\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("upload.max_blob_size"), "{err}");
        let err = Config::from_toml_str("[sessions]\nmax_hot = 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sessions.max_hot"), "{err}");
        let err = Config::from_toml_str("[node]\nlisten_typo = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("listen_typo"), "{err}");
    }

    #[test]
    fn cluster_addresses_default_from_the_listeners_when_loaded() {
        let toml = |internal_listen: &str, extra: &str| {
            format!(
                "[node]\nlisten = \"10.0.0.5:7070\"\n[storage]\nbackend = \"fs\"\nshared_mount = true\n\
                 [cluster]\nenabled = true\ndatabase_url = \"postgres://u@127.0.0.1/db\"\n{extra}\
                 [control]\ninternal_listen = \"{internal_listen}\"\ncontrol_listen = \"10.0.0.5:7072\"\n\
                 internal_token = \"0123456789abcdef0123456789abcdef\"\n"
            )
        };
        let config = Config::from_toml_str(&toml("10.0.0.5:7071", "")).unwrap();
        assert_eq!(config.cluster.internal_addr, "10.0.0.5:7071");
        assert_eq!(config.cluster.control_addr, "10.0.0.5:7072");
        assert_eq!(config.cluster.public_addr, "10.0.0.5:7070");
        // A value that is set wins.
        let config = Config::from_toml_str(&toml(
            "10.0.0.5:7071",
            "internal_addr = \"192.0.2.1:9071\"\npublic_addr = \"lb.example:443\"\n",
        ))
        .unwrap();
        assert_eq!(config.cluster.internal_addr, "192.0.2.1:9071");
        assert_eq!(config.cluster.public_addr, "lb.example:443");
        // A wildcard bind is no address peers can dial: it must be spelled out.
        let err = Config::from_toml_str(&toml("0.0.0.0:7071", ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cluster.internal_addr"), "{err}");
        // Embedded mode keeps them empty.
        assert!(Config::default().cluster.internal_addr.is_empty());
    }

    #[test]
    fn short_admin_token_is_rejected_without_echoing_it() {
        let err = Config::from_toml_str("[admin]\ntoken = \"abc\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("admin.token"), "{err}");
        assert!(!err.contains("abc\""), "{err}");
    }
}
