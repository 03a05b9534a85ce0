//! One running node: stores, actors, placement and the HTTP servers, started and stopped
//! together.
//!
//! `start` runs five stages, in order: the stores ([`assemble::Stores::open`], which also
//! decides the mode), the actor tree with admission, placement, the services a request
//! uses (the [`AppState`]), then the listeners and background tasks. In embedded mode (`cluster.enabled = false`) every shard is local and
//! nothing outside the process is needed. In cluster mode the node joins the PostgreSQL
//! placement, serves the internal owner-ingest listener, runs the ractor_cluster control
//! plane, and forwards uploads of sessions it does not own (glue in [`peers`]).
//!
//! `shutdown` (also on SIGTERM/SIGINT): in cluster mode first drains this node's shards to
//! the others, then marks the node not ready, stops accepting connections, gives in-flight
//! requests `node.shutdown_grace` to finish, aborts what is left (aborted uploads write no
//! manifest), and stops the control plane, placement and actors.

pub mod assemble;
pub mod peers;
pub mod tasks;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::actors::SupervisorHandle;
use crate::actors::session_region::RegionArgs;
use crate::actors::supervisor::SupervisorArgs;
use crate::actors::{Cluster, ClusterHandle};
use crate::config::Config;
use crate::control::{ClusterOptions, ClusterTransport, ControlTransport};
use crate::edge::{AppState, Readiness};
use crate::http::internal;
use crate::ids::NodeId;
use crate::metrics::Metrics;
use crate::relay::{ForwardOptions, Forwarder};
use crate::storage::{BlockStore, ManifestStore};
use assemble::{Mode, Stores};

/// Replaceable parts of a node (tests inject instrumented stores).
#[derive(Default)]
pub struct NodeOptions {
    pub blocks: Option<Arc<dyn BlockStore>>,
    pub manifests: Option<Arc<dyn ManifestStore>>,
    /// The resumable-upload ledger (tests share one between two nodes to play a cluster's
    /// shared ledger with node-local hasher caches).
    pub ledger: Option<Arc<dyn crate::upload::ledger::UploadLedger>>,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("open storage under {path}: {source}")]
    Storage {
        path: String,
        #[source]
        source: crate::storage::StoreError,
    },
    #[error("bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("start actors: {0}")]
    Actors(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("admission: {0}")]
    Admission(String),
    #[error("join the cluster: {0}")]
    Cluster(String),
    #[error("start the control plane: {0}")]
    Control(String),
    #[error("authentication: {0}")]
    Auth(String),
    #[error("TLS: {0}")]
    Tls(String),
}

/// A started node.
pub struct RunningNode {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop_accepting: CancellationToken,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    supervisor: SupervisorHandle,
    cluster_parts: Option<ClusterParts>,
    tasks: tasks::BackgroundTasks,
    /// The gRPC listener (`[grpc] listen`), stopped with the public one.
    grpc: Option<GrpcParts>,
}

