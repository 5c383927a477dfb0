//! Opening stores from URLs, the key layout, and store calls with bounded retries.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreScheme, PutMode, PutOptions, RetryConfig};
use url::Url;

/// Opens the store named by `url` and returns it with the key prefix inside it.
///
/// | URL | store |
/// |-----|-------|
/// | `file:///abs/dir` or a plain path | local folder (created if missing); prefix empty |
/// | `s3://bucket/prefix` | S3 or S3-compatible; settings from `AWS_*` env vars (`AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) |
/// | `memory://` | in-process memory (tests) |
/// | `gs://bucket/prefix` | Google Cloud Storage: needs object_store feature `gcp` (not compiled in) |
/// | `az://container/prefix`, `abfs[s]://…`, `https://<acct>.blob.core.windows.net/…` | Azure Blob: needs feature `azure` (not compiled in) |
///
/// Store-level retries of the S3 client are disabled: the replica retries every call itself
/// with its configured bounded back-off, so an unreachable store fails in bounded time.
pub async fn open_store(url: &str) -> Result<(Arc<dyn ObjectStore>, Path)> {
    let parsed = match Url::parse(url) {
        Ok(u) => u,
        Err(url::ParseError::RelativeUrlWithoutBase) => {
            return open_folder(std::path::Path::new(url));
        }
        Err(e) => bail!("diloco store URL {url:?}: {e}"),
    };
    let (scheme, path) =
        ObjectStoreScheme::parse(&parsed).map_err(|e| anyhow!("diloco store URL {url:?}: {e}"))?;
    let prefix = Path::parse(path).map_err(|e| anyhow!("diloco store URL {url:?}: {e}"))?;
    match scheme {
        ObjectStoreScheme::Local => {
            let dir = parsed
                .to_file_path()
                .map_err(|_| anyhow!("diloco store URL {url:?}: not a local path"))?;
            open_folder(&dir)
        }
        ObjectStoreScheme::Memory => Ok((Arc::new(InMemory::new()), prefix)),
        ObjectStoreScheme::AmazonS3 => {
            let retry = RetryConfig {
                max_retries: 0,
                retry_timeout: Duration::from_secs(30),
                ..Default::default()
            };
            let store = AmazonS3Builder::from_env()
                .with_url(url)
                .with_retry(retry)
                .build()
                .with_context(|| format!("diloco store URL {url:?}: configuring S3"))?;
            Ok((Arc::new(store), prefix))
        }
        ObjectStoreScheme::GoogleCloudStorage => bail!(
            "diloco store URL {url:?}: Google Cloud Storage needs object_store's `gcp` feature, \
             which this build does not enable (add features = [\"aws\", \"gcp\"])"
        ),
        ObjectStoreScheme::MicrosoftAzure => bail!(
            "diloco store URL {url:?}: Azure Blob Storage needs object_store's `azure` feature, \
             which this build does not enable (add features = [\"aws\", \"azure\"])"
        ),
        other => bail!("diloco store URL {url:?}: unsupported store {other:?}"),
    }
}

fn open_folder(dir: &std::path::Path) -> Result<(Arc<dyn ObjectStore>, Path)> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating diloco store folder {}", dir.display()))?;
    let fs = LocalFileSystem::new_with_prefix(dir)
        .with_context(|| format!("opening diloco store folder {}", dir.display()))?;
    Ok((Arc::new(fs), Path::default()))
}

/// Keys of one DiLoCo run under a prefix (see the crate README for the layout).
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: Path,
}

impl Keys {
    /// Keys under `prefix`.
    pub fn new(prefix: Path) -> Self {
        Self { prefix }
    }
    fn child(&self, rel: &str) -> Path {
        let mut p = self.prefix.clone();
        for part in rel.split('/') {
            p = p.child(part);
        }
        p
    }
    /// `{prefix}/init.safetensors`: round-0 weights, first writer wins.
    pub fn init(&self) -> Path {
        self.child("init.safetensors")
    }
    /// `{prefix}/round-{r:06}/frag-{f}`.
    pub fn round_dir(&self, round: u64, fragment: usize) -> Path {
        self.child(&format!("round-{round:06}/frag-{fragment}"))
    }
    /// Folder of a round's pseudo-gradients.
    pub fn delta_dir(&self, round: u64, fragment: usize) -> Path {
        self.round_dir(round, fragment).child("delta")
    }
    /// `{prefix}/round-{r:06}/frag-{f}/delta/replica-{id}.safetensors`.
    pub fn delta(&self, round: u64, fragment: usize, replica: &str) -> Path {
        self.delta_dir(round, fragment)
            .child(format!("replica-{replica}.safetensors"))
    }
    /// `{prefix}/round-{r:06}/frag-{f}/closed.json`: the round's membership.
    pub fn closed(&self, round: u64, fragment: usize) -> Path {
        self.round_dir(round, fragment).child("closed.json")
    }
    /// `{prefix}/round-{r:06}/frag-{f}/global.safetensors`: weights + momentum after the round.
    pub fn global(&self, round: u64, fragment: usize) -> Path {
        self.round_dir(round, fragment).child("global.safetensors")
    }
    /// The prefix itself.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }
}

