//! Authentication and transport against a real `docker-registry`: htpasswd basic auth, bearer tokens
//! (registry in `auth: token` mode), https with a private root.

use agentenv_oci::testing::{TestRegistry, read};
use agentenv_oci::{Credentials, OciError, pull};

mod common;
use common::{arch_image, opts};

#[test]
fn auth_required_without_and_with_credentials() {
    let Some(reg) = TestRegistry::start_or_skip("auth", Some(("k3user", "s3cret-pw"))) else {
        return;
    };
    let image = reg.image("k3/private:v1");
    let (img, _) = arch_image("amd64", None);
    img.push(&image, &reg.options()).unwrap();
    let t = tempfile::tempdir().unwrap();

    // Anonymous: the registry's options (it is on loopback, which pulls reach only when allowed)
    // without its credentials.
    let mut anon = opts(&reg);
    anon.registry.credentials = None;
    let err = pull(&image, &t.path().join("a"), &anon, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            &err,
            OciError::Unauthorized {
                had_credentials: false,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("no credentials were given"),
        "{err}"
    );

    let mut wrong = opts(&reg);
    wrong.registry.credentials = Some(Credentials {
        username: "k3user".into(),
        password: "wrong".into(),
    });
    let err = pull(&image, &t.path().join("b"), &wrong, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            &err,
            OciError::Unauthorized {
                had_credentials: true,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        !format!("{wrong:?}").contains("wrong"),
        "password redacted in Debug"
    );

    // Push without credentials is refused too.
    let err = img
        .push(&reg.image("k3/private:v2"), &anon.registry)
        .unwrap_err();
    assert!(
        matches!(
            &err,
            OciError::Unauthorized {
                had_credentials: false,
                ..
            }
        ),
        "{err}"
    );

    pull(&image, &t.path().join("c"), &opts(&reg), &mut |_| {}).unwrap();
    assert_eq!(read(&t.path().join("c/arch")), b"amd64");
}

#[test]
fn bearer_token_auth_anonymous_and_with_credentials() {
    // Anonymous tokens: the client follows the Bearer challenge with no credentials.
    let Some(reg) = TestRegistry::start_token_or_skip("bearer_anonymous", None) else {
        return;
    };
    let (img, _) = arch_image("amd64", None);
    let image = reg.image("k3/tokened:v1");
    img.push(&image, &reg.options()).unwrap();
    let pushed_with = reg.tokens_issued();
    assert!(pushed_with >= 1, "push went through the token server");
    let t = tempfile::tempdir().unwrap();
    pull(&image, &t.path().join("a"), &opts(&reg), &mut |_| {}).unwrap();
    assert_eq!(read(&t.path().join("a/arch")), b"amd64");
    assert!(
        reg.tokens_issued() > pushed_with,
        "pull fetched its own token"
    );

    // Token endpoint behind basic auth: no credentials, wrong ones, right ones.
    let Some(reg) = TestRegistry::start_token_or_skip("bearer_creds", Some(("tok-user", "tok-pw")))
    else {
        return;
    };
    let image = reg.image("k3/tokened:v1");
    img.push(&image, &reg.options()).unwrap();
    let mut anon = opts(&reg);
    anon.registry.credentials = None;
    let err = pull(&image, &t.path().join("b"), &anon, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            &err,
            OciError::Unauthorized {
                had_credentials: false,
                ..
            }
        ),
        "{err}"
    );
    let mut wrong = opts(&reg);
    wrong.registry.credentials = Some(Credentials {
        username: "tok-user".into(),
        password: "nope".into(),
    });
    let err = pull(&image, &t.path().join("c"), &wrong, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            &err,
            OciError::Unauthorized {
                had_credentials: true,
                ..
            }
        ),
        "{err}"
    );
    pull(&image, &t.path().join("d"), &opts(&reg), &mut |_| {}).unwrap();
    assert_eq!(read(&t.path().join("d/arch")), b"amd64");
}

#[test]
fn https_with_a_private_root() {
    let Some(reg) = TestRegistry::start_tls_or_skip("https") else {
        return;
    };
    let (img, _) = arch_image("amd64", None);
    let image = reg.image("k3/secure:v1");
    img.push(&image, &reg.options()).unwrap();
    let t = tempfile::tempdir().unwrap();
    pull(&image, &t.path().join("a"), &opts(&reg), &mut |_| {}).unwrap();
    assert_eq!(read(&t.path().join("a/arch")), b"amd64");
    // The default (Mozilla) roots do not know this certificate: a transport error, not a silent downgrade.
    let mut o = opts(&reg);
    o.registry.root_certificates = None;
    let err = pull(&image, &t.path().join("b"), &o, &mut |_| {}).unwrap_err();
    assert!(matches!(&err, OciError::Transport { .. }), "{err}");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
    // Plain http to the https port is refused by the registry, never answered with content.
    o.registry.scheme = agentenv_oci::Scheme::Http;
    assert!(pull(&image, &t.path().join("c"), &o, &mut |_| {}).is_err());
}
