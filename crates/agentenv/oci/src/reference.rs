//! Image references (`registry[:port]/repo[:tag|@sha256:...]`) and content digests.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// Docker Hub's name in references.
pub const DOCKER_HUB: &str = "docker.io";
/// Docker Hub's API host.
pub const DOCKER_HUB_API: &str = "registry-1.docker.io";
/// Tag used when a reference names neither a tag nor a digest.
pub const DEFAULT_TAG: &str = "latest";

/// A bad image reference or digest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RefError {
    /// Empty string.
    #[error("empty image reference")]
    Empty,
    /// Longer than 255 characters in its name part.
    #[error("image reference {reference:?}: name longer than 255 characters")]
    TooLong {
        /// The reference as given.
        reference: String,
    },
    /// The registry part is not a valid host\[:port\].
    #[error("image reference {reference:?}: bad registry {registry:?}")]
    Registry {
        /// The reference as given.
        reference: String,
        /// The registry part.
        registry: String,
    },
    /// A repository path component breaks the distribution grammar (lower case, digits, `.`, `_`, `-`).
    #[error(
        "image reference {reference:?}: bad repository component {component:?} (lower-case letters, digits and single separators . _ __ -)"
    )]
    Repository {
        /// The reference as given.
        reference: String,
        /// The offending component.
        component: String,
    },
    /// The tag is not `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`.
    #[error("image reference {reference:?}: bad tag {tag:?}")]
    Tag {
        /// The reference as given.
        reference: String,
        /// The tag.
        tag: String,
    },
    /// The digest is not `sha256:` and 64 lower-case hex digits.
    #[error("bad digest {digest:?}: expected sha256: and 64 lower-case hex digits")]
    Digest {
        /// The digest as given.
        digest: String,
    },
}

/// A `sha256:<hex>` content digest (the only algorithm registries use in practice).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:` + 64 lower-case hex digits.
    pub fn parse(s: &str) -> Result<Digest, RefError> {
        let ok = s.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        });
        if ok {
            Ok(Digest(s.to_owned()))
        } else {
            Err(RefError::Digest { digest: s.into() })
        }
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest::from_hasher(Sha256::new_with_prefix(bytes))
    }

    pub(crate) fn from_hasher(h: Sha256) -> Digest {
        Digest(format!("sha256:{}", hex(&h.finalize())))
    }

    /// `sha256:<hex>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> &str {
        &self.0[7..]
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Digest::parse(&s).map_err(serde::de::Error::custom)
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A parsed image reference. `Display` gives the canonical form (`docker.io/library/debian:latest`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageRef {
    /// Registry host\[:port\] as written (`docker.io` for Docker Hub).
    pub registry: String,
    /// Repository path (`library/debian`).
    pub repository: String,
    /// Tag; `latest` when neither a tag nor a digest was given.
    pub tag: Option<String>,
    /// Digest, when pinned (`@sha256:...`); it wins over the tag.
    pub digest: Option<Digest>,
}

impl ImageRef {
    /// Parses `[registry[:port]/]repo[:tag][@sha256:...]` with Docker Hub defaults: no registry means
    /// `docker.io`, a one-component Docker Hub repository gets `library/`, no tag and no digest means
    /// `latest`. The first component is a registry when it contains `.` or `:` or is `localhost`.
    pub fn parse(s: &str) -> Result<ImageRef, RefError> {
        if s.is_empty() {
            return Err(RefError::Empty);
        }
        let bad_repo = |c: &str| RefError::Repository {
            reference: s.into(),
            component: c.into(),
        };
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(Digest::parse(d)?)),
            None => (s, None),
        };
        // A tag is a ':' after the last '/'.
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
            None => (rest, None),
        };
        if name.len() > 255 {
            return Err(RefError::TooLong {
                reference: s.into(),
            });
        }
        if let Some(t) = tag
            && !valid_tag(t)
        {
            return Err(RefError::Tag {
                reference: s.into(),
                tag: t.into(),
            });
        }
        let (registry, repo) = match name.split_once('/') {
            Some((first, more))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first, more.to_owned())
            }
            _ => (DOCKER_HUB, name.to_owned()),
        };
        if !valid_registry(registry) {
            return Err(RefError::Registry {
                reference: s.into(),
                registry: registry.into(),
            });
        }
        let registry = if registry == "index.docker.io" || registry == DOCKER_HUB_API {
            DOCKER_HUB
        } else {
            registry
        };
        if repo.is_empty() {
            return Err(bad_repo(""));
        }
        for c in repo.split('/') {
            if !valid_component(c) {
                return Err(bad_repo(c));
            }
        }
        let repository = if registry == DOCKER_HUB && !repo.contains('/') {
            format!("library/{repo}")
        } else {
            repo
        };
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_owned()),
            (None, None) => Some(DEFAULT_TAG.to_owned()),
            (None, Some(_)) => None,
        };
        Ok(ImageRef {
            registry: registry.to_owned(),
            repository,
            tag,
            digest,
        })
    }

    /// What to ask the manifest endpoint for: the digest when pinned, else the tag.
    pub fn reference(&self) -> &str {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.as_str(),
            (None, Some(t)) => t,
            (None, None) => DEFAULT_TAG,
        }
    }

    /// The host\[:port\] the API is served on (`registry-1.docker.io` for Docker Hub).
    pub fn api_host(&self) -> &str {
        if self.registry == DOCKER_HUB {
            DOCKER_HUB_API
        } else {
            &self.registry
        }
    }

    /// Whether the registry is on this machine (`localhost`, `127.0.0.0/8`, `[::1]`).
    pub fn is_loopback(&self) -> bool {
        is_loopback_host(&self.registry)
    }
}

