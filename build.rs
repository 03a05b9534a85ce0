fn main() {
    // sqlx::migrate!("./sql") embeds the migrations; rebuild when one is added or changed.
    println!("cargo:rerun-if-changed=sql");
}