/// A store plus the replica's retry policy. Every call is retried on transient errors
/// (anything but not-found / already-exists / precondition / unsupported) with exponential
/// back-off (capped at [`crate::config::MAX_STORE_BACKOFF_S`]) for up to a time budget, one
/// log line per retry, then fails naming the operation, the key and the budget.
#[derive(Clone)]
pub struct RetryingStore {
    /// The underlying store.
    pub inner: Arc<dyn ObjectStore>,
    budget: Duration,
    max_retries: Option<usize>,
    backoff: Duration,
}

fn is_final(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    matches!(
        e,
        E::NotFound { .. }
            | E::AlreadyExists { .. }
            | E::Precondition { .. }
            | E::NotModified { .. }
            | E::NotImplemented
            | E::NotSupported { .. }
            | E::InvalidPath { .. }
            | E::UnknownConfigurationKey { .. }
    )
}

impl RetryingStore {
    /// Wraps `inner`: transient failures are retried for up to `budget`, waiting `backoff`
    /// first and doubling; `max_retries` optionally caps the extra attempts too.
    pub fn new(
        inner: Arc<dyn ObjectStore>,
        budget: Duration,
        max_retries: Option<usize>,
        backoff: Duration,
    ) -> Self {
        Self {
            inner,
            budget,
            max_retries,
            backoff,
        }
    }

    async fn retry<T, F, Fut>(&self, op: &str, key: &Path, f: F) -> Result<T, object_store::Error>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, object_store::Error>>,
    {
        let start = Instant::now();
        let max_backoff = Duration::from_secs_f64(crate::config::MAX_STORE_BACKOFF_S);
        let mut delay = self.backoff;
        let mut attempt = 0;
        loop {
            match f().await {
                Ok(v) => return Ok(v),
                Err(e) if is_final(&e) => return Err(e),
                Err(e) => {
                    let elapsed = start.elapsed();
                    let left = self.budget.saturating_sub(elapsed);
                    if left.is_zero() || self.max_retries.is_some_and(|m| attempt >= m) {
                        return Err(object_store::Error::Generic {
                            store: "diloco",
                            source: format!(
                                "store {op} {key} failed after {} attempts over {:.1} s \
                                 ([diloco] store_retry_budget_s = {}): {e}",
                                attempt + 1,
                                elapsed.as_secs_f64(),
                                self.budget.as_secs_f64()
                            )
                            .into(),
                        });
                    }
                    // The last wait ends at the budget, so the final attempt still happens.
                    let wait = delay.min(left);
                    tracing::warn!(
                        "store {op} {key} failed (attempt {}), retrying in {:.2} s \
                         ({:.1} s of store_retry_budget_s {} left): {e}",
                        attempt + 1,
                        wait.as_secs_f64(),
                        left.as_secs_f64(),
                        self.budget.as_secs_f64()
                    );
                    tokio::time::sleep(wait).await;
                    delay = (delay * 2).min(max_backoff);
                    attempt += 1;
                }
            }
        }
    }

    /// Reads a whole object; `None` when it does not exist.
    pub async fn get(&self, key: &Path) -> Result<Option<Bytes>> {
        let r = self
            .retry("get", key, || async {
                self.inner.get(key).await?.bytes().await
            })
            .await;
        match r {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(anyhow!(e)),
        }
    }

    /// Whether an object exists.
    pub async fn exists(&self, key: &Path) -> Result<bool> {
        match self.retry("head", key, || self.inner.head(key)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(anyhow!(e)),
        }
    }

    /// Writes a whole object only if the key is free (`PutMode::Create`). Returns false when
    /// another writer got there first.
    pub async fn put_create(&self, key: &Path, bytes: Bytes) -> Result<bool> {
        let r = self
            .retry("put", key, || {
                let opts = PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                };
                self.inner.put_opts(key, bytes.clone().into(), opts)
            })
            .await;
        match r {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(anyhow!(e)),
        }
    }

    /// All objects under `prefix` (recursive).
    pub async fn list(&self, prefix: &Path) -> Result<Vec<ObjectMeta>> {
        self.retry("list", prefix, || async {
            self.inner.list(Some(prefix)).try_collect::<Vec<_>>().await
        })
        .await
        .map_err(|e| anyhow!(e))
    }

    /// Names of the immediate sub-folders of `prefix`.
    pub async fn list_dirs(&self, prefix: &Path) -> Result<Vec<String>> {
        let r = self
            .retry("list", prefix, || {
                self.inner.list_with_delimiter(Some(prefix))
            })
            .await;
        match r {
            Ok(l) => Ok(l
                .common_prefixes
                .iter()
                .filter_map(|p| p.filename().map(str::to_string))
                .collect()),
            Err(object_store::Error::NotFound { .. }) => Ok(vec![]),
            Err(e) => Err(anyhow!(e)),
        }
    }
}
