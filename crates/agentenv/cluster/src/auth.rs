//! etcd users and roles for a cluster under one key prefix, so that each process writes only what its
//! job needs. A user is a client certificate's common name (etcd's `--client-cert-auth`):
//! - a gateway (role `<prefix>gateway`) reads and writes the whole prefix;
//! - node `<id>` (role `<prefix>node-<id>`) reads the prefix and writes its own record `nodes/<id>`
//!   and its own sandboxes' entries (`sandboxes/<id>/`), never another node's record or entries,
//!   where a sandbox is placed (`placed/`), tokens, claims or keys outside the prefix;
//! - `root` provisions (the CN of the operator's certificate).
//!
//! [`provision`] is idempotent: run it again to add nodes or gateways.

use etcd_client::{Client, Permission, RoleRevokePermissionOptions};

use crate::schema::Keys;
use crate::{ClusterError, ClusterStore};

/// Who may write what, by etcd user name (= certificate CN).
#[derive(Debug, Clone, Default)]
pub struct Members {
    pub nodes: Vec<String>,
    pub gateways: Vec<String>,
}

/// The role of node `id` under `keys`.
pub fn node_role(keys: &Keys, id: &str) -> String {
    format!("{}node-{id}", keys.prefix())
}

/// The gateways' role under `keys`.
pub fn gateway_role(keys: &Keys) -> String {
    format!("{}gateway", keys.prefix())
}

/// Creates the users and roles of `members` and turns auth on, as `root` (the store's certificate must
/// have CN `root`). Users already there keep their roles; each listed one gets its role.
pub async fn provision(root: &ClusterStore, members: &Members) -> Result<(), ClusterError> {
    let keys = root.keys().clone();
    let mut c = root.client().clone();
    ensure_role(root, &mut c, "root").await?;
    ensure_user(root, &mut c, "root").await?;
    root.call("grant root", c.user_grant_role("root", "root"))
        .await?;
    let gw = gateway_role(&keys);
    ensure_role(root, &mut c, &gw).await?;
    root.call(
        "grant the gateway role",
        c.role_grant_permission(&gw, Permission::read_write(keys.prefix()).with_prefix()),
    )
    .await?;
    for g in &members.gateways {
        ensure_user(root, &mut c, g).await?;
        root.call(
            "grant a gateway",
            c.user_grant_role(g.as_str(), gw.as_str()),
        )
        .await?;
    }
    for n in &members.nodes {
        let role = node_role(&keys, n);
        ensure_role(root, &mut c, &role).await?;
        let perms = [
            Permission::read(keys.prefix()).with_prefix(),
            Permission::read_write(keys.node(n)),
            Permission::read_write(keys.sandboxes_on(n)).with_prefix(),
        ];
        for p in perms {
            root.call("grant a node", c.role_grant_permission(&role, p))
                .await?;
        }
        // Earlier versions let nodes write the whole sandbox map and the tokens: taken back.
        for legacy in [keys.sandboxes(), keys.token("")] {
            let opts = RoleRevokePermissionOptions::new().with_prefix();
            let revoked = root
                .call(
                    "revoke a node's earlier grant",
                    c.role_revoke_permission(role.as_str(), legacy, Some(opts)),
                )
                .await;
            if let Err(e) = revoked
                && !e.to_string().contains("not granted")
            {
                return Err(e);
            }
        }
        ensure_user(root, &mut c, n).await?;
        root.call("grant a node", c.user_grant_role(n.as_str(), role.as_str()))
            .await?;
    }
    // Already on after a first run: etcd answers success again.
    root.call("enable auth", c.auth_enable()).await?;
    Ok(())
}

/// Adds user `name` unless it exists. Its password is random and never used (certificates log in).
async fn ensure_user(s: &ClusterStore, c: &mut Client, name: &str) -> Result<(), ClusterError> {
    if s.call("get a user", c.user_get(name)).await.is_ok() {
        return Ok(());
    }
    let pw = format!("{:032x}", rand::random::<u128>());
    s.call("add a user", c.user_add(name, pw, None)).await?;
    Ok(())
}

async fn ensure_role(s: &ClusterStore, c: &mut Client, name: &str) -> Result<(), ClusterError> {
    if s.call("get a role", c.role_get(name)).await.is_ok() {
        return Ok(());
    }
    s.call("add a role", c.role_add(name)).await?;
    Ok(())
}
