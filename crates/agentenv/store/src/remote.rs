//! The optional S3-compatible bucket, through `object_store`; every call has a deadline.
//!
//! Keys in the bucket: `<prefix>chunks/<64 hex>` (stored chunk encoding) and `<prefix>meta/<key>`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::error::{Result, StoreError};

/// Where the bucket is and how to reach it (`Debug` hides the secret key).
#[derive(Clone)]
pub struct RemoteConfig {
    /// `http://127.0.0.1:8333` or `https://s3.example.com`; empty for AWS.
    pub endpoint: String,
    /// Bucket name.
    pub bucket: String,
    /// Region (any value for most S3-compatible servers).
    pub region: String,
    /// Access key id.
    pub access_key_id: String,
    /// Secret key.
    pub secret_access_key: String,
    /// Prefix of every key in the bucket (e.g. `agentenv/`), possibly empty.
    pub prefix: String,
    /// Allow plain HTTP (loopback test servers).
    pub allow_http: bool,
    /// Deadline of every single remote call.
    pub timeout: Duration,
    /// Key of the MAC (keyed BLAKE3) over each metadata blob in the bucket ([`crate::ChunkStore::put_meta`]):
    /// a blob without a valid one, so one written by anyone without the key, reads as absent. Every
    /// server sharing the bucket needs the same; [`RemoteConfig::new`] derives one from the secret key,
    /// [`RemoteConfig::with_meta_key`] takes one of the servers' own.
    pub meta_key: [u8; 32],
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("prefix", &self.prefix)
            .field("allow_http", &self.allow_http)
            .field("timeout", &self.timeout)
            .field("meta_key", &"<redacted>")
            .finish()
    }
}

impl RemoteConfig {
    /// A config with the common defaults: region `us-east-1`, no prefix, 30 s deadline, HTTP allowed only
    /// for a loopback endpoint.
    pub fn new(endpoint: &str, bucket: &str, access_key_id: &str, secret_access_key: &str) -> Self {
        let loopback = ["http://127.", "http://localhost", "http://[::1]"]
            .iter()
            .any(|p| endpoint.starts_with(p));
        RemoteConfig {
            endpoint: endpoint.to_owned(),
            bucket: bucket.to_owned(),
            region: "us-east-1".into(),
            access_key_id: access_key_id.to_owned(),
            secret_access_key: secret_access_key.to_owned(),
            prefix: String::new(),
            allow_http: loopback,
            timeout: Duration::from_secs(30),
            meta_key: blake3::derive_key(META_KEY_CONTEXT, secret_access_key.as_bytes()),
        }
    }

    /// This config with metadata MAC key `key` (a secret of the servers' own, see
    /// [`meta_key_from_secret`]), so that the bucket's credentials alone cannot forge metadata.
    pub fn with_meta_key(mut self, key: [u8; 32]) -> Self {
        self.meta_key = key;
        self
    }
}

/// The metadata MAC key derived from `secret` (a key of any length; servers before the bucket key
/// derived theirs from the API key this way).
pub fn meta_key_from_secret(secret: &[u8]) -> [u8; 32] {
    blake3::derive_key(META_KEY_CONTEXT, secret)
}

const META_KEY_CONTEXT: &str = "k3-stack agentenv-store 2026-12-05 bucket metadata MAC";
const SEAL: &[u8] = b"k3-mac-v1 ";

/// `body` under the MAC of `key` over the blob's name and bytes: `k3-mac-v1 <64 hex>\n<body>`.
pub(crate) fn seal(key: &[u8; 32], name: &str, body: &[u8]) -> Vec<u8> {
    let mac = mac(key, name, body);
    [SEAL, mac.to_hex().as_bytes(), b"\n", body].concat()
}

/// The body of a blob [`seal`]ed with `key` under `name`; `None` if it is not, or was changed.
pub(crate) fn open<'a>(key: &[u8; 32], name: &str, sealed: &'a [u8]) -> Option<&'a [u8]> {
    let rest = sealed.strip_prefix(SEAL)?;
    let (hex, body) = (rest.get(..64)?, rest.get(65..)?);
    let got = blake3::Hash::from_hex(hex).ok()?;
    // blake3::Hash compares in constant time.
    (rest.get(64) == Some(&b'\n') && got == mac(key, name, body)).then_some(body)
}

fn mac(key: &[u8; 32], name: &str, body: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(name.as_bytes()).update(&[0]).update(body);
    h.finalize()
}

#[cfg(test)]
mod seal_tests {
    use super::*;

    #[test]
    fn a_sealed_blob_opens_only_with_its_key_name_and_bytes() {
        let (k, other) = ([7u8; 32], [8u8; 32]);
        let s = seal(&k, "snapshots/a", b"{\"x\":1}");
        assert_eq!(open(&k, "snapshots/a", &s), Some(&b"{\"x\":1}"[..]));
        assert_eq!(open(&other, "snapshots/a", &s), None, "another key");
        assert_eq!(open(&k, "snapshots/b", &s), None, "moved to another name");
        let mut changed = s.clone();
        *changed.last_mut().unwrap() ^= 1;
        assert_eq!(open(&k, "snapshots/a", &changed), None, "a changed byte");
        assert_eq!(open(&k, "snapshots/a", b"{\"x\":1}"), None, "unsealed");
        for cut in 0..s.len() {
            assert_eq!(open(&k, "snapshots/a", &s[..cut]), None, "cut at {cut}");
        }
        assert_eq!(open(&k, "e", &seal(&k, "e", b"")), Some(&b""[..]));
    }
}

