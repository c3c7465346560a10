//! The Dockerfile subset `aenv template build --dockerfile` takes: FROM (a template or an OCI image), RUN,
//! COPY (`--chown`, `--chmod`), ENV, WORKDIR, USER and CMD, turned into the template builder's steps.
//! LABEL and EXPOSE are ignored; anything else is an error that names its line.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sha2::Digest;

/// A parsed Dockerfile.
#[derive(Debug, Default, PartialEq)]
pub struct Recipe {
    pub from: String,
    /// Builder steps (`{"type", "args", "filesHash"?}`).
    pub steps: Vec<Value>,
    /// COPY sources, in step order: (source, destination).
    pub copies: Vec<(String, String)>,
    pub start_cmd: Option<String>,
    /// Lines ignored, for a warning.
    pub ignored: Vec<String>,
}

fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:@%+,".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A shell-form command, or an exec-form JSON array joined into one shell command.
fn command(rest: &str) -> anyhow::Result<String> {
    let rest = rest.trim();
    if rest.starts_with('[') {
        let argv: Vec<String> =
            serde_json::from_str(rest).context("exec form is a JSON array of strings")?;
        return Ok(argv
            .iter()
            .map(|a| shell_word(a))
            .collect::<Vec<_>>()
            .join(" "));
    }
    Ok(rest.to_string())
}

fn unquote(s: &str) -> String {
    let t = s.trim();
    if t.len() >= 2
        && (t.starts_with('"') && t.ends_with('"') || t.starts_with('\'') && t.ends_with('\''))
    {
        return t[1..t.len() - 1].to_string();
    }
    t.to_string()
}

/// Parses `text`.
pub fn parse(text: &str) -> anyhow::Result<Recipe> {
    let mut r = Recipe::default();
    let mut logical: Vec<(usize, String)> = vec![];
    let mut cur = String::new();
    let mut start = 0;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if cur.is_empty() {
            start = i + 1;
        }
        match t.strip_suffix('\\') {
            Some(head) => {
                cur.push_str(head);
                cur.push(' ');
            }
            None => {
                cur.push_str(t);
                logical.push((start, std::mem::take(&mut cur)));
            }
        }
    }
    if !cur.is_empty() {
        logical.push((start, cur));
    }
    for (line, text) in logical {
        let (word, rest) = text.split_once(char::is_whitespace).unwrap_or((&text, ""));
        let rest = rest.trim();
        let at = || format!("line {line}: {word}");
        match word.to_ascii_uppercase().as_str() {
            "FROM" => {
                if !r.from.is_empty() {
                    bail!("{}: one FROM only (no multi-stage builds)", at());
                }
                r.from = rest.split_whitespace().next().unwrap_or("").to_string();
                if r.from.is_empty() {
                    bail!("{}: FROM needs a template or image", at());
                }
            }
            _ if r.from.is_empty() => bail!("{}: the first instruction is FROM", at()),
            "RUN" => r
                .steps
                .push(json!({"type": "RUN", "args": [command(rest).with_context(at)?]})),
            "ADD" => bail!("{}: ADD is not supported; use COPY", at()),
            "COPY" => {
                let mut words: Vec<String> = if rest.starts_with('[') {
                    serde_json::from_str(rest).with_context(|| format!("{}: a JSON array", at()))?
                } else {
                    rest.split_whitespace().map(str::to_string).collect()
                };
                let (mut user, mut mode) = (String::new(), String::new());
                while words.first().is_some_and(|w| w.starts_with("--")) {
                    let flag = words.remove(0);
                    match flag.split_once('=') {
                        Some(("--chown", v)) => user = v.to_string(),
                        Some(("--chmod", v)) => {
                            mode = format!(
                                "{:04o}",
                                u32::from_str_radix(v, 8)
                                    .with_context(|| format!("{}: --chmod is octal", at()))?
                            )
                        }
                        _ => bail!("{}: unsupported flag {flag}", at()),
                    }
                }
                if words.len() < 2 {
                    bail!("{}: COPY <src>... <dest>", at());
                }
                let dest = words.pop().unwrap_or_default();
                for src in words {
                    if src.starts_with('/')
                        || src.split('/').any(|c| c == "..")
                        || src.contains(['*', '?', '['])
                    {
                        bail!(
                            "{}: {src}: a source is a plain path inside the build context",
                            at()
                        );
                    }
                    r.copies.push((src.clone(), dest.clone()));
                    r.steps
                        .push(json!({"type": "COPY", "args": [src, dest, user, mode]}));
                }
            }
            "ENV" => {
                let mut args = vec![];
                if rest.contains('=') {
                    for kv in split_env(rest) {
                        let (k, v) = kv
                            .split_once('=')
                            .with_context(|| format!("{}: {kv} is not KEY=VALUE", at()))?;
                        args.extend([k.to_string(), unquote(v)]);
                    }
                } else {
                    let (k, v) = rest
                        .split_once(char::is_whitespace)
                        .with_context(|| format!("{}: ENV KEY VALUE", at()))?;
                    args.extend([k.to_string(), unquote(v)]);
                }
                r.steps.push(json!({"type": "ENV", "args": args}));
            }
            "WORKDIR" => r
                .steps
                .push(json!({"type": "WORKDIR", "args": [unquote(rest)]})),
            "USER" => r.steps.push(json!({"type": "USER", "args": [rest]})),
            "CMD" => r.start_cmd = Some(command(rest).with_context(at)?),
            "LABEL" | "EXPOSE" => r.ignored.push(format!("line {line}: {text}")),
            _ => bail!(
                "{}: not supported (FROM, RUN, COPY, ENV, WORKDIR, USER, CMD)",
                at()
            ),
        }
    }
    if r.from.is_empty() {
        bail!("no FROM");
    }
    Ok(r)
}

