//! Security: a pull never follows a registry's token realm or redirect to an internal address it was
//! not allowed, and never passes on an upstream's error text.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use agentenv_oci::{AllowedNet, ImageRef, PullOptions};

/// A one-route HTTP server on `ip`: answers every request with `answer`; counts connections.
fn server(ip: &str, answer: impl Fn(u16) -> String + Send + 'static) -> (u16, Arc<AtomicUsize>) {
    let l = TcpListener::bind((ip, 0)).unwrap();
    let port = l.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            h.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let _ = c.write_all(answer(port).as_bytes());
        }
    });
    (port, hits)
}

fn pull_options_allowing(ip: &str) -> PullOptions {
    let mut o = PullOptions::default();
    o.registry.allow = vec![AllowedNet::parse(ip).unwrap()];
    o.registry.timeout = std::time::Duration::from_secs(5);
    o
}

#[test]
fn a_token_realm_or_redirect_to_an_internal_address_is_not_followed() {
    // The "internal service": on 127.0.0.2, which the pull is not allowed.
    let (inner, inner_hits) = server("127.0.0.2", |_| {
        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}".into()
    });
    let realm = format!("http://127.0.0.2:{inner}/token");
    let (reg, _) = server("127.0.0.1", move |_| {
        format!(
            "HTTP/1.1 401 Unauthorized\r\nwww-authenticate: Bearer realm=\"{realm}\",service=x\r\ncontent-length: 0\r\n\r\n"
        )
    });
    let image = ImageRef::parse(&format!("127.0.0.1:{reg}/a/b:c")).unwrap();
    let e = agentenv_oci::resolve(&image, &pull_options_allowing("127.0.0.1")).unwrap_err();
    assert!(e.to_string().contains("--registry-allow"), "{e}");

    let to = format!("http://127.0.0.2:{inner}/v2/a/b/manifests/c");
    let (reg2, _) = server("127.0.0.1", move |_| {
        format!("HTTP/1.1 307 Temporary Redirect\r\nlocation: {to}\r\ncontent-length: 0\r\n\r\n")
    });
    let image = ImageRef::parse(&format!("127.0.0.1:{reg2}/a/b:c")).unwrap();
    let e = agentenv_oci::resolve(&image, &pull_options_allowing("127.0.0.1")).unwrap_err();
    assert!(e.to_string().contains("--registry-allow"), "{e}");
    assert_eq!(
        inner_hits.load(Ordering::SeqCst),
        0,
        "the internal service was reached"
    );
}

#[test]
fn a_registrys_error_text_is_not_passed_on() {
    let body =
        r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"internal secret 10.1.2.3 says hi"}]}"#;
    let (reg, _) = server("127.0.0.1", move |_| {
        format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    });
    let image = ImageRef::parse(&format!("127.0.0.1:{reg}/a/b:c")).unwrap();
    let e = agentenv_oci::resolve(&image, &pull_options_allowing("127.0.0.1")).unwrap_err();
    let text = e.to_string();
    assert!(!text.contains("secret"), "{text}");
    let (reg, _) = server("127.0.0.1", |_| {
        "HTTP/1.1 500 Oops\r\ncontent-length: 21\r\n\r\ninternal secret stack".into()
    });
    let image = ImageRef::parse(&format!("127.0.0.1:{reg}/a/b:c")).unwrap();
    let e = agentenv_oci::resolve(&image, &pull_options_allowing("127.0.0.1")).unwrap_err();
    assert!(!e.to_string().contains("secret"), "{e}");
}
