//! `aenv`: command-line client for an agentenv server (E2B-compatible API).

mod client;
mod dockerfile;
mod process;
mod template_build;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use comfy_table::Table;
use hyper::Method;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

use client::ApiClient;

#[derive(Parser)]
#[command(name = "aenv", version, about = "Manage agentenv sandboxes")]
struct Cli {
    /// Server URL.
    #[arg(
        long,
        global = true,
        env = "E2B_API_URL",
        default_value = "http://127.0.0.1:3000"
    )]
    url: String,
    /// API key (default: read from the local server's state folder).
    #[arg(long, global = true, env = "E2B_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Templates.
    #[command(subcommand)]
    Template(TemplateCmd),
    /// Create a sandbox and open an interactive shell in it (unless --detach).
    Start {
        #[arg(long, short, default_value = "base")]
        template: String,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        /// Environment variable KEY=VALUE (repeatable).
        #[arg(long = "env", short, value_parser = parse_kv)]
        envs: Vec<(String, String)>,
        /// Metadata KEY=VALUE (repeatable).
        #[arg(long = "metadata", short, value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
        /// Only create; print the id.
        #[arg(long, short)]
        detach: bool,
        /// Kill the sandbox when the shell exits.
        #[arg(long)]
        rm: bool,
    },
    /// Open an interactive shell in a running sandbox.
    Shell {
        id: String,
        #[arg(long, short)]
        user: Option<String>,
    },
    /// Run a command (bash -l -c) and exit with its status.
    Exec {
        id: String,
        #[arg(long, short)]
        user: Option<String>,
        /// The command, run by the sandbox's shell: one word is a shell line (`aenv exec ID 'ls | wc -l'`),
        /// several words are quoted one by one (`aenv exec ID -- sh -c 'echo hi > f'`).
        #[arg(required = true, trailing_var_arg = true)]
        command: Vec<String>,
    },
    /// List sandboxes.
    Ls {
        /// Only this state: running or paused.
        #[arg(long)]
        state: Option<String>,
        /// Metadata filter KEY=VALUE (repeatable; all must match).
        #[arg(long = "metadata", short, value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
    },
    /// Pause sandboxes (memory and processes kept).
    Pause { ids: Vec<String> },
    /// Resume paused sandboxes.
    Resume {
        ids: Vec<String>,
        /// New lifetime in seconds.
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Set a sandbox's remaining lifetime.
    Timeout { id: String, seconds: u64 },
    /// Kill sandboxes.
    Rm { ids: Vec<String> },
    /// Snapshots: capture, list, delete.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Fork a running sandbox into COUNT new ones (1-20); prints their ids.
    Fork {
        id: String,
        #[arg(long, short, default_value_t = 1)]
        count: u32,
        /// Lifetime of each fork in seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Snapshot a sandbox (it keeps running); prints the snapshot id.
    Create {
        id: String,
        /// Name, `name[:tag]`; `aenv start -t NAME` then starts from it.
        #[arg(long)]
        name: Option<String>,
        /// Keep only the disk (sandboxes made from it cold-boot).
        #[arg(long)]
        filesystem: bool,
    },
    /// List snapshots.
    Ls {
        /// Only snapshots of this sandbox.
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Delete snapshots (by id or name).
    Rm { ids: Vec<String> },
}

#[derive(Subcommand)]
enum TemplateCmd {
    /// List templates.
    List,
    /// Build a template (Debian bookworm minbase + guest agent, booted once into a base snapshot), or,
    /// with --dockerfile, run a Dockerfile's steps in a sandbox and snapshot it as template `id`
    /// (`name[:tag]`).
    Build {
        id: String,
        /// Dockerfile (subset: FROM a template or image, RUN, COPY, ENV, WORKDIR, USER, CMD); its folder
        /// is the build context.
        #[arg(long, conflicts_with = "from_image")]
        dockerfile: Option<PathBuf>,
        #[arg(long = "alias")]
        aliases: Vec<String>,
        #[arg(long)]
        cpus: Option<u32>,
        #[arg(long)]
        memory_mb: Option<u32>,
        #[arg(long)]
        disk_mb: Option<u32>,
        /// Build from an OCI image (`registry[:port]/repo[:tag|@sha256:...]`): its Env, WorkingDir, User and
        /// Entrypoint/Cmd become the sandboxes' defaults and start command.
        #[arg(long)]
        from_image: Option<String>,
        /// Registry user name for --from-image.
        #[arg(long, requires = "from_image")]
        registry_user: Option<String>,
        /// Registry password or token for --from-image.
        #[arg(
            long,
            env = "AENV_REGISTRY_PASSWORD",
            hide_env_values = true,
            requires = "registry_user"
        )]
        registry_password: Option<String>,
    },
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got '{s}'"))
}