/// `A=1 B="two words"` into its assignments.
fn split_env(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut quote) = (vec![], String::new(), None);
    for c in s.chars() {
        match (quote, c) {
            (None, '"' | '\'') => {
                quote = Some(c);
                cur.push(c);
            }
            (Some(q), c) if c == q => {
                quote = None;
                cur.push(c);
            }
            (None, c) if c.is_whitespace() => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            (_, c) => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The gzipped tar of `src` (a file or folder under `context`), named by its path in the context, and the
/// hash the builder stores it under.
pub fn archive(context: &Path, src: &str, dest: &str) -> anyhow::Result<(Vec<u8>, String)> {
    let path = context.join(src);
    let meta =
        std::fs::metadata(&path).with_context(|| format!("COPY {src}: {}", path.display()))?;
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    tar.follow_symlinks(true);
    let name = src.trim_end_matches('/');
    if meta.is_dir() {
        tar.append_dir_all(name, &path)?;
    } else {
        tar.append_path_with_name(&path, name)?;
    }
    let mut gz = tar.into_inner()?;
    gz.flush()?;
    let bytes = gz.finish()?;
    let mut h = sha2::Sha256::new();
    h.update(format!("COPY {src} {dest}").as_bytes());
    h.update(&bytes);
    let hash = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((bytes, hash))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subset_becomes_builder_steps() {
        let r = parse(
            "# app\nFROM base\nLABEL a=b\nRUN apt-get update && \\\n    apt-get install -y jq\nCOPY --chown=user --chmod=755 run.sh lib/ /app/\n\
             ENV A=1 B=\"two words\"\nENV C three\nWORKDIR /app\nUSER root\nCMD [\"python3\", \"-m\", \"http.server\", \"8000\"]\n",
        )
        .unwrap();
        assert_eq!(r.from, "base");
        assert_eq!(
            r.steps[0],
            json!({"type": "RUN", "args": ["apt-get update &&  apt-get install -y jq"]})
        );
        assert_eq!(
            r.steps[1],
            json!({"type": "COPY", "args": ["run.sh", "/app/", "user", "0755"]})
        );
        assert_eq!(r.steps[2]["args"][0], "lib/");
        assert_eq!(
            r.steps[3],
            json!({"type": "ENV", "args": ["A", "1", "B", "two words"]})
        );
        assert_eq!(r.steps[4], json!({"type": "ENV", "args": ["C", "three"]}));
        assert_eq!(r.steps[5], json!({"type": "WORKDIR", "args": ["/app"]}));
        assert_eq!(r.steps[6], json!({"type": "USER", "args": ["root"]}));
        assert_eq!(r.start_cmd.as_deref(), Some("python3 -m http.server 8000"));
        assert_eq!(r.copies.len(), 2);
        assert_eq!(r.ignored.len(), 1);
    }

    #[test]
    fn what_is_outside_the_subset_names_its_line() {
        for (text, want) in [
            ("RUN x", "first instruction is FROM"),
            ("FROM a\nFROM b", "one FROM"),
            ("FROM a\nARG X", "line 2: ARG: not supported"),
            ("FROM a\nADD x /y", "ADD is not supported"),
            ("FROM a\nCOPY ../secret /x", "inside the build context"),
            ("FROM a\nCOPY *.py /x", "plain path"),
            ("FROM a\nCOPY --from=b x /y", "unsupported flag"),
            ("FROM a\nCMD [\"unclosed\"", "JSON array"),
            ("", "no FROM"),
        ] {
            let e = format!("{:#}", parse(text).unwrap_err());
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn archives_hold_the_source_by_its_context_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("lib/sub")).unwrap();
        std::fs::write(dir.path().join("lib/sub/a.txt"), b"alpha").unwrap();
        std::fs::write(dir.path().join("run.sh"), b"echo hi").unwrap();
        let (bytes, hash) = archive(dir.path(), "lib", "/app/").unwrap();
        assert_eq!(hash.len(), 64);
        let mut names: Vec<String> = tar::Archive::new(flate2::read::GzDecoder::new(&bytes[..]))
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        names.sort();
        assert!(names.contains(&"lib/sub/a.txt".to_string()), "{names:?}");
        let (_, other) = archive(dir.path(), "run.sh", "/app/").unwrap();
        assert_ne!(hash, other);
        assert!(archive(dir.path(), "missing", "/x").is_err());
    }
}
