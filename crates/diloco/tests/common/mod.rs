//! What the multi-process DiLoCo tests share: the S3 test server's address and credentials.

use std::process::Command;

/// Points a replica process at the S3 test server (the credentials start-server.sh accepts).
pub fn s3_env(cmd: &mut Command, endpoint: &str) {
    cmd.env("AWS_ENDPOINT", endpoint)
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test");
}

/// The S3 test server: `S3_ENDPOINT`, else `AWS_ENDPOINT`. Unset: fails under CI, else SKIPPED.
pub fn s3_endpoint() -> Option<String> {
    let endpoint = ["S3_ENDPOINT", "AWS_ENDPOINT"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()));
    if endpoint.is_none() {
        if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false") {
            panic!(
                "S3_ENDPOINT / AWS_ENDPOINT not set but CI is: start ../shared/s3/start-server.sh"
            );
        }
        eprintln!(
            "SKIPPED: S3_ENDPOINT / AWS_ENDPOINT not set (start /work/shared/s3/start-server.sh)"
        );
    }
    endpoint
}

/// A fresh S3 prefix in the test bucket, unique per process and call.
pub fn s3_url(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("s3://composer-rl/{name}-{}-{nanos}", std::process::id())
}
