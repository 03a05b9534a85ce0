//! The configuration checks that read the local filesystem (never the network): every
//! file a key names exists and is readable, TLS material parses the way the listeners
//! will load it, S3 credentials can be resolved, and `storage.data_dir` is not a file.
//!
//! Run by the one loader ([`super::load::collect`]) for `serve` and `check-config` alike,
//! so a node never refuses at start what `check-config` passed. Only files that the
//! configuration in force would open are checked (the gRPC certificate only with
//! `grpc.listen`, the internal one only in cluster mode, and so on).

use std::path::Path;

use super::{Config, Problem};

/// Every filesystem problem of `config`.
pub fn problems(config: &Config) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut readable = |key: &'static str, path: &Option<std::path::PathBuf>| match path {
        Some(path) => match unreadable(path) {
            Some(why) => {
                problems.push(Problem::new(key, why));
                false
            }
            None => true,
        },
        None => true,
    };

    let dir = &config.storage.data_dir;
    let data_dir_ok = !dir.exists() || dir.is_dir();

    let cluster = config.cluster.enabled;
    let s3 = config.storage.backend_in(cluster) == crate::storage::config::Backend::S3;
    let credentials_ok = !s3
        || readable(
            "storage.s3.credentials_file",
            &config.storage.s3.credentials_file,
        );

    let tls = &config.http.tls;
    let public_tls = tls.enabled()
        && readable("http.tls.cert_file", &tls.cert_file)
            & readable("http.tls.key_file", &tls.key_file);
    let grpc_tls = config.grpc.listen.is_some()
        && config.grpc.tls.enabled()
        && readable("grpc.tls.cert_file", &config.grpc.tls.cert_file)
            & readable("grpc.tls.key_file", &config.grpc.tls.key_file);
    let itls = &config.http.internal_tls;
    let internal_tls = cluster
        && itls.enabled()
        && readable("http.internal_tls.cert_file", &itls.cert_file)
            & readable("http.internal_tls.key_file", &itls.key_file)
            & readable("http.internal_tls.ca_file", &itls.ca_file);
    // admission.redis.ca_file is checked with its section (it must exist there too).
    if config.auth.enabled {
        for issuer in &config.auth.issuers {
            readable("auth.issuers.jwks_file", &issuer.jwks_file);
        }
    }

    if !data_dir_ok {
        problems.push(Problem::new(
            "storage.data_dir",
            format!("{} exists and is not a directory", dir.display()),
        ));
    }
    if s3
        && credentials_ok
        && let Err(err) = crate::storage::pack::s3::credentials(&config.storage.s3)
    {
        problems.push(Problem::new("storage.s3.credentials_file", err.to_string()));
    }
    // The listeners' own builders, so a certificate that does not parse fails here too.
    if public_tls && let Err(err) = crate::edge::tls::public_acceptor(tls) {
        problems.push(Problem::new("http.tls", err));
    }
    if grpc_tls && let Err(err) = crate::edge::tls::grpc_acceptor(&config.grpc.tls) {
        problems.push(Problem::new("grpc.tls", err));
    }
    if internal_tls && let Err(err) = crate::edge::tls::internal_acceptor(itls) {
        problems.push(Problem::new("http.internal_tls", err));
    }
    problems
}

/// Why `path` cannot be read as a file, or `None` when it can.
fn unreadable(path: &Path) -> Option<String> {
    let shown = path.display();
    match std::fs::metadata(path) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            Some(format!("{shown}: no such file"))
        }
        Err(err) => Some(format!("{shown}: {err}")),
        Ok(meta) if meta.is_dir() => Some(format!("{shown} is a directory, not a file")),
        Ok(_) => match std::fs::File::open(path) {
            Ok(_) => None,
            Err(err) => Some(format!("{shown}: cannot be read ({err})")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(config: &Config) -> Vec<&'static str> {
        problems(config).into_iter().map(|p| p.key).collect()
    }

    #[test]
    fn the_defaults_need_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::for_test(dir.path());
        assert!(keys(&config).is_empty(), "{:?}", problems(&config));
    }

    // Checks OPS-7.
    #[test]
    fn a_missing_or_unreadable_file_names_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::for_test(dir.path());
        config.storage.backend = Some(crate::storage::config::Backend::S3);
        config.storage.s3.bucket = "b".into();
        config.storage.s3.credentials_file = Some(dir.path().join("missing"));
        config.http.tls.cert_file = Some(dir.path().to_path_buf());
        config.http.tls.key_file = Some(dir.path().join("key.pem"));
        let found = problems(&config);
        let keys: Vec<_> = found.iter().map(|p| p.key).collect();
        assert_eq!(
            keys,
            [
                "storage.s3.credentials_file",
                "http.tls.cert_file",
                "http.tls.key_file"
            ],
            "{found:?}"
        );
        assert!(found[0].message.contains("no such file"), "{found:?}");
        assert!(found[1].message.contains("is a directory"), "{found:?}");
    }

    #[test]
    fn credentials_that_cannot_be_resolved_are_a_problem_and_a_file_resolves_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::for_test(dir.path());
        config.storage.backend = Some(crate::storage::config::Backend::S3);
        config.storage.s3.bucket = "b".into();
        let file = dir.path().join("s3.cred");
        std::fs::write(&file, "access_key_id=GK1\n").unwrap();
        config.storage.s3.credentials_file = Some(file.clone());
        // With a key id but no secret: unless the process has AWS_SECRET_ACCESS_KEY.
        if std::env::var_os("AWS_SECRET_ACCESS_KEY").is_none() {
            assert_eq!(keys(&config), ["storage.s3.credentials_file"]);
        }
        std::fs::write(&file, "access_key_id=GK1\nsecret_access_key=s3cr3t-value\n").unwrap();
        assert!(keys(&config).is_empty(), "{:?}", problems(&config));
        // A problem never shows the secret.
        std::fs::write(&file, "secret_access_key=s3cr3t-value\n").unwrap();
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
            let found = problems(&config);
            assert_eq!(found.len(), 1);
            assert!(!found[0].message.contains("s3cr3t"), "{found:?}");
        }
    }

    #[test]
    fn tls_material_that_does_not_parse_is_refused_as_the_listener_would() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::for_test(dir.path());
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        std::fs::write(&cert, "not a certificate").unwrap();
        std::fs::write(&key, "not a key").unwrap();
        config.http.tls.cert_file = Some(cert.clone());
        config.http.tls.key_file = Some(key.clone());
        assert_eq!(keys(&config), ["http.tls"]);
        // gRPC TLS is only loaded with a gRPC listener.
        config.http.tls = Default::default();
        config.grpc.tls.cert_file = Some(cert);
        config.grpc.tls.key_file = Some(key);
        assert!(keys(&config).is_empty());
        config.grpc.listen = Some("127.0.0.1:0".parse().unwrap());
        assert_eq!(keys(&config), ["grpc.tls"]);
    }

    #[test]
    fn a_data_dir_that_is_a_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain");
        std::fs::write(&file, "x").unwrap();
        let config = Config::for_test(&file);
        assert_eq!(keys(&config), ["storage.data_dir"]);
    }
}