struct GrpcParts {
    addr: SocketAddr,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

/// What only cluster mode runs.
struct ClusterParts {
    internal: tokio::task::JoinHandle<std::io::Result<()>>,
    internal_addr: SocketAddr,
    control: Arc<ClusterTransport>,
    stop: CancellationToken,
}

/// Why [`RunningNode::run_until_signal`] stopped the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// SIGTERM or SIGINT: exit status 0.
    Signal,
    /// The control plane's supervisor gave up restarting it: exit status 1, so the
    /// orchestrator restarts the process.
    ControlPlaneLost,
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownOutcome {
    /// Every in-flight request finished within the grace period.
    Drained,
    /// The grace period ran out; remaining requests were aborted.
    Aborted,
}

pub async fn start(config: Config) -> Result<RunningNode, StartError> {
    start_with(config, NodeOptions::default()).await
}

/// Start a node: stores → actors → placement → services → listeners, each stage a
/// function below (the stores in [`assemble`]).
pub async fn start_with(config: Config, options: NodeOptions) -> Result<RunningNode, StartError> {
    crate::storage::pack::pause::announce();
    // `Config::problems` checked `node.id` with the same rule.
    let node_id = NodeId::parse(config.node.id.as_str())
        .map_err(|e| StartError::Cluster(format!("node.id: {e}")))?;
    let stores = Stores::open(&config, &node_id, options).await?;
    let metrics = Metrics::new();
    let (admission, supervisor) = start_actors(&config, &node_id, &metrics).await?;
    let cluster = match start_placement(&config, &node_id, &stores, &supervisor).await {
        Ok(cluster) => cluster,
        Err(err) => {
            supervisor.shutdown().await;
            return Err(err);
        }
    };
    let mode = stores.mode;
    // The relay to sessions' owners (cluster mode), the public router's besides the state.
    let relay = match mode {
        Mode::Cluster => Some(forwarder(&config)?),
        Mode::Embedded => None,
    };
    let state = start_services(
        config,
        node_id,
        stores,
        admission,
        supervisor.sessions(),
        cluster,
        metrics,
    )
    .await?;

    // Listeners: bound before the background tasks start, then served once all is up.
    let listener = bind(state.config.node.listen).await?;
    let addr = local_addr(&listener, state.config.node.listen)?;
    let grpc_listener = match state.config.grpc.listen {
        Some(listen) => Some((listen, bind(listen).await?)),
        None => None,
    };
    let mut tasks = start_tasks(&state);
    let cluster_parts = match mode {
        Mode::Cluster => Some(start_cluster_parts(&state, &mut tasks, supervisor.root()).await?),
        Mode::Embedded => None,
    };
    if state.config.http.tls.enabled() {
        // Fail the start, not the first connection, on a bad certificate or key.
        crate::edge::tls::public_acceptor(&state.config.http.tls).map_err(StartError::Tls)?;
    }
    if grpc_listener.is_some() && state.config.grpc.tls.enabled() {
        crate::edge::tls::grpc_acceptor(&state.config.grpc.tls).map_err(StartError::Tls)?;
    }
    let stop_accepting = CancellationToken::new();
    let server = tokio::spawn(crate::http::serve(
        listener,
        state.clone(),
        relay,
        stop_accepting.clone().cancelled_owned(),
    ));
    let grpc = match grpc_listener {
        Some((listen, listener)) => {
            let addr = local_addr(&listener, listen)?;
            let server = tokio::spawn(crate::grpc::serve(
                listener,
                state.clone(),
                stop_accepting.clone().cancelled_owned(),
            ));
            tracing::info!(%addr, "gRPC listener serving graviton.v1.Blobs");
            Some(GrpcParts { addr, server })
        }
        None => None,
    };
    state.readiness.set(true);
    tracing::info!(
        %addr,
        node = %state.node_id,
        mode = mode.name(),
        data_dir = %state.config.storage.data_dir.display(),
        "graviton node serving"
    );
    Ok(RunningNode {
        addr,
        state,
        stop_accepting,
        server,
        supervisor,
        cluster_parts,
        tasks,
        grpc,
    })
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })
}

fn local_addr(listener: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, StartError> {
    listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr, source })
}

/// Admission (its lease holder linked under the node's supervisor) and the actor tree.
async fn start_actors(
    config: &Config,
    node_id: &NodeId,
    metrics: &Metrics,
) -> Result<(crate::admission::Admission, SupervisorHandle), StartError> {
    let admission = crate::admission::Admission::new(
        &config.admission,
        crate::admission::AdmissionMetrics::default(),
    )
    .map_err(|e| StartError::Admission(e.to_string()))?;
    admission.bootstrap_limits_in_background();
    metrics.register_with(|registry| admission.metrics().register(registry));
    let supervisor = SupervisorHandle::start(SupervisorArgs {
        region_name: format!(
            "graviton.{}.{}.session-region",
            node_id,
            uuid::Uuid::new_v4().simple()
        ),
        region: RegionArgs {
            max_hot: config.sessions.max_hot,
            idle_timeout: config.sessions.idle_timeout.get(),
            sweep_interval: config.sessions.sweep_interval.get(),
            metrics: metrics.clone(),
        },
    })
    .await
    .map_err(|e| StartError::Actors(e.to_string()))?;
    admission.supervise_under(supervisor.root());
    Ok((admission, supervisor))
}

/// Placement: the PostgreSQL group linked under the node's supervisor (one actor tree)
/// in cluster mode, every shard local in embedded mode.
async fn start_placement(
    config: &Config,
    node_id: &NodeId,
    stores: &Stores,
    supervisor: &SupervisorHandle,
) -> Result<Arc<ClusterHandle>, StartError> {
    let Some(pool) = &stores.database else {
        return Ok(Arc::new(Cluster::single_node(
            node_id.clone(),
            config.cluster.shard_count,
        )));
    };
    let handle = Cluster::start_under(
        Some(supervisor.root()),
        node_id.clone(),
        &config.cluster,
        env!("CARGO_PKG_VERSION"),
        pool.clone(),
    )
    .await
    .map_err(|err| StartError::Cluster(err.to_string()))?;
    Ok(Arc::new(handle))
}