fn default_key() -> anyhow::Result<String> {
    let state = std::env::var_os("AGENTENV_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home =
                std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
            std::env::var_os("XDG_STATE_HOME")
                .map_or_else(|| home.join(".local/state"), PathBuf::from)
                .join("agentenv")
        });
    let path = state.join("server/api_key");
    let key = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no --api-key / E2B_API_KEY and cannot read {}",
            path.display()
        )
    })?;
    Ok(key.trim().to_string())
}

fn spinner(msg: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
    );
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// Builds a template through `POST /templates` (body `body`), with a progress bar: bytes while an image is
/// pulled, the build's step otherwise. Returns the template.
async fn build_with_progress(api: &ApiClient, label: &str, body: Value) -> anyhow::Result<Value> {
    let pb = spinner(label);
    let bytes_style = ProgressStyle::with_template(
        "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {elapsed}",
    )
    .expect("valid template")
    .progress_chars("=> ");
    let step_style =
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template");
    let mut end = None;
    let streamed = api
        .call_lines(Method::POST, "/templates", body, |v| {
            if let Some(t) = v.get("template") {
                end = Some(Ok(t.clone()));
            } else if let Some(e) = v.get("error") {
                end = Some(Err(anyhow::anyhow!(
                    "template build failed ({}): {}",
                    e["code"],
                    e["message"].as_str().unwrap_or("no message")
                )));
            } else if let (Some(done), Some(total)) =
                (v["bytesDone"].as_u64(), v["bytesTotal"].as_u64())
            {
                pb.set_style(bytes_style.clone());
                pb.set_length(total);
                pb.set_position(done);
                pb.set_message(format!("{label}: pulling"));
            } else {
                pb.set_style(step_style.clone());
                pb.set_message(format!("{label}: {} {}", s(&v, "step"), s(&v, "detail")));
            }
        })
        .await;
    pb.finish_and_clear();
    streamed?;
    end.unwrap_or_else(|| {
        Err(anyhow::anyhow!(
            "the server ended the build stream without a result"
        ))
    })
}

