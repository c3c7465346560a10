//! Signed `/files` URLs (E2B's `download_url`/`upload_url` with a signature): `signature = "v1_" +
//! base64_nopad(sha256("<path>:<read|write>:<username or empty>:<access token>[:<expiration>]"))`,
//! valid until `signature_expiration` (Unix seconds) when it has one.

use std::collections::HashMap;

use base64::Engine;
use sha2::Digest;

/// The signature of a `/files` URL for `path`, as `user` (empty: the default user), reading or
/// writing, under sandbox access token `token`, valid until `expiration` if given.
pub fn file_signature(
    path: &str,
    write: bool,
    user: &str,
    token: &str,
    expiration: Option<&str>,
) -> String {
    let op = if write { "write" } else { "read" };
    let mut raw = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = expiration {
        raw.push(':');
        raw.push_str(e);
    }
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD
            .encode(sha2::Sha256::digest(raw.as_bytes()))
    )
}

/// What [`check`] answers for a signature made under another token (or for another file).
pub const INVALID: &str = "invalid signature";

/// Checks a `/files` URL's query (`path`, `username`, `signature`, `signature_expiration`) against
/// access token `token` at `now` (Unix seconds); the reason when it does not hold.
pub fn check(
    query: &HashMap<String, String>,
    write: bool,
    token: &str,
    now: u64,
) -> Result<(), &'static str> {
    let get = |k: &str| query.get(k).map_or("", String::as_str);
    let exp = query.get("signature_expiration").filter(|e| !e.is_empty());
    let want = file_signature(
        get("path"),
        write,
        get("username"),
        token,
        exp.map(String::as_str),
    );
    // Constant-time comparison: the signature is a secret's digest.
    let given = get("signature");
    let same = given.len() == want.len()
        && given
            .bytes()
            .zip(want.bytes())
            .fold(0u8, |a, (x, y)| a | (x ^ y))
            == 0;
    if !same {
        return Err(INVALID);
    }
    if let Some(e) = exp {
        let secs: i64 = e.parse().map_err(|_| "bad signature_expiration")?;
        if secs < i64::try_from(now).unwrap_or(i64::MAX) {
            return Err("signature is already expired");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_holds_for_its_file_operation_user_and_time_only() {
        let token = format!("{:x}", rand_u64());
        let now = 1_800_000_000u64;
        let exp = (now + 60).to_string();
        let q = |path: &str, sig: String, exp: Option<&str>| {
            let mut m = HashMap::from([
                ("path".to_string(), path.to_string()),
                ("username".to_string(), "user".to_string()),
                ("signature".to_string(), sig),
            ]);
            if let Some(e) = exp {
                m.insert("signature_expiration".into(), e.into());
            }
            m
        };
        let sig = file_signature("/a", false, "user", &token, Some(&exp));
        assert!(check(&q("/a", sig.clone(), Some(&exp)), false, &token, now).is_ok());
        assert!(
            check(&q("/a", sig.clone(), Some(&exp)), true, &token, now).is_err(),
            "write"
        );
        assert!(
            check(&q("/b", sig.clone(), Some(&exp)), false, &token, now).is_err(),
            "path"
        );
        assert!(
            check(&q("/a", sig.clone(), Some(&exp)), false, "other", now).is_err(),
            "token"
        );
        assert!(
            check(&q("/a", sig.clone(), None), false, &token, now).is_err(),
            "no expiry"
        );
        assert_eq!(
            check(&q("/a", sig, Some(&exp)), false, &token, now + 61),
            Err("signature is already expired")
        );
        for (path, t) in [("/b", token.as_str()), ("/a", "other")] {
            assert_eq!(
                check(
                    &q(
                        path,
                        file_signature("/a", false, "user", &token, Some(&exp)),
                        Some(&exp)
                    ),
                    false,
                    t,
                    now
                ),
                Err(INVALID),
                "{path} {t}"
            );
        }
        let past = (now - 120).to_string();
        let old = file_signature("/a", false, "user", &token, Some(&past));
        assert_eq!(
            check(&q("/a", old, Some(&past)), false, &token, now),
            Err("signature is already expired"),
            "a negative lifetime, as the SDK makes one"
        );
        // E2B's own example: no expiration.
        assert!(file_signature("/x", true, "", "t", None).starts_with("v1_"));
    }

    fn rand_u64() -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(1);
        h.finish()
    }
}