/// The services a request uses, gathered in the [`AppState`]: authentication,
/// the upload service, the dependency probes (their first round before the node serves:
/// `/readyz` never shows an unprobed dependency, and one down at start is logged now).
async fn start_services(
    config: Config,
    node_id: NodeId,
    stores: Stores,
    admission: crate::admission::Admission,
    sessions: crate::actors::SessionRegionHandle,
    cluster: Arc<ClusterHandle>,
    metrics: Metrics,
) -> Result<Arc<AppState>, StartError> {
    let packs = stores.packs.clone().map(|store| {
        let gc_metrics = crate::storage::pack::gc::GcMetrics::default();
        metrics.register_with(|registry| gc_metrics.register(registry));
        (store, gc_metrics)
    });
    let auth = start_auth(&config).await?;
    let edge = crate::edge::EdgeMetrics::default();
    metrics.register_with(|registry| edge.register(registry));
    let uploads = Arc::new(crate::upload::UploadService::new(
        crate::upload::UploadParts {
            node: node_id.clone(),
            blocks: stores.blocks.clone(),
            manifests: stores.manifests.clone(),
            sessions: sessions.clone(),
            admission: admission.clone(),
            cluster: cluster.clone(),
            limits: crate::upload::UploadLimits {
                max_blob_size: config.upload.max_blob_size.bytes(),
                body_idle_timeout: config.upload.body_idle_timeout.get(),
            },
            metrics: metrics.clone(),
            pdf: config
                .ingest
                .pdf
                .policy()
                .map_err(|problem| StartError::Config(problem.to_string()))?,
            ledger: stores.ledger.clone(),
            resumable: crate::upload::resumable::ResumableLimits {
                part_footprint: config.upload.resumable_part_footprint.bytes(),
                expiry: config.upload.resumable_expiry.get(),
            },
        },
    ));
    let dependencies = crate::health::DependencyHealth::new(dependency_probes(
        &config,
        &stores.blocks,
        &admission,
        stores.database.clone(),
    ));
    metrics.register_with(|registry| dependencies.register(registry));
    dependencies
        .probe_all(config.health.probe_timeout.get())
        .await;
    Ok(Arc::new(AppState {
        node_id,
        config: Arc::new(config),
        blocks: stores.blocks,
        manifests: stores.manifests,
        sessions,
        uploads,
        metrics,
        admission,
        readiness: Readiness::default(),
        started_at: Instant::now(),
        cluster,
        auth,
        edge,
        packs,
        dependencies,
    }))
}

/// The node-to-node relay of a cluster node.
fn forwarder(config: &Config) -> Result<Forwarder, StartError> {
    let options = ForwardOptions::from_config(&config.control).ok_or_else(|| {
        StartError::Control("control.internal_token is required in cluster mode".into())
    })?;
    let forwarder = if config.http.internal_tls.enabled() {
        Forwarder::with_mutual_tls(options, &config.http.internal_tls)
    } else {
        Forwarder::new(options)
    };
    let forwarder = forwarder.map_err(|e| StartError::Control(e.to_string()))?;
    // The owner admits in the pre-flight: let it wait as long as admission may.
    Ok(forwarder.with_admission_wait(config.admission.acquisition_timeout.get()))
}

/// The bearer authenticator, with `auth.enabled`.
async fn start_auth(
    config: &Config,
) -> Result<Option<Arc<crate::auth::Authenticator>>, StartError> {
    if !config.auth.enabled {
        tracing::info!(
            "authentication is off (auth.enabled = false): the tenant is the X-Graviton-Tenant-Id header as sent"
        );
        return Ok(None);
    }
    let authenticator = crate::auth::Authenticator::start(&config.auth)
        .await
        .map_err(StartError::Auth)?;
    tracing::info!(
        issuers = config.auth.issuers.len(),
        "authentication on: uploads and downloads need a bearer token"
    );
    Ok(Some(Arc::new(authenticator)))
}

/// The node's background tasks (`tasks`): collector schedule, resumable-upload sweep,
/// dependency probes (the cluster's are added by [`start_cluster_parts`]).
fn start_tasks(state: &Arc<AppState>) -> tasks::BackgroundTasks {
    let mut tasks = tasks::BackgroundTasks::new(CancellationToken::new());
    let weak = Arc::downgrade(state);
    tasks.spawn("collector schedule", move |stop| {
        tasks::collect_on_schedule(weak.clone(), stop)
    });
    let weak = Arc::downgrade(state);
    tasks.spawn("resumable upload sweep", move |stop| {
        tasks::sweep_expired_uploads(weak.clone(), stop)
    });
    let health = state.dependencies.clone();
    let (interval, timeout) = (
        state.config.health.probe_interval.get(),
        state.config.health.probe_timeout.get(),
    );
    tasks.spawn("dependency probes", move |stop| {
        health.clone().run(interval, timeout, stop)
    });
    tasks
}

