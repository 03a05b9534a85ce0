//! `[control]`: the node-to-node control plane and the internal (owner ingest) listener.
//!
//! Owns only the shape, defaults and validation of the section. The token is a
//! [`Secret`]: it authenticates ractor_cluster sessions (as the magic cookie) and
//! forwarded uploads (as `X-Graviton-Internal-Token`), and it never prints.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::values::HumanDuration;
use crate::values::Problem;
use crate::values::Secret;

/// Default internal (owner ingest) HTTP listener.
pub const INTERNAL_LISTEN_DEFAULT: &str = "127.0.0.1:7071";
/// Default ractor_cluster control listener.
pub const CONTROL_LISTEN_DEFAULT: &str = "127.0.0.1:7072";
/// Shortest accepted internal token.
pub const TOKEN_MIN_LEN: usize = 32;
/// Longest accepted internal token.
pub const TOKEN_MAX_LEN: usize = 256;

/// `[control]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlConfig {
    /// Internal HTTP listener (owner ingest of forwarded uploads). Private network only.
    /// Peers learn the address to use from the node table (`cluster.internal_addr`).
    pub internal_listen: SocketAddr,
    /// ractor_cluster `NodeServer` listener. Private network only.
    pub control_listen: SocketAddr,
    /// Shared node token (32..=256 of `A-Z a-z 0-9 . _ ~ -`). Required in cluster mode.
    pub internal_token: Option<Secret>,
    /// First re-dial delay after a peer session drops (doubles, with jitter).
    pub dial_backoff_min: HumanDuration,
    /// Ceiling of the re-dial delay.
    pub dial_backoff_max: HumanDuration,
    /// Deadline of one control call (resolve, activate) to a peer.
    pub call_timeout: HumanDuration,
    /// Connect timeout of the forwarding client.
    pub forward_connect_timeout: HumanDuration,
    /// Per-read idle timeout of the forwarding client (no total deadline by design).
    pub forward_read_timeout: HumanDuration,
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            internal_listen: INTERNAL_LISTEN_DEFAULT.parse().expect("valid default"),
            control_listen: CONTROL_LISTEN_DEFAULT.parse().expect("valid default"),
            internal_token: None,
            dial_backoff_min: HumanDuration::millis(100),
            dial_backoff_max: HumanDuration::secs(10),
            call_timeout: HumanDuration::secs(2),
            forward_connect_timeout: HumanDuration::secs(2),
            forward_read_timeout: HumanDuration::secs(60),
        }
    }
}

/// True when `token` has an accepted length and only URL-safe characters.
pub fn token_is_well_formed(token: &str) -> bool {
    (TOKEN_MIN_LEN..=TOKEN_MAX_LEN).contains(&token.len())
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-'))
}

impl ControlConfig {
    /// Validation problems of this section. `cluster_mode` is the node's cluster switch
    /// (`cluster.enabled`): the token and distinct listeners are required only then.
    /// Messages never echo the token.
    pub fn problems_in(&self, cluster_mode: bool) -> Vec<Problem> {
        let mut problems = Vec::new();
        match &self.internal_token {
            None if cluster_mode => problems.push(Problem::new(
                "control.internal_token",
                "is required in cluster mode (cluster.enabled = true)",
            )),
            Some(token) if !token_is_well_formed(token.expose()) => problems.push(Problem::new(
                "control.internal_token",
                format!(
                    "must be {TOKEN_MIN_LEN} to {TOKEN_MAX_LEN} characters of A-Z, a-z, 0-9, '.', '_', '~', '-'"
                ),
            )),
            _ => {}
        }
        if cluster_mode && self.internal_listen == self.control_listen {
            problems.push(Problem::new(
                "control.control_listen",
                "must differ from control.internal_listen",
            ));
        }
        if self.dial_backoff_min.get().is_zero() {
            problems.push(Problem::new(
                "control.dial_backoff_min",
                "must be greater than zero",
            ));
        }
        if self.dial_backoff_max.get() < self.dial_backoff_min.get() {
            problems.push(Problem::new(
                "control.dial_backoff_max",
                "must be at least control.dial_backoff_min",
            ));
        }
        for (key, value) in [
            ("control.call_timeout", self.call_timeout),
            (
                "control.forward_connect_timeout",
                self.forward_connect_timeout,
            ),
            ("control.forward_read_timeout", self.forward_read_timeout),
        ] {
            if value.get().is_zero() {
                problems.push(Problem::new(key, "must be greater than zero"));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "abcdefghijklmnopqrstuvwxyz012345-._~";

    #[test]
    fn defaults_are_valid_outside_cluster_mode() {
        assert!(ControlConfig::default().problems_in(false).is_empty());
    }

    #[test]
    fn cluster_mode_requires_a_token() {
        let config = ControlConfig::default();
        let problems = config.problems_in(true);
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].key, "control.internal_token");
        let config = ControlConfig {
            internal_token: Some(Secret::new(GOOD)),
            ..config
        };
        assert!(
            config.problems_in(true).is_empty(),
            "{:?}",
            config.problems_in(true)
        );
    }

    #[test]
    fn malformed_tokens_are_rejected_without_echo() {
        for bad in [
            "short",
            &"a".repeat(257),
            &format!("{}+", &GOOD[..32]),
            &format!("{} ", &GOOD[..32]),
        ] {
            let config = ControlConfig {
                internal_token: Some(Secret::new(bad)),
                ..ControlConfig::default()
            };
            let problems = config.problems_in(false);
            assert_eq!(problems.len(), 1, "{bad:?}");
            assert!(!problems[0].message.contains(bad));
        }
        assert!(token_is_well_formed(&"x".repeat(32)));
        assert!(token_is_well_formed(&"x".repeat(256)));
    }

    #[test]
    fn backoff_bounds_are_checked() {
        let config = ControlConfig {
            dial_backoff_min: HumanDuration::secs(5),
            dial_backoff_max: HumanDuration::secs(1),
            ..ControlConfig::default()
        };
        assert_eq!(config.problems_in(false)[0].key, "control.dial_backoff_max");
    }

    #[test]
    fn the_section_parses_from_toml_with_human_units_and_never_prints_the_token() {
        let config = crate::config::Config::from_toml_str(&format!(
            "[control]\ninternal_listen = \"10.0.0.5:7071\"\ninternal_token = \"{GOOD}\"\n\
             call_timeout = \"750ms\"\ndial_backoff_max = \"30s\"\n"
        ))
        .unwrap();
        assert_eq!(config.control.internal_listen.port(), 7071);
        assert_eq!(config.control.call_timeout.get().as_millis(), 750);
        assert!(
            config
                .control
                .internal_token
                .as_ref()
                .unwrap()
                .matches(GOOD.as_bytes())
        );
        assert!(!format!("{config:?}").contains(GOOD));
        let err = crate::config::Config::from_toml_str("[control]\ncall_timeout = \"soon\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("control.call_timeout"), "{err}");
    }
}
