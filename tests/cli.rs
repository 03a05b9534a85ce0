//! The `graviton` binary as a real process: serve on the embedded default, put, get,
//! check-config, SIGTERM.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::node::random_bytes;
use support::process::{BIN, Graviton, Ports, isolated_command};

/// `graviton serve` on `dir/data` (its log `dir/serve.log`), listening when it returns.
fn serve(dir: &Path) -> Graviton {
    let data = dir.join("data");
    let mut server = Graviton::serve_listen(dir.join("serve.log"), |command| {
        command
            .arg("--data-dir")
            .arg(&data)
            .env_remove("GRAVITON_CONFIG");
    });
    server.wait_listening(Duration::from_secs(20));
    server
}

#[test]
fn put_then_get_through_the_cli_is_verified_and_deduplicated() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path());
    let file = dir.path().join("input.bin");
    let data = random_bytes(3 << 20, 21);
    std::fs::write(&file, &data).unwrap();

    let put = Command::new(BIN)
        .args(["put", "--server", &server.url])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
    let key = String::from_utf8(put.stdout).unwrap().trim().to_string();
    assert_eq!(key, graviton::cas::BlobKey::of(&data).to_string());
    assert!(String::from_utf8_lossy(&put.stderr).contains("new"));

    let again = Command::new(BIN)
        .args(["put", "--server", &server.url])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("(0 new"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    let out = dir.path().join("output.bin");
    let get = Command::new(BIN)
        .args(["get", "--server", &server.url, &key, "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        get.status.success(),
        "{}",
        String::from_utf8_lossy(&get.stderr)
    );
    assert!(std::fs::read(&out).unwrap() == data);

    // An unknown key fails loudly and writes nothing.
    let missing = graviton::cas::BlobKey::of(b"missing").to_string();
    let nothing = dir.path().join("nothing.bin");
    let get = Command::new(BIN)
        .args(["get", "--server", &server.url, &missing, "-o"])
        .arg(&nothing)
        .output()
        .unwrap();
    assert!(!get.status.success());
    assert!(String::from_utf8_lossy(&get.stderr).contains("blob_not_found"));
    assert!(!nothing.exists());
}

/// `graviton serve --config` with `extra` TOML appended to a minimal file, listening
/// when it returns.
fn serve_with(dir: &Path, extra: &str) -> Graviton {
    let config = dir.join("node.toml");
    let text = |ports: Ports| {
        format!(
            "[node]\nlisten = \"{}\"\n[storage]\ndata_dir = \"{}\"\nfsync = false\n{extra}",
            ports.listen(),
            dir.join("data").display()
        )
    };
    let mut server = Graviton::serve_config(dir.join("serve.log"), &config, text, |command| {
        command.env_remove("GRAVITON_CONFIG");
    });
    server.wait_listening(Duration::from_secs(20));
    server
}

/// Run `graviton put` of `file` against `url` three times; each must fail printing
/// `expected` and never a lost answer.
fn refused_put_prints(url: &str, file: &std::path::Path, expected: &[&str]) {
    for _ in 0..3 {
        let put = Command::new(BIN)
            .args(["put", "--server", url])
            .arg(file)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&put.stderr);
        assert!(!put.status.success(), "{stderr}");
        for expected in expected {
            assert!(
                stderr.contains(expected),
                "{expected:?} missing from: {stderr}"
            );
        }
        assert!(
            !stderr.contains("Broken pipe") && !stderr.contains("reset"),
            "the answer was lost: {stderr}"
        );
    }
}

// Checks OPS-6.
#[test]
fn a_refused_put_prints_the_servers_status_code_message_and_retry_after() {
    let dir = tempfile::tempdir().unwrap();
    // Large enough that the client is still sending when the answer comes.
    let file = dir.path().join("input.bin");
    std::fs::write(&file, random_bytes(32 << 20, 7)).unwrap();

    // Refused at once, from the declared length, before the body is read.
    let small = dir.path().join("small");
    std::fs::create_dir(&small).unwrap();
    let server = serve_with(&small, "[upload]\nmax_blob_size = \"1MiB\"\n");
    refused_put_prints(
        &server.url,
        &file,
        &["413", "blob_too_large", "upload.max_blob_size"],
    );
    drop(server);

    // Admission fails closed while its Redis does not answer: 503 admission_unavailable
    // with Retry-After, before the body is read.
    let dead = support::free_port();
    let closed = dir.path().join("closed");
    std::fs::create_dir(&closed).unwrap();
    let server = serve_with(
        &closed,
        &format!("[admission.redis]\nurl = \"redis://127.0.0.1:{dead}/\"\n"),
    );
    refused_put_prints(
        &server.url,
        &file,
        &["503", "admission_unavailable", "Retry-After: "],
    );
}

#[test]
fn put_help_says_tenant_and_session_are_uuids() {
    let help = Command::new(BIN).args(["put", "--help"]).output().unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--tenant <TENANT_UUID>"), "{text}");
    assert!(text.contains("--session <SESSION_UUID>"), "{text}");
}