fn s(v: &Value, k: &str) -> String {
    match &v[k] {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut t = Table::new();
    t.set_header(headers.to_vec());
    for r in rows {
        t.add_row(r);
    }
    println!("{t}");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let key = match cli.api_key.clone() {
        Some(k) => k,
        None => default_key()?,
    };
    let api = ApiClient::new(&cli.url, &key);
    let code = run(&cli, &api).await?;
    std::process::exit(code);
}

async fn run(cli: &Cli, api: &ApiClient) -> anyhow::Result<i32> {
    match &cli.command {
        Command::Template(TemplateCmd::List) => {
            let (_, list) = api.call(Method::GET, "/templates", None).await?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                let rows = list.as_array().into_iter().flatten().map(|t| {
                    let aliases = t["aliases"]
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(Value::as_str)
                                .collect::<Vec<_>>()
                                .join(",")
                        })
                        .unwrap_or_default();
                    vec![
                        s(t, "templateID"),
                        aliases,
                        s(t, "cpuCount"),
                        s(t, "memoryMB"),
                        s(t, "diskSizeMB"),
                        s(t, "builtAt"),
                    ]
                });
                print_table(
                    &[
                        "TEMPLATE",
                        "ALIASES",
                        "CPUS",
                        "MEMORY MB",
                        "DISK MB",
                        "BUILT",
                    ],
                    rows.collect(),
                );
            }
        }
        Command::Template(TemplateCmd::Build {
            id,
            dockerfile: Some(path),
            ..
        }) => {
            let t = template_build::from_dockerfile(api, id, path).await?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&t)?)
            } else {
                println!("built template {} ({id})", s(&t, "templateID"))
            }
        }
        Command::Template(TemplateCmd::Build {
            id,
            dockerfile: None,
            aliases,
            cpus,
            memory_mb,
            disk_mb,
            from_image,
            registry_user,
            registry_password,
        }) => {
            let what = from_image.as_ref().map_or(String::new(), |i| {
                format!(" from {i} (pull, unpack, boot, snapshot)")
            });
            let body = json!({"templateID": id, "aliases": aliases, "cpuCount": cpus, "memoryMB": memory_mb,
                "diskSizeMB": disk_mb, "fromImage": from_image, "registryUsername": registry_user,
                "registryPassword": registry_password});
            let t =
                build_with_progress(api, &format!("building template {id}{what}"), body).await?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&t)?)
            } else {
                println!("built template {}", s(&t, "templateID"))
            }
        }
        Command::Start {
            template,
            timeout,
            envs,
            metadata,
            detach,
            rm,
        } => {
            let body = json!({
                "templateID": template, "timeout": timeout,
                "envVars": envs.iter().cloned().collect::<BTreeMap<_, _>>(),
                "metadata": metadata.iter().cloned().collect::<BTreeMap<_, _>>(),
            });
            let pb = spinner(&format!("creating sandbox from {template}"));
            let res = api.call(Method::POST, "/v2/sandboxes", Some(body)).await;
            pb.finish_and_clear();
            let (_, created) = res?;
            let id = s(&created, "sandboxID");
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&created)?);
            } else {
                eprintln!("sandbox {id} ({})", s(&created, "templateID"));
            }
            if *detach {
                if !cli.json {
                    println!("{id}");
                }
                return Ok(0);
            }
            let target = client::SandboxTarget {
                id: id.clone(),
                access_token: s(&created, "envdAccessToken"),
            };
            let code = process::shell(api, &target, None).await?;
            if *rm {
                api.call(Method::DELETE, &format!("/sandboxes/{id}"), None)
                    .await?;
            }
            return Ok(code);
        }
        Command::Shell { id, user } => {
            let target = api.target(id).await?;
            return process::shell(api, &target, user.as_deref()).await;
        }
        Command::Exec { id, user, command } => {
            let target = api.target(id).await?;
            let out = process::exec(
                api,
                &target,
                &shell_line(command),
                user.as_deref(),
                !cli.json,
            )
            .await?;
            if cli.json {
                let v = json!({"exitCode": out.exit_code, "stdout": String::from_utf8_lossy(&out.stdout), "stderr": String::from_utf8_lossy(&out.stderr)});
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            return Ok(out.exit_code);
        }
        Command::Ls { state, metadata } => {
            let mut query = form_query(state.as_deref(), metadata);
            let mut all = Vec::new();
            loop {
                let (items, next) = api.list_page(&query).await?;
                all.extend(items);
                match next {
                    Some(t) => {
                        query = format!("{}&nextToken={t}", form_query(state.as_deref(), metadata))
                    }
                    None => break,
                }
            }
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                let rows = all.iter().map(|x| {
                    let md = x["metadata"]
                        .as_object()
                        .map(|m| {
                            m.iter()
                                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                                .collect::<Vec<_>>()
                                .join(",")
                        })
                        .unwrap_or_default();
                    vec![
                        s(x, "sandboxID"),
                        s(x, "templateID"),
                        s(x, "state"),
                        s(x, "startedAt"),
                        s(x, "endAt"),
                        md,
                    ]
                });
                print_table(
                    &[
                        "SANDBOX", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA",
                    ],
                    rows.collect(),
                );
            }
        }
        Command::Pause { ids } => {
            for id in ids {
                let pb = spinner(&format!("pausing {id}"));
                let r = api
                    .call(Method::POST, &format!("/sandboxes/{id}/pause"), None)
                    .await;
                pb.finish_and_clear();
                r?;
                println!("paused {id}");
            }
        }
        Command::Resume { ids, timeout } => {
            for id in ids {
                let body = match timeout {
                    Some(t) => json!({"timeout": t}),
                    None => json!({}),
                };
                let pb = spinner(&format!("resuming {id}"));
                let r = api
                    .call(
                        Method::POST,
                        &format!("/v2/sandboxes/{id}/connect"),
                        Some(body),
                    )
                    .await;
                pb.finish_and_clear();
                let (status, _) = r?;
                println!(
                    "{} {id}",
                    if status.as_u16() == 201 {
                        "resumed"
                    } else {
                        "already running:"
                    }
                );
            }
        }
        Command::Timeout { id, seconds } => {
            api.call(
                Method::POST,
                &format!("/sandboxes/{id}/timeout"),
                Some(json!({"timeout": seconds})),
            )
            .await?;
            println!("{id} ends in {seconds} s");
        }
        Command::Snapshot(SnapshotCmd::Create {
            id,
            name,
            filesystem,
        }) => {
            let mut body = json!({"memory": !filesystem});
            if let Some(n) = name {
                body["name"] = json!(n);
            }
            let pb = spinner(&format!("snapshotting {id}"));
            let r = api
                .call(
                    Method::POST,
                    &format!("/sandboxes/{id}/snapshots"),
                    Some(body),
                )
                .await;
            pb.finish_and_clear();
            let (_, v) = r?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("{}", s(&v, "snapshotID"));
            }
        }
        Command::Snapshot(SnapshotCmd::Ls { sandbox }) => {
            let mut all = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let mut q = vec![("limit".to_string(), "100".to_string())];
                if let Some(sb) = sandbox {
                    q.push(("sandboxID".into(), sb.clone()));
                }
                if let Some(t) = &token {
                    q.push(("nextToken".into(), t.clone()));
                }
                let qs = q
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join("&");
                let (v, next) = api
                    .call_with_header(Method::GET, &format!("/snapshots?{qs}"), "x-next-token")
                    .await?;
                all.extend(v.as_array().cloned().unwrap_or_default());
                token = next;
                if token.is_none() {
                    break;
                }
            }
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                let rows = all
                    .iter()
                    .map(|x| {
                        let names = x["names"]
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter_map(Value::as_str)
                                    .collect::<Vec<_>>()
                                    .join(",")
                            })
                            .unwrap_or_default();
                        vec![s(x, "snapshotID"), names]
                    })
                    .collect();
                print_table(&["SNAPSHOT", "NAMES"], rows);
            }
        }
        Command::Snapshot(SnapshotCmd::Rm { ids }) => {
            if ids.is_empty() {
                bail!("name at least one snapshot");
            }
            for id in ids {
                api.call(Method::DELETE, &format!("/templates/{id}"), None)
                    .await?;
                println!("deleted {id}");
            }
        }
        Command::Fork { id, count, timeout } => {
            let pb = spinner(&format!("forking {id} x{count}"));
            let r = api
                .call(
                    Method::POST,
                    &format!("/sandboxes/{id}/fork"),
                    Some(json!({"count": count, "timeout": timeout})),
                )
                .await;
            pb.finish_and_clear();
            let (_, v) = r?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                let mut failed = 0;
                for f in v.as_array().into_iter().flatten() {
                    match f["sandbox"]["sandboxID"].as_str() {
                        Some(sid) => println!("{sid}"),
                        None => {
                            failed += 1;
                            eprintln!("fork failed: {}", f["error"]["message"]);
                        }
                    }
                }
                if failed > 0 {
                    return Ok(1);
                }
            }
        }
        Command::Rm { ids } => {
            if ids.is_empty() {
                bail!("name at least one sandbox");
            }
            for id in ids {
                api.call(Method::DELETE, &format!("/sandboxes/{id}"), None)
                    .await?;
                println!("killed {id}");
            }
        }
    }
    Ok(0)
}