/// The node's dependency probes (`health`): the block store always, PostgreSQL in
/// cluster mode (on the node's own pool), Redis with `[admission.redis]`.
fn dependency_probes(
    config: &Config,
    blocks: &Arc<dyn BlockStore>,
    admission: &crate::admission::Admission,
    pool: Option<sqlx::PgPool>,
) -> Vec<crate::health::Probe> {
    use crate::health::{Dependency, Probe, endpoint_of};
    let mut probes = Vec::new();
    let store = blocks.clone();
    probes.push(Probe {
        dependency: Dependency::BlockStore,
        address: blocks.describe(),
        check: Arc::new(move || {
            let store = store.clone();
            Box::pin(async move { store.probe().await.map_err(|e| e.to_string()) })
        }),
    });
    if let Some(pool) = pool {
        let address = config
            .cluster
            .database_url
            .as_ref()
            .map(|url| endpoint_of(url.expose()))
            .unwrap_or_default();
        probes.push(Probe {
            dependency: Dependency::Postgres,
            address,
            check: Arc::new(move || {
                let pool = pool.clone();
                Box::pin(async move {
                    crate::storage::pg::connection::probe(&pool)
                        .await
                        .map_err(|e| e.to_string())
                })
            }),
        });
    }
    if let Some(redis) = &config.admission.redis {
        let admission = admission.clone();
        probes.push(Probe {
            dependency: Dependency::Redis,
            address: endpoint_of(&redis.url),
            check: Arc::new(move || {
                let admission = admission.clone();
                Box::pin(async move {
                    admission
                        .probe_coordinator()
                        .await
                        .unwrap_or(Ok(()))
                        .map_err(|e| e.to_string())
                })
            }),
        });
    }
    probes
}

/// Internal listener, control plane and peer feed of a cluster node.
async fn start_cluster_parts(
    state: &Arc<AppState>,
    tasks: &mut tasks::BackgroundTasks,
    root: ractor::ActorCell,
) -> Result<ClusterParts, StartError> {
    let config = &state.config;
    let token = config.control.internal_token.clone().ok_or_else(|| {
        StartError::Control("control.internal_token is required in cluster mode".into())
    })?;
    let listener = bind(config.control.internal_listen).await?;
    let internal_addr = local_addr(&listener, config.control.internal_listen)?;
    let stop = CancellationToken::new();
    let internal_state = internal::InternalState {
        token,
        epochs: state.cluster.clone(),
        ingest: Arc::new(state.uploads.clone()),
    };
    // Forwarded tus requests (http::tus_internal) share the listener and its checks.
    let tus_routes =
        crate::http::tus_internal::router(crate::http::tus_internal::TusInternalState {
            internal: internal_state.clone(),
            uploads: state.uploads.clone(),
            max_blob_size: config.upload.max_blob_size.bytes(),
        });
    let router = internal::router(internal_state).merge(tus_routes);
    let tls = if config.http.internal_tls.enabled() {
        Some(
            crate::edge::tls::internal_acceptor(&config.http.internal_tls)
                .map_err(StartError::Tls)?,
        )
    } else {
        None
    };
    let options = crate::edge::listener::ServeOptions {
        name: crate::edge::listener::INTERNAL,
        limits: config.http.internal_limits(),
        tls,
        metrics: state.edge.connections.clone(),
    };
    let internal = tokio::spawn(internal::serve_with(
        listener,
        router,
        options,
        stop.clone().cancelled_owned(),
    ));

    let options = ClusterOptions::from_config(state.node_id.clone(), &config.control)
        .map_err(|e| StartError::Control(e.to_string()))?;
    let handler = Arc::new(peers::NodeControl {
        app: state.clone(),
        internal_addr,
    });
    let control_tls = if config.http.internal_tls.enabled() {
        Some(crate::edge::tls::control_tls(&config.http.internal_tls).map_err(StartError::Tls)?)
    } else {
        None
    };
    // Linked under the node's supervisor; it restarts the plane, or gives up (below).
    let control = Arc::new(
        ClusterTransport::start_under(Some(root), options, handler, control_tls)
            .await
            .map_err(|e| StartError::Control(e.to_string()))?,
    );
    let (lost, readiness, stopped) = (control.lost(), state.readiness.clone(), stop.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = lost.cancelled() => {
                // Fence at once: not ready, so balancers stop sending; `run_until_signal`
                // then drains the shards (no new ingest for them) and exits non-zero.
                readiness.set(false);
                tracing::error!("the control plane is lost; this node stops");
            }
            _ = stopped.cancelled() => {}
        }
    });
    let transport: Arc<dyn ControlTransport> = control.clone();
    let (cluster, every) = (state.cluster.clone(), config.cluster.poll_interval.get());
    tasks.spawn("peer feed", move |stop| {
        peers::keep_peers_current(cluster.clone(), transport.clone(), every, stop)
    });
    let (cluster, sessions) = (state.cluster.clone(), state.sessions.clone());
    tasks.spawn("release of lost sessions", move |stop| {
        peers::release_lost_sessions(cluster.clone(), sessions.clone(), stop)
    });
    Ok(ClusterParts {
        internal,
        internal_addr,
        control,
        stop,
    })
}

