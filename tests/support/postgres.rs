//! A fresh PostgreSQL database per test.

use sqlx::{Connection, Executor, PgConnection};

/// Default admin URL when `GRAVITON_TEST_DATABASE_URL` is unset.
pub const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A database created for one test and dropped (with `FORCE`) when the value is dropped.
pub struct TestDatabase {
    admin_url: String,
    name: String,
    url: String,
}

impl TestDatabase {
    /// Create `graviton_test_<random>` on the server, or `None` (loud skip) if unreachable.
    /// Panics instead of skipping when `GRAVITON_REQUIRE_SERVICES=1`.
    pub async fn create(test: &str) -> Option<Self> {
        let admin_url = std::env::var("GRAVITON_TEST_DATABASE_URL")
            .unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_string());
        Self::create_on(test, &admin_url).await
    }

    /// [`TestDatabase::create`] on the server of `admin_url` (a private server, say).
    pub async fn create_on(test: &str, admin_url: &str) -> Option<Self> {
        let admin_url = admin_url.to_string();
        let mut admin = match PgConnection::connect(&admin_url).await {
            Ok(conn) => conn,
            Err(err) => {
                super::missing_service(test, &format!("PostgreSQL unreachable: {err}"));
                return None;
            }
        };
        let name = format!("graviton_test_{}", super::unique_suffix());
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("create test database");
        let _ = admin.close().await;
        let url = replace_database(&admin_url, &name);
        Some(Self {
            admin_url,
            name,
            url,
        })
    }

    /// Connection URL of the test database.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        // Drop runs outside any async context we can rely on: use a private runtime on a thread.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(mut admin) = PgConnection::connect(&admin_url).await {
                    let _ = admin
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}

/// Swap the database name (last path segment) of a PostgreSQL URL.
fn replace_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match base[scheme_end..].rfind('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{database}?{query}"),
        None => format!("{base}/{database}"),
    }
}