fn form_query(state: Option<&str>, metadata: &[(String, String)]) -> String {
    let mut q = String::new();
    if let Some(st) = state {
        q.push_str(&format!("state={st}&"));
    }
    if !metadata.is_empty() {
        let inner: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("{}={}", pct(k), pct(v)))
            .collect();
        q.push_str(&format!("metadata={}&", pct(&inner.join("&"))));
    }
    q.push_str("limit=100");
    q
}

/// Percent-encodes everything but unreserved characters.
fn pct(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

impl ApiClient {
    async fn list_page(&self, query: &str) -> anyhow::Result<(Vec<Value>, Option<String>)> {
        let (items, next) = self
            .call_with_header(
                Method::GET,
                &format!("/v2/sandboxes?{query}"),
                "x-next-token",
            )
            .await?;
        Ok((
            items.as_array().cloned().unwrap_or_default(),
            next.map(|t| pct(&t)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_query_is_encoded_twice_and_decodes_back() {
        let pairs = vec![
            ("user".to_string(), "al ice&co".to_string()),
            ("k=1".to_string(), "ü".to_string()),
        ];
        let q = form_query(Some("running,paused"), &pairs);
        // Decode like the server: the query once, then the metadata value once more.
        let outer: Vec<(String, String)> = q
            .split('&')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), percent_decode(v))
            })
            .collect();
        let md = &outer.iter().find(|(k, _)| k == "metadata").unwrap().1;
        let inner: Vec<(String, String)> = md
            .split('&')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (percent_decode(k), percent_decode(v))
            })
            .collect();
        assert_eq!(inner, pairs);
        assert!(q.contains("state=running,paused") && q.ends_with("limit=100"));
    }

    fn percent_decode(s: &str) -> String {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn key_value_arguments() {
        assert_eq!(
            parse_kv("A=b=c").unwrap(),
            ("A".to_string(), "b=c".to_string())
        );
        assert!(parse_kv("novalue").is_err());
    }
}