impl RunningNode {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Address of the internal (owner-ingest) listener, in cluster mode.
    pub fn internal_addr(&self) -> Option<SocketAddr> {
        self.cluster_parts.as_ref().map(|p| p.internal_addr)
    }

    /// Address of the gRPC listener, when `[grpc] listen` is set.
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc.as_ref().map(|g| g.addr)
    }

    /// Graceful stop, bounded by `node.shutdown_grace` (plus the drain in cluster mode).
    pub async fn shutdown(mut self) -> ShutdownOutcome {
        let grace = self.state.config.node.shutdown_grace.get();
        if self.cluster_parts.is_some() {
            // Uploads in flight get the handoff grace to finish before their shards move.
            let handoff = self.state.config.cluster.handoff_grace.get() + Duration::from_secs(1);
            use crate::placement::DrainEnd;
            match self.state.cluster.drain_self(grace.max(handoff)).await {
                Ok(DrainEnd::Drained) => tracing::info!("shards drained to other nodes"),
                // Every node stopping together: nothing to hand over, nothing to wait for.
                Ok(DrainEnd::NoTarget) => tracing::info!(
                    "no other node can take shards (all draining or gone); stopping without a hand-over"
                ),
                Ok(DrainEnd::TimedOut) => {
                    tracing::warn!("drain did not complete before the grace period")
                }
                Err(err) => {
                    tracing::warn!(error = %err, "drain failed; shards move after the node TTL")
                }
            }
        }
        self.state.readiness.set(false);
        // One grace for both listeners (HTTP and gRPC drain at the same time).
        let deadline = tokio::time::Instant::now() + grace;
        self.stop_accepting.cancel();
        let outcome = match tokio::time::timeout(grace, &mut self.server).await {
            Ok(_) => ShutdownOutcome::Drained,
            Err(_) => {
                tracing::warn!(
                    ?grace,
                    "in-flight requests outlived the shutdown grace; aborting them"
                );
                self.server.abort();
                let _ = (&mut self.server).await;
                ShutdownOutcome::Aborted
            }
        };
        if let Some(mut grpc) = self.grpc.take() {
            // Accepting stopped with the public listener; calls in flight get the grace.
            if tokio::time::timeout_at(deadline, &mut grpc.server)
                .await
                .is_err()
            {
                tracing::warn!("gRPC calls outlived the shutdown grace; aborting them");
                grpc.server.abort();
            }
        }
        self.tasks.shutdown(grace).await;
        if let Some(parts) = self.cluster_parts.take() {
            parts.stop.cancel();
            let _ = tokio::time::timeout(grace, parts.internal).await;
            parts.control.shutdown().await;
        }
        self.state.cluster.shutdown().await;
        self.supervisor.shutdown().await;
        tracing::info!(?outcome, "graviton node stopped");
        outcome
    }

    /// Serve until SIGINT or SIGTERM, or until the control plane is lost for good, then
    /// shut down gracefully (the same drain either way).
    pub async fn run_until_signal(self) -> (StopCause, ShutdownOutcome) {
        let cause = self.wait_for_stop(wait_for_signal()).await;
        (cause, self.shutdown().await)
    }

    /// Wait for `signal`, or for the control plane to be lost (cluster mode).
    pub async fn wait_for_stop(&self, signal: impl std::future::Future<Output = ()>) -> StopCause {
        let lost = self.cluster_parts.as_ref().map(|p| p.control.lost());
        let lost = async move {
            match lost {
                Some(lost) => lost.cancelled_owned().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = signal => {
                tracing::info!("shutdown signal received; draining");
                StopCause::Signal
            }
            _ = lost => {
                tracing::error!("control plane lost; draining and exiting with status 1");
                StopCause::ControlPlaneLost
            }
        }
    }

    /// The root of the node's actor tree (diagnostics and fault tests walk it).
    pub fn actor_root(&self) -> ractor::ActorCell {
        self.supervisor.root()
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