#[test]
fn sigterm_stops_the_server_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = serve(dir.path());
    // Ready, not only listening: the node installs its SIGTERM handler after its listeners
    // accept (a SIGTERM in between ends it by the signal; seen under load).
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(server.ready(Duration::from_secs(20)));
    // SIGTERM, then the exit is awaited (SIGKILL after 30 s, which fails the assertion).
    let status = server.terminate().expect("the server was running");
    assert!(
        status.success(),
        "exit status {status} (SIGTERM ignored?):\n{}",
        server.log_text()
    );
}

#[test]
fn check_config_names_the_offending_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[node]\nlisten = \"127.0.0.1:9000\"\n[upload]\nmax_blob_size = \"10GiB\"\n",
    )
    .unwrap();
    let ok = Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[sessions]\nidle_timeout = \"soon\"\n").unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("sessions.idle_timeout"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let missing = Command::new(BIN)
        .args(["check-config", "--config", "/nonexistent/graviton.toml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no such file"));
}

#[test]
fn environment_overrides_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.toml");
    std::fs::write(&file, "[sessions]\nmax_hot = 10\n").unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(&file)
        .env("GRAVITON_SESSIONS__MAX_HOT", "0")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sessions.max_hot"));
}

/// `graviton check-config` with `args`, no inherited `GRAVITON_*` configuration, plus
/// `env`: (exit code, stderr).
fn check_config(args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = isolated_command();
    command.arg("check-config").args(args);
    for (name, value) in env {
        command.env(name, value);
    }
    let out = command.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

// Checks OPS-7.
#[test]
fn check_config_reports_every_mistake_in_one_run_with_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("three.toml");
    // Three mistakes: an unknown key, a value that does not parse, a value out of range;
    // and a fourth, an unknown key set by an environment variable.
    std::fs::write(
        &file,
        "[node]\nlisten_typo = \"127.0.0.1:9000\"\n[upload]\nmax_blob_size = \"lots\"\n[sessions]\nmax_hot = 0\n",
    )
    .unwrap();
    let (code, stderr) = check_config(
        &["--config".as_ref(), file.as_os_str()],
        &[("GRAVITON_STORAGE__BOGUS", "1")],
    );
    assert_eq!(code, Some(2), "{stderr}");
    let shown = file.display().to_string();
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("  - ")).collect();
    assert_eq!(lines.len(), 4, "{stderr}");
    for key in [
        "node.listen_typo",
        "upload.max_blob_size",
        "sessions.max_hot",
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("{key} (in {shown})"))),
            "{key} not blamed on the file: {stderr}"
        );
    }
    assert!(
        lines.iter().any(
            |l| l.contains("storage.bogus (from environment variable GRAVITON_STORAGE__BOGUS)")
        ),
        "unknown env key not blamed on its variable: {stderr}"
    );
}

#[test]
fn check_config_runs_without_a_file_and_with_an_empty_one() {
    let (code, stderr) = check_config(&[], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = check_config(&[], &[("GRAVITON_SESSIONS__MAX_HOT", "0")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("sessions.max_hot (from environment variable GRAVITON_SESSIONS__MAX_HOT)"),
        "{stderr}"
    );
    let (code, stderr) = check_config(&["--config".as_ref(), "/dev/null".as_ref()], &[]);
    assert_eq!(code, Some(0), "{stderr}");
}

/// What `serve` and `check-config` refuse is the same: a host name as
/// `cluster.internal_addr` and a `storage.s3.credentials_file` that does not exist.
// Checks OPS-7.
#[test]
fn check_config_refuses_what_serve_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    std::fs::write(
        &file,
        format!(
            "[cluster]\nenabled = true\ndatabase_url = \"postgres://graviton@127.0.0.1:1/graviton\"\ninternal_addr = \"localhost:7071\"\n\
             [control]\ninternal_token = \"test-internal-token-0123456789abcdefghijkl\"\n\
             [storage]\ndata_dir = \"{}\"\n[storage.s3]\nbucket = \"packs\"\nendpoint = \"http://127.0.0.1:1\"\ncredentials_file = \"{}\"\n",
            dir.path().join("data").display(),
            dir.path().join("missing.cred").display()
        ),
    )
    .unwrap();
    let (code, checked) = check_config(&["--config".as_ref(), file.as_os_str()], &[]);
    assert_eq!(code, Some(2), "{checked}");
    let mut serve = isolated_command();
    serve.arg("serve").arg("--config").arg(&file);
    let served = serve.output().unwrap();
    let served_err = String::from_utf8_lossy(&served.stderr);
    assert_eq!(served.status.code(), Some(1), "{served_err}");
    for key in ["cluster.internal_addr", "storage.s3.credentials_file"] {
        assert!(checked.contains(key), "check-config: {key}: {checked}");
        assert!(served_err.contains(key), "serve: {key}: {served_err}");
    }
    // Those two and nothing else, in both.
    let problems = |text: &str| text.lines().filter(|l| l.starts_with("  - ")).count();
    assert_eq!(problems(&checked), 2, "{checked}");
    assert_eq!(problems(&served_err), 2, "{served_err}");
    // serve refused before touching the network: no PostgreSQL error.
    assert!(!served_err.contains("PostgreSQL"), "{served_err}");
}
