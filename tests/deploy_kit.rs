//! The deployment kit under deploy/ validates: `scripts/check-deploy` runs the schema
//! validators (kubernetes-validate, compose-spec), promtool on the alert rules,
//! systemd-analyze on the unit, `graviton check-config` on every configuration, and checks
//! that every metric of the Grafana dashboard and the alert rules is exported by a live
//! node started from this build.

mod support;

use std::process::Command;

#[test]
fn deploy_kit_validates_against_schemas_promtool_and_a_live_node() {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = Command::new(format!("{root}/scripts/check-deploy"))
        .arg(env!("CARGO_BIN_EXE_graviton"))
        .current_dir(root)
        .output()
        .expect("run scripts/check-deploy");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    match output.status.code() {
        Some(0) => {
            assert!(
                stderr.contains("check-deploy: ok"),
                "the script did not reach its end:\n{stderr}"
            );
            assert!(
                stderr.contains("metrics; all exported"),
                "the dashboard check did not run:\n{stderr}"
            );
        }
        Some(3) => support::missing_service(
            "deploy_kit",
            &format!("a validation tool could not be installed:\n{stderr}"),
        ),
        code => panic!("scripts/check-deploy failed ({code:?}):\n{stdout}\n{stderr}"),
    }
}
