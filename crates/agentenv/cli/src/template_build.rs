//! `aenv template build NAME --dockerfile PATH`: the Dockerfile's steps through the server's template
//! builder (the routes the SDK's `Template.build` uses), with its log streamed to the terminal.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use hyper::Method;
use serde_json::{Value, json};

use crate::client::ApiClient;
use crate::dockerfile;

/// Builds template `name` from the Dockerfile at `path`; returns the build request's answer.
pub async fn from_dockerfile(api: &ApiClient, name: &str, path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let recipe = dockerfile::parse(&text).with_context(|| path.display().to_string())?;
    for l in &recipe.ignored {
        eprintln!("ignored: {l}");
    }
    let context = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let from = base(api, &recipe.from).await?;
    let (_, req) = api
        .call(Method::POST, "/v3/templates", Some(json!({"name": name})))
        .await?;
    let tid = req["templateID"]
        .as_str()
        .context("no templateID")?
        .to_string();
    let bid = req["buildID"].as_str().context("no buildID")?.to_string();
    let mut steps = recipe.steps.clone();
    let mut copies = recipe.copies.iter();
    for step in steps.iter_mut().filter(|s| s["type"] == "COPY") {
        let (src, dest) = copies.next().context("COPY sources")?;
        let (bytes, hash) = dockerfile::archive(context, src, dest)?;
        let (_, link) = api
            .call(Method::GET, &format!("/templates/{tid}/files/{hash}"), None)
            .await?;
        if link["present"] != true {
            api.put_bytes(&format!("/templates/{tid}/files/{hash}"), bytes)
                .await
                .with_context(|| format!("upload of {src}"))?;
        }
        step["filesHash"] = json!(hash);
    }
    let mut start = json!({"fromTemplate": from, "steps": steps});
    if let Some(cmd) = &recipe.start_cmd {
        start["startCmd"] = json!(cmd);
    }
    api.call(
        Method::POST,
        &format!("/v2/templates/{tid}/builds/{bid}"),
        Some(start),
    )
    .await?;
    let pb = crate::spinner(&format!("building {name}"));
    let mut offset = 0;
    loop {
        let (_, st) = api
            .call(
                Method::GET,
                &format!("/templates/{tid}/builds/{bid}/status?logsOffset={offset}"),
                None,
            )
            .await?;
        let entries = st["logEntries"].as_array().cloned().unwrap_or_default();
        offset += entries.len();
        for e in &entries {
            let msg = e["message"].as_str().unwrap_or("");
            pb.println(msg);
            pb.set_message(msg.chars().take(80).collect::<String>());
        }
        match st["status"].as_str() {
            Some("ready") if entries.is_empty() => break,
            Some("error") if entries.is_empty() => {
                pb.finish_and_clear();
                let r = &st["reason"];
                bail!(
                    "build failed at step {}: {}",
                    r["step"].as_str().unwrap_or("?"),
                    r["message"].as_str().unwrap_or("no reason")
                );
            }
            _ if entries.is_empty() => tokio::time::sleep(Duration::from_millis(500)).await,
            _ => {}
        }
    }
    pb.finish_and_clear();
    Ok(req)
}

/// The template FROM names: a template or snapshot the server knows, else an OCI image built (once) into
/// a template of its own.
async fn base(api: &ApiClient, from: &str) -> anyhow::Result<String> {
    if api
        .call(Method::GET, &format!("/templates/aliases/{from}"), None)
        .await
        .is_ok()
    {
        return Ok(from.to_string());
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(from.as_bytes());
    let id = format!(
        "img-{}",
        digest[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    let (_, all) = api.call(Method::GET, "/templates", None).await?;
    let known = all
        .as_array()
        .is_some_and(|a| a.iter().any(|t| t["templateID"] == id.as_str()));
    if !known {
        crate::build_with_progress(
            api,
            &format!("building template {id} from image {from}"),
            json!({"templateID": id, "fromImage": from}),
        )
        .await?;
    }
    Ok(id)
}
