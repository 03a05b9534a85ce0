//! Coalescing of one node's concurrent acquires and releases into one script call.
//!
//! Every acquire attempt and every release of a [`super::RedisCoordinator`] is queued to
//! one background task. The task takes whatever is queued (at most [`MAX_BATCH`] items)
//! and sends it as one `batch` call of `lua/admission.lua`; while that call is in flight,
//! new items queue up for the next one (group commit), with at most `in_flight` calls
//! outstanding. Abandons use the same queue, so an abandon is applied after any acquire
//! of its lease id that was queued before it (a caller that gave up while its attempt
//! was still queued leaks nothing). Each item gets exactly its own reply, in order. The script runs each item
//! with the same logic as the single-item ops, atomically, appending the same events, so
//! batching changes the cost, not the semantics.
//!
//! A failed call (I/O, timeout after the retries of idempotent calls) fails every item of
//! that batch with the same [`Error`]. Acquire is idempotent on its lease id and release
//! answers `MISSING` when repeated, so the retry of a whole batch is safe.

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::connection::Connection;
use super::error::CoordinatorError as Error;
use super::script::SCRIPT;

/// Most items in one script call.
pub const MAX_BATCH: usize = 64;
/// Batch calls outstanding at once by default (`admission.redis.batch_in_flight`). A batch that carries an abandon waits until every
/// earlier call has finished, so an abandon never overtakes the acquire it cancels
/// (releases need no such care: one is only sent after its acquire was answered).
pub const DEFAULT_IN_FLIGHT: usize = 4;

/// One queued operation, already encoded as script arguments.
#[derive(Debug, Clone)]
pub enum BatchItem {
    Acquire {
        lease_id: String,
        tenant: String,
        backend: String,
        bytes: u64,
        operation: &'static str,
        first: bool,
    },
    Release {
        lease_id: String,
        token: u64,
        outcome: &'static str,
    },
    /// Abandon goes through the same queue so it is never sent before an acquire of the
    /// same lease id that is still queued.
    Abandon {
        lease_id: String,
        tenant: String,
        backend: String,
        bytes: u64,
        operation: &'static str,
        dimension: &'static str,
        /// `timed_out` or `abandoned` (the caller went away while waiting).
        kind: &'static str,
    },
}

struct Job {
    item: BatchItem,
    reply: oneshot::Sender<Result<Vec<String>, Error>>,
}

/// What the batch task needs to build and send a call.
pub struct BatchContext {
    pub conn: Connection,
    /// Calls outstanding at once, at least 1.
    pub in_flight: usize,
    pub keys: Vec<String>,
    /// `ARGV[2]`, `ARGV[3]`: stream MAXLEN and reap batch.
    pub common: [String; 2],
    /// `ARGV[5..11]`: the acquire defaults and timings.
    pub defaults: [String; 7],
}

/// The sending side; the task stops when it is dropped.
pub struct Batcher {
    tx: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Spawn the batch task on the current tokio runtime.
    pub fn spawn(context: BatchContext) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(Arc::new(context), rx));
        Self { tx }
    }

    /// Queue `item` and wait for its own reply.
    pub async fn submit(&self, item: BatchItem) -> Result<Vec<String>, Error> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Job { item, reply })
            .map_err(|_| Error::Unavailable("batcher_stopped".into()))?;
        answer
            .await
            .map_err(|_| Error::Unavailable("batcher_stopped".into()))?
    }
}

async fn run(context: Arc<BatchContext>, mut rx: mpsc::UnboundedReceiver<Job>) {
    let slots = Arc::new(Semaphore::new(context.in_flight));
    loop {
        let Ok(mut slot) = slots.clone().acquire_many_owned(1).await else {
            return;
        };
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut jobs = vec![first];
        while jobs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        if jobs
            .iter()
            .any(|j| matches!(j.item, BatchItem::Abandon { .. }))
        {
            // Drain: wait until the other calls in flight have been answered.
            let Ok(rest) = slots
                .clone()
                .acquire_many_owned(context.in_flight as u32 - 1)
                .await
            else {
                return;
            };
            slot.merge(rest);
        }
        let context = context.clone();
        tokio::spawn(async move {
            let replies = call(&context, &jobs).await;
            dispatch(jobs, replies);
            drop(slot);
        });
    }
}

fn invocation(context: &BatchContext, jobs: &[Job]) -> redis::Cmd {
    let mut inv = SCRIPT.call(context.keys.iter().map(String::as_str));
    inv.arg("batch")
        .arg(&context.common[0])
        .arg(&context.common[1])
        .arg(jobs.len());
    for value in &context.defaults {
        inv.arg(value);
    }
    for job in jobs {
        match &job.item {
            BatchItem::Acquire {
                lease_id,
                tenant,
                backend,
                bytes,
                operation,
                first,
            } => {
                inv.arg("A")
                    .arg(lease_id)
                    .arg(tenant)
                    .arg(backend)
                    .arg(*bytes)
                    .arg(*operation)
                    .arg(if *first { "1" } else { "0" });
            }
            BatchItem::Release {
                lease_id,
                token,
                outcome,
            } => {
                inv.arg("R").arg(lease_id).arg(*token).arg(*outcome);
            }
            BatchItem::Abandon {
                lease_id,
                tenant,
                backend,
                bytes,
                operation,
                dimension,
                kind,
            } => {
                inv.arg("X")
                    .arg(lease_id)
                    .arg(tenant)
                    .arg(backend)
                    .arg(*bytes)
                    .arg(*operation)
                    .arg(*dimension)
                    .arg(*kind);
            }
        }
    }
    inv
}

async fn call(context: &BatchContext, jobs: &[Job]) -> Result<Vec<Vec<String>>, Error> {
    let inv = invocation(context, jobs);
    let reply: redis::Value = super::coordinator::invoke(&context.conn, &inv, true).await?;
    let replies: Vec<Vec<String>> = redis::from_redis_value(reply)
        .map_err(|_| Error::Unavailable("unexpected_reply".into()))?;
    if replies.len() != jobs.len() {
        return Err(Error::Unavailable("unexpected_reply".into()));
    }
    Ok(replies)
}

fn dispatch(jobs: Vec<Job>, replies: Result<Vec<Vec<String>>, Error>) {
    match replies {
        Ok(replies) => {
            for (job, reply) in jobs.into_iter().zip(replies) {
                let _ = job.reply.send(Ok(reply));
            }
        }
        Err(err) => {
            for job in jobs {
                let _ = job.reply.send(Err(err.clone()));
            }
        }
    }
}
