//! Template tags (E2B's `POST/DELETE /templates/tags`): a built template's `name:tag` names, moved
//! between its builds.

use super::{Caller, LifecycleError, Result, Sandboxes};
use crate::tenants;

/// The tag of a tag argument, `tag` or `name:tag` (the name must be `name`); `None` when malformed.
fn tag_of<'a>(name: &str, arg: &'a str) -> Option<&'a str> {
    let tag = match arg.split_once(':') {
        Some((n, t)) if n == name => t,
        Some(_) => return None,
        None => arg,
    };
    agentenv_vm::valid_id(tag).then_some(tag)
}

/// A stable UUID-shaped id of a template's build (E2B's `buildID`): the snapshot `id`'s.
pub fn build_uuid(id: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(id.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    // Version 8 (custom), RFC 9562 variant.
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = crate::keys::hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

impl Sandboxes {
    /// Gives the build `target` (`name:tag`) the tags `tags` (each `tag` or `name:tag`), taking them
    /// from any other build of the name; returns the build's id and the tags.
    pub fn assign_tags(
        &self,
        caller: &Caller,
        target: &str,
        tags: &[String],
    ) -> Result<(String, Vec<String>)> {
        let (name, _) = target
            .split_once(':')
            .ok_or_else(|| LifecycleError::Invalid(format!("target {target:?} is not name:tag")))?;
        let snap = self
            .find_snapshot(caller, target)
            .ok_or_else(|| LifecycleError::TemplateNotFound(target.into()))?;
        let (tags, names) = self.scoped_tags(caller, name, tags)?;
        self.backend.rename_snapshot(&snap.id, &names, &[])?;
        Ok((build_uuid(&snap.id), tags))
    }

    /// Takes the tags `tags` from template `name`'s builds.
    pub fn remove_tags(&self, caller: &Caller, name: &str, tags: &[String]) -> Result<()> {
        let (tags, names) = self.scoped_tags(caller, name, tags)?;
        for (tag, scoped) in tags.iter().zip(&names) {
            let full = format!("{name}:{tag}");
            let snap = self
                .find_snapshot(caller, &full)
                .ok_or_else(|| LifecycleError::TemplateNotFound(full.clone()))?;
            self.backend
                .rename_snapshot(&snap.id, &[], std::slice::from_ref(scoped))?;
        }
        Ok(())
    }

    /// The tags of `args` and their names as this caller's scope stores them.
    fn scoped_tags(
        &self,
        caller: &Caller,
        name: &str,
        args: &[String],
    ) -> Result<(Vec<String>, Vec<String>)> {
        if args.is_empty() {
            return Err(LifecycleError::Invalid("tags must not be empty".into()));
        }
        let mut tags = Vec::new();
        let mut names = Vec::new();
        for a in args {
            let tag = tag_of(name, a).ok_or_else(|| {
                LifecycleError::Invalid(format!("invalid tag {a:?}: use tag or {name}:tag"))
            })?;
            let scoped = tenants::scoped_name(caller.owner(), &format!("{name}:{tag}"))
                .map_err(LifecycleError::Invalid)?;
            tags.push(tag.to_string());
            names.push(scoped);
        }
        Ok((tags, names))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_build_ids() {
        assert_eq!(tag_of("app", "prod"), Some("prod"));
        assert_eq!(tag_of("app", "app:prod"), Some("prod"));
        for bad in [":prod", "app:", "other:prod", "a b", ""] {
            assert_eq!(tag_of("app", bad), None, "{bad:?}");
        }
        let id = crate::keys::generate_snapshot_id();
        let u = build_uuid(&id);
        assert_eq!(u, build_uuid(&id));
        assert_ne!(u, build_uuid(&crate::keys::generate_snapshot_id()));
        let parts: Vec<usize> = u.split('-').map(str::len).collect();
        assert_eq!(parts, [8, 4, 4, 4, 12], "{u}");
        assert_eq!(&u[14..15], "8");
    }
}
