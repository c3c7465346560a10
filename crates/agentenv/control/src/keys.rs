//! API key (`e2b_` + 40 lowercase hex, `docs/specs/e2b-compat.md §0`) and per-sandbox envd access tokens.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rand::Rng;

/// Key file failures.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("reading key file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing key file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "key file {path} does not hold a key of its form (API key: e2b_<40 hex>; bucket key: 64 hex)"
    )]
    Malformed { path: PathBuf },
    #[error("key file {path} has mode {mode:o}; it must not be readable by group or others")]
    Permissions { path: PathBuf, mode: u32 },
}

/// A freshly generated API key.
pub fn generate_api_key() -> String {
    let bytes: [u8; 20] = rand::rng().random();
    format!("e2b_{}", hex(&bytes))
}

/// A fresh envd access token (32 hex chars).
pub fn generate_access_token() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    hex(&bytes)
}

/// A fresh DNS-label-safe sandbox id: 20 of `[a-z0-9]`.
/// The token that opens a sandbox's user ports (E2B's `trafficAccessToken`), derived from its envd access
/// token one way: holding it reaches the sandbox's servers but not envd.
pub fn traffic_token(access_token: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(format!("agentenv-traffic:{access_token}").as_bytes());
    d[..20].iter().map(|b| format!("{b:02x}")).collect()
}

pub fn generate_sandbox_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20)
        .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
        .collect()
}

/// What every snapshot id starts with.
pub const SNAPSHOT_PREFIX: &str = "snap-";

/// A new snapshot id: [`SNAPSHOT_PREFIX`] and a sandbox-id-shaped suffix.
pub fn generate_snapshot_id() -> String {
    format!("{SNAPSHOT_PREFIX}{}", generate_sandbox_id())
}

/// Whether `s` names a snapshot by id (rather than by `name[:tag]`).
pub fn is_snapshot_id(s: &str) -> bool {
    s.starts_with(SNAPSHOT_PREFIX)
}