pub(crate) struct Remote {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    deadline: Duration,
}

/// A listed object: key below the prefix and last-modified time (unix seconds).
pub(crate) struct Listed {
    pub(crate) key: String,
    pub(crate) modified_s: i64,
}

impl Remote {
    pub(crate) fn new(cfg: &RemoteConfig) -> Result<Remote> {
        use object_store::aws::AmazonS3Builder;
        use object_store::{BackoffConfig, ClientOptions, RetryConfig};
        if cfg.bucket.is_empty() {
            return Err(StoreError::Config("remote bucket is empty".into()));
        }
        let client = ClientOptions::new()
            .with_allow_http(cfg.allow_http)
            .with_timeout(cfg.timeout)
            .with_connect_timeout(cfg.timeout.min(Duration::from_secs(10)));
        // A loaded S3 server answers 500/503 for a few seconds (seen with SeaweedFS while a 1 GiB
        // image uploaded on a busy 2-core box; with the default backoff six retries spent 0.9 s): back
        // off at least 0.5 s each time, up to 8 s, before failing.
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(500),
                max_backoff: Duration::from_secs(8),
                base: 2.0,
            },
            max_retries: 6,
            retry_timeout: cfg.timeout,
        };
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&cfg.bucket)
            .with_region(&cfg.region)
            .with_access_key_id(&cfg.access_key_id)
            .with_secret_access_key(&cfg.secret_access_key)
            .with_client_options(client)
            .with_retry(retry);
        if !cfg.endpoint.is_empty() {
            b = b.with_endpoint(&cfg.endpoint);
        }
        let store = b
            .build()
            .map_err(|e| StoreError::Config(format!("remote {}: {e}", cfg.endpoint)))?;
        let mut prefix = cfg.prefix.trim_matches('/').to_owned();
        if !prefix.is_empty() {
            prefix.push('/');
        }
        Ok(Remote {
            store: Arc::new(store),
            prefix,
            deadline: cfg.timeout,
        })
    }

    fn path(&self, key: &str) -> ObjPath {
        ObjPath::from(format!("{}{key}", self.prefix))
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        key: &str,
        f: impl Future<Output = Result<T, object_store::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.deadline, f).await {
            Ok(r) => r.map_err(|source| StoreError::Remote {
                op,
                key: key.to_owned(),
                source,
            }),
            Err(_) => Err(StoreError::RemoteTimeout {
                op,
                key: key.to_owned(),
                deadline: self.deadline,
            }),
        }
    }

    pub(crate) async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let p = self.path(key);
        self.timed("put", key, async { self.store.put(&p, bytes.into()).await })
            .await
            .map(|_| ())
    }

    /// `Ok(None)` when the object does not exist.
    pub(crate) async fn get(&self, key: &str) -> Result<Option<Bytes>> {
        let p = self.path(key);
        let r = self
            .timed("get", key, async {
                match self.store.get(&p).await {
                    Ok(g) => g.bytes().await.map(Some),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .await?;
        Ok(r)
    }

    /// Bytes `range` of an object; `Ok(None)` when the object does not exist.
    pub(crate) async fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
    ) -> Result<Option<Bytes>> {
        let p = self.path(key);
        self.timed("get range", key, async {
            match self.store.get_range(&p, range).await {
                Ok(b) => Ok(Some(b)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })
        .await
    }

    pub(crate) async fn delete(&self, key: &str) -> Result<()> {
        let p = self.path(key);
        self.timed("delete", key, async {
            match self.store.delete(&p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Every object whose key starts with `prefix` (keys returned without the store prefix).
    pub(crate) async fn list(&self, prefix: &str) -> Result<Vec<Listed>> {
        // object_store lists whole path segments: list the parent folder, then filter.
        let (dir, _) = prefix.rsplit_once('/').unwrap_or(("", prefix));
        let dir_path = self.path(dir);
        let strip = self.prefix.len();
        self.timed("list", prefix, async {
            let mut out = Vec::new();
            let mut s = self.store.list(Some(&dir_path));
            while let Some(m) = s.next().await {
                let m = m?;
                let full = m.location.as_ref();
                let Some(key) = full.get(strip..) else {
                    continue;
                };
                if key.starts_with(prefix) {
                    out.push(Listed {
                        key: key.to_owned(),
                        modified_s: m.last_modified.timestamp(),
                    });
                }
            }
            Ok(out)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn debug_output_hides_the_secret_key() {
        let secret = format!("s{}", rand::random::<u64>());
        let cfg = super::RemoteConfig::new("http://127.0.0.1:9", "b", "AKID", &secret);
        let shown = format!("{cfg:?}");
        assert!(
            !shown.contains(&secret) && shown.contains("AKID"),
            "{shown}"
        );
        assert!(cfg.allow_http, "loopback endpoints may use plain HTTP");
        assert!(!super::RemoteConfig::new("http://s3.example.com", "b", "a", "s").allow_http);
    }
}
