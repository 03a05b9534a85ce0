//! The error of a coordinator call: the server could not be used, or it answered
//! something the reply parser does not accept. Policy errors (timeouts, never-fitting
//! footprints, quotas) are decided by `admission`, not here.

use super::reply::ReplyError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoordinatorError {
    /// Redis could not be reached or failed; carries an error category only (`io`,
    /// `timeout`, `connection_refused`, ...), never a server message or connection detail.
    #[error("admission coordinator unavailable ({0})")]
    Unavailable(String),
    /// The script answered something unexpected.
    #[error(transparent)]
    Protocol(#[from] ReplyError),
}