pub(crate) fn is_loopback_host(hostport: &str) -> bool {
    let host = if let Some(rest) = hostport.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        hostport.split(':').next().unwrap_or("")
    };
    host == "localhost"
        || host == "::1"
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for ImageRef {
    type Err = RefError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ImageRef::parse(s)
    }
}

fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`
fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    if b.is_empty() || !is_alnum_lower(b[0]) || !is_alnum_lower(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if is_alnum_lower(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !is_alnum_lower(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-');
        if !ok {
            return false;
        }
    }
    true
}

fn is_alnum_lower(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

fn valid_registry(r: &str) -> bool {
    let (host, port) = if let Some(rest) = r.strip_prefix('[') {
        match rest.split_once(']') {
            Some((h, p)) => (h, p.strip_prefix(':')),
            None => return false,
        }
    } else {
        match r.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (r, None),
        }
    };
    if let Some(p) = port
        && p.parse::<u16>().map_or(true, |n| n == 0)
    {
        return false;
    }
    if r.starts_with('[') {
        return host.parse::<std::net::Ipv6Addr>().is_ok();
    }
    !host.is_empty()
        && host.split('.').all(|l| {
            !l.is_empty()
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> ImageRef {
        ImageRef::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn docker_hub_defaults() {
        let r = p("debian");
        assert_eq!(r.to_string(), "docker.io/library/debian:latest");
        assert_eq!(r.api_host(), "registry-1.docker.io");
        assert_eq!(r.reference(), "latest");
        let r = p("user/app:1.2");
        assert_eq!(r.to_string(), "docker.io/user/app:1.2");
        assert_eq!(p("index.docker.io/library/busybox").registry, "docker.io");
    }

    #[test]
    fn registries_ports_tags_digests() {
        let d = format!("sha256:{}", "ab".repeat(32));
        let r = p(&format!("127.0.0.1:5000/a/b/c:v1@{d}"));
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "a/b/c");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        assert_eq!(r.reference(), d);
        assert!(r.is_loopback());
        let r = p(&format!("localhost/x@{d}"));
        assert_eq!((r.registry.as_str(), r.tag.as_deref()), ("localhost", None));
        let r = p("ghcr.io/o/r");
        assert_eq!((r.api_host(), r.reference()), ("ghcr.io", "latest"));
        assert!(!r.is_loopback());
        assert!(p("[::1]:5000/x:y").is_loopback());
        assert_eq!(
            p("registry.example.com:443/a_b__c-d---e.f:T_1.-x").repository,
            "a_b__c-d---e.f"
        );
    }

    #[test]
    fn bad_references_are_typed() {
        assert_eq!(ImageRef::parse(""), Err(RefError::Empty));
        assert!(matches!(
            ImageRef::parse("Debian"),
            Err(RefError::Repository { .. })
        ));
        assert!(matches!(
            ImageRef::parse("a//b"),
            Err(RefError::Repository { .. })
        ));
        assert!(matches!(
            ImageRef::parse("a/b_/c"),
            Err(RefError::Repository { .. })
        ));
        assert!(matches!(ImageRef::parse("a/b:"), Err(RefError::Tag { .. })));
        assert!(matches!(ImageRef::parse("a:-x"), Err(RefError::Tag { .. })));
        assert!(matches!(
            ImageRef::parse(&format!("a:{}", "t".repeat(129))),
            Err(RefError::Tag { .. })
        ));
        assert!(matches!(
            ImageRef::parse("a@sha256:abc"),
            Err(RefError::Digest { .. })
        ));
        assert!(matches!(
            ImageRef::parse(&format!("a@md5:{}", "0".repeat(64))),
            Err(RefError::Digest { .. })
        ));
        assert!(matches!(
            ImageRef::parse("host:99999/a"),
            Err(RefError::Registry { .. })
        ));
        assert!(matches!(
            ImageRef::parse("bad_host.com/a"),
            Err(RefError::Registry { .. })
        ));
        assert!(matches!(
            ImageRef::parse(&"a".repeat(256)),
            Err(RefError::TooLong { .. })
        ));
        assert!(matches!(
            ImageRef::parse("localhost/"),
            Err(RefError::Repository { .. })
        ));
    }

    #[test]
    fn digest_of_bytes() {
        assert_eq!(
            Digest::of(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