/// Whether a tenant may give a template this id: 1-63 of `[a-z0-9-]` (E2B's rule; within the
/// runtime's [`agentenv_vm::valid_id`]).
pub fn valid_template_id(id: &str) -> bool {
    (1..=63).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `key` has the E2B key shape.
pub fn is_api_key(key: &str) -> bool {
    key.strip_prefix("e2b_").is_some_and(|h| {
        h.len() == 40
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Loads `<state>/server/api_key`, or creates it (mode 0600). Returns the key and whether it is new.
pub fn load_or_create_api_key(state_dir: &Path) -> Result<(String, bool), KeyError> {
    load_or_create(
        &state_dir.join("server/api_key"),
        is_api_key,
        generate_api_key,
    )
}

/// Loads `<state>/server/bucket_key`, the key of the MAC over metadata in the shared bucket (64 hex,
/// the same on every node of a cluster, and apart from the API key so that nodes need no API key), or
/// creates it from `make` (mode 0600).
pub fn load_or_create_bucket_key(
    state_dir: &Path,
    make: impl FnOnce() -> [u8; 32],
) -> Result<[u8; 32], KeyError> {
    let path = state_dir.join("server/bucket_key");
    let valid = |k: &str| k.len() == 64 && k.bytes().all(|b| b.is_ascii_hexdigit());
    let (text, _) = load_or_create(&path, valid, || hex(&make()))?;
    let mut key = [0u8; 32];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
            .map_err(|_| KeyError::Malformed { path: path.clone() })?;
    }
    Ok(key)
}

/// The secret in `path` (its first line, checked by `valid`; the file must be 0600), or a new one from
/// `make`, written with mode 0600. Returns it and whether it is new.
fn load_or_create(
    path: &Path,
    valid: impl Fn(&str) -> bool,
    make: impl FnOnce() -> String,
) -> Result<(String, bool), KeyError> {
    let path = path.to_owned();
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let mode = std::fs::metadata(&path)
                .map_err(|source| KeyError::Read {
                    path: path.clone(),
                    source,
                })?
                .permissions()
                .mode()
                & 0o777;
            if mode & 0o077 != 0 {
                return Err(KeyError::Permissions { path, mode });
            }
            let key = text.trim().to_string();
            if !valid(&key) {
                return Err(KeyError::Malformed { path });
            }
            Ok((key, false))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let dir = path.parent().unwrap_or(Path::new("/")).to_owned();
            std::fs::create_dir_all(&dir).map_err(|source| KeyError::Write {
                path: dir.clone(),
                source,
            })?;
            let key = make();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(|source| KeyError::Write {
                    path: path.clone(),
                    source,
                })?;
            writeln!(f, "{key}")
                .and_then(|()| f.sync_all())
                .map_err(|source| KeyError::Write { path, source })?;
            Ok((key, true))
        }
        Err(source) => Err(KeyError::Read { path, source }),
    }
}

/// Constant-time string comparison for secrets.
/// HMAC-SHA256 of `msg` under `key` (RFC 2104), hex.
pub fn hmac_sha256_hex(key: &[u8], msg: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(msg)
        .finalize();
    let outer = Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize();
    hex(&outer)
}

pub fn secret_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_key_is_made_once_kept_private_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let first: [u8; 32] = rand::random();
        assert_eq!(
            load_or_create_bucket_key(dir.path(), || first).unwrap(),
            first
        );
        let path = dir.path().join("server/bucket_key");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = load_or_create_bucket_key(dir.path(), || panic!("made again")).unwrap();
        assert_eq!(again, first);
        std::fs::write(&path, "not hex\n").unwrap();
        assert!(matches!(
            load_or_create_bucket_key(dir.path(), rand::random),
            Err(KeyError::Malformed { .. })
        ));
        std::fs::write(&path, format!("{}\n", hex(&first))).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            load_or_create_bucket_key(dir.path(), rand::random),
            Err(KeyError::Permissions { .. })
        ));
    }

    #[test]
    fn key_is_created_once_with_0600() {
        let dir = tempfile::tempdir().unwrap();
        let (k1, new1) = load_or_create_api_key(dir.path()).unwrap();
        assert!(new1 && is_api_key(&k1), "{k1}");
        let mode = std::fs::metadata(dir.path().join("server/api_key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let (k2, new2) = load_or_create_api_key(dir.path()).unwrap();
        assert_eq!((k2.as_str(), new2), (k1.as_str(), false));
        assert_ne!(generate_api_key(), k1);
    }

    #[test]
    fn rejects_loose_permissions_and_bad_keys() {
        let dir = tempfile::tempdir().unwrap();
        load_or_create_api_key(dir.path()).unwrap();
        let p = dir.path().join("server/api_key");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            load_or_create_api_key(dir.path()),
            Err(KeyError::Permissions { .. })
        ));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&p, "e2b_XYZ").unwrap();
        assert!(matches!(
            load_or_create_api_key(dir.path()),
            Err(KeyError::Malformed { .. })
        ));
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // RFC 4231 test cases 1 and 6 (a key longer than a block).
        assert_eq!(
            hmac_sha256_hex(&[0x0b; 20], b"Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hmac_sha256_hex(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            ),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn snapshot_and_template_ids_follow_one_rule() {
        let snap = generate_snapshot_id();
        assert!(
            is_snapshot_id(&snap) && agentenv_vm::valid_id(&snap),
            "{snap}"
        );
        assert!(!is_snapshot_id(&generate_sandbox_id()));
        let ok = generate_sandbox_id()[..rand::random_range(1..20)].to_string();
        assert!(valid_template_id(&ok) && agentenv_vm::valid_id(&ok), "{ok}");
        assert!(valid_template_id(&"a".repeat(63)));
        for bad in ["", "A", "a_b", "a.b", "a b", "é"] {
            assert!(!valid_template_id(bad), "{bad:?}");
        }
        assert!(!valid_template_id(&"a".repeat(64)));
    }

    #[test]
    fn ids_tokens_and_comparison() {
        let id = generate_sandbox_id();
        assert_eq!(id.len(), 20);
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        );
        let t = generate_access_token();
        assert_eq!(t.len(), 32);
        assert!(secret_eq(&t, &t.clone()));
        assert!(!secret_eq(&t, &generate_access_token()));
        assert!(!is_api_key("e2b_ABCDEF0123456789abcdef0123456789abcdef01"));
    }
}
