//! What tidy can check of ARCHITECTURE.md: every folder it should map is mapped, every workspace member
//! has its own heading, and every path it names exists.
//!
//! A backticked path is resolved from the repository root, else from the folder of the nearest heading
//! above it that names one (`### \`crates/flashkda\``); a bare file name (`qemu.rs`) must exist somewhere
//! under that folder. Tokens with wildcards, braces, `::`, `=` or spaces are not paths and are skipped.

use std::path::Path;

/// Top-level folders that must have a paragraph.
const FOLDERS: &[&str] = &[
    "xtask",
    "benches",
    "ci",
    ".ci",
    ".github",
    "docs",
    "docs/specs",
    "docs/reports",
];

const PATH_SUFFIXES: &[&str] = &[
    ".rs", ".cu", ".cuh", ".md", ".py", ".pyi", ".toml", ".json", ".yml", ".yaml", ".sh", ".html",
];

pub fn check(root: &Path, arch: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut folders: Vec<String> = FOLDERS.iter().map(|s| s.to_string()).collect();
    for dir in ["crates", "crates/agentenv"] {
        if let Ok(rd) = std::fs::read_dir(root.join(dir)) {
            for e in rd.flatten().filter(|e| e.path().is_dir()) {
                folders.push(format!("{dir}/{}", e.file_name().to_string_lossy()));
            }
        }
    }
    for f in folders.iter().filter(|f| root.join(f).is_dir()) {
        if !arch.contains(&format!("`{f}`")) && !arch.contains(&format!("`{f}/`")) {
            problems.push(format!("ARCHITECTURE.md does not map the folder `{f}`"));
        }
    }
    for member in workspace_members(root) {
        let described = arch.lines().any(|l| {
            l.starts_with('#') && l.trim_start_matches('#').trim() == format!("`{member}`")
        });
        if !described {
            problems.push(format!(
                "ARCHITECTURE.md has no heading for the workspace member `{member}`"
            ));
        }
    }
    problems.extend(paths(root, arch));
    problems
}

/// `members` of the root Cargo.toml.
pub fn workspace_members(root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root.join("Cargo.toml")).unwrap_or_default();
    let Some(start) = text.find("members = [") else {
        return Vec::new();
    };
    let body = &text[start + "members = [".len()..];
    let body = &body[..body.find(']').unwrap_or(body.len())];
    body.split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect()
}

fn paths(root: &Path, arch: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut section = String::new();
    let mut in_code = false;
    for (i, line) in arch.lines().enumerate() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let tokens = backticked(line);
        if line.starts_with('#') {
            if let Some(t) = tokens.first()
                && root.join(t.trim_end_matches('/')).is_dir()
            {
                section = t.trim_end_matches('/').to_string();
            } else if !line.starts_with("####") {
                section.clear();
            }
        }
        for t in tokens {
            if !looks_like_path(t) || resolves(root, &section, t) {
                continue;
            }
            problems.push(format!(
                "ARCHITECTURE.md:{}: `{t}` does not exist{}",
                i + 1,
                if section.is_empty() {
                    String::new()
                } else {
                    format!(" (looked from the root and under `{section}`)")
                }
            ));
        }
    }
    problems
}

fn backticked(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

fn looks_like_path(t: &str) -> bool {
    let dot_folder = t.starts_with(".ci") || t.starts_with(".github") || t.starts_with(".cargo");
    if t.is_empty()
        || (t.starts_with(['/', '~', '-', '.']) && !dot_folder)
        || t.contains(['*', '{', '}', '<', '>', '$', '=', ' ', '(', '|', ','])
        || t.contains("::")
        || t.contains("://")
    {
        return false;
    }
    // `process.Process/Start` is an RPC name, not a path: only dot folders have dots before a slash.
    let mut dirs: Vec<&str> = t.trim_end_matches('/').split('/').collect();
    dirs.pop();
    if dirs.iter().any(|d| d.contains('.') && !d.starts_with('.')) {
        return false;
    }
    t.contains('/') || PATH_SUFFIXES.iter().any(|s| t.ends_with(s))
}

fn resolves(root: &Path, section: &str, t: &str) -> bool {
    let t = t.trim_end_matches('/');
    if root.join(t).exists() {
        return true;
    }
    if section.is_empty() {
        return false;
    }
    let base = root.join(section);
    if base.join(t).exists() {
        return true;
    }
    !t.contains('/') && named_below(&base, t)
}

/// True when a file or folder called `name` exists below `base` (build outputs excluded).
fn named_below(base: &Path, name: &str) -> bool {
    let mut stack = vec![base.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name() == name {
                return true;
            }
            let p = e.path();
            if p.is_dir() && e.file_name() != "target" {
                stack.push(p);
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        std::fs::create_dir_all(r.join("crates/a/src/deep")).unwrap();
        std::fs::write(r.join("crates/a/src/deep/qmp.rs"), "").unwrap();
        std::fs::write(
            r.join("Cargo.toml"),
            "[workspace]\nmembers = [\n    \"crates/a\",\n]\n",
        )
        .unwrap();
        dir
    }

    #[test]
    fn true_map_passes() {
        let r = repo();
        let arch = "### `crates/a`\nOnly `qmp.rs` knows QMP; see `src/deep/qmp.rs`, `crates/a/src`, \
                    `K3_LOG=json`, `a::b`, `*.cu`.\n";
        assert_eq!(check(r.path(), arch), Vec::<String>::new());
    }

    #[test]
    fn missing_paths_members_and_folders_fail() {
        let r = repo();
        let arch = "### `crates/a`\nOnly `qemu.rs` knows QEMU; `src/gone.rs`.\n## Other\n`src/deep/qmp.rs`\n";
        let p = check(r.path(), arch);
        assert!(
            p.iter().any(|m| m.contains("`qemu.rs` does not exist")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|m| m.contains("`src/gone.rs` does not exist")),
            "{p:?}"
        );
        assert!(
            p.iter()
                .any(|m| m.contains("ARCHITECTURE.md:4: `src/deep/qmp.rs`")),
            "a new top-level section resets the folder: {p:?}"
        );
        let p = check(r.path(), "nothing here\n");
        assert!(
            p.iter()
                .any(|m| m.contains("no heading for the workspace member `crates/a`"))
        );
        assert!(
            p.iter()
                .any(|m| m.contains("does not map the folder `crates/a`"))
        );
    }
}