/// One shell line from command words: a single word is taken as a shell line; several words are
/// each single-quoted where needed, so `sh -c 'echo hi > f'` keeps its argument whole.
fn shell_line(words: &[String]) -> String {
    if let [line] = words {
        return line.clone();
    }
    let quote = |w: &String| {
        let plain = !w.is_empty()
            && w.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
        if plain {
            w.clone()
        } else {
            format!("'{}'", w.replace('\'', "'\\''"))
        }
    };
    words.iter().map(quote).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod shell_line_tests {
    use super::shell_line;

    fn words(w: &[&str]) -> Vec<String> {
        w.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn quotes_each_word_and_keeps_a_single_line() {
        assert_eq!(shell_line(&words(&["ls | wc -l"])), "ls | wc -l");
        assert_eq!(
            shell_line(&words(&["sh", "-c", "echo hi > /tmp/f"])),
            "sh -c 'echo hi > /tmp/f'"
        );
        assert_eq!(
            shell_line(&words(&["echo", "it's", ""])),
            "echo 'it'\\''s' ''"
        );
    }

    #[test]
    fn quoted_line_round_trips_through_sh() {
        let w = words(&["printf", "%s|", "a b", "it's", "$HOME", "*"]);
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(shell_line(&w))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a b|it's|$HOME|*|");
    }
}
