//! References to the project's specs and notes must resolve.
//!
//! The one reference form is `docs/specs/<name>.md §N[.M...]`, optionally continued as a list
//! (`, §N`, ` and §N`, ` or §N`, `–§N`). Checked: the spec file exists and every section number is a
//! heading (`## N.` or `### N.M`) in it. Inside `docs/specs/<name>.md` a bare `§N` means that file.
//! Flagged: a `§N` that names no spec, a spec named without `docs/specs/`, and a `notes/...` path
//! that is no file in the repository.

use std::collections::BTreeSet;
use std::path::Path;

use crate::util;

/// Where references must resolve. Extend this list as the owners of the other areas repoint their
/// references (flashkda still cites the old specs).
pub const SCOPE: &[&str] = &[
    "README.md",
    "ARCHITECTURE.md",
    "docs/specs",
    "docs/benchmarks.md",
    ".github",
    ".ci",
    "ci",
    "xtask",
    "benches",
    "crates/k3-common",
    "crates/moonep",
    "crates/flashkda",
    "crates/agentenv/guest",
    "crates/agentenv/mux",
    "crates/agentenv/cli",
    "crates/agentenv/server",
    "crates/agentenv/runtime",
    "crates/agentenv/envd",
    "crates/agentenv/oci",
];

/// Historical records, never rewritten: the reports of past runs quote the notes of their day.
const EXEMPT: &[&str] = &["docs/reports", "target"];

const TEXT_SUFFIXES: &[&str] = &[
    ".rs", ".md", ".cu", ".cuh", ".py", ".sh", ".yml", ".yaml", ".toml", ".pyi",
];

const SECTION: char = '\u{a7}';
const SPEC_DIR: &str = "docs/specs/";

/// Problems in [`SCOPE`].
pub fn check(root: &Path) -> Vec<String> {
    check_files(root, &files(root, in_scope))
}

/// Problems outside [`SCOPE`]: what the owners still have to repoint (reported, not failed).
pub fn pending(root: &Path) -> Vec<String> {
    check_files(root, &files(root, |rel| !in_scope(rel)))
}

fn in_scope(rel: &str) -> bool {
    SCOPE
        .iter()
        .any(|s| rel == *s || rel.starts_with(&format!("{s}/")))
}

fn files(root: &Path, keep: impl Fn(&str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    for suffix in TEXT_SUFFIXES {
        for f in util::files_with_suffix(root, suffix) {
            let rel = rel_path(root, &f);
            if !EXEMPT.iter().any(|e| rel.starts_with(&format!("{e}/"))) && keep(&rel) {
                out.push(rel);
            }
        }
    }
    // Dot folders are skipped by the walk: add the ones in scope explicitly.
    for dot in [".github", ".ci"] {
        for f in util::files_with_suffix(&root.join(dot), "") {
            let rel = rel_path(root, &f);
            if keep(&rel) && !out.contains(&rel) {
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

fn rel_path(root: &Path, f: &Path) -> String {
    f.strip_prefix(root).unwrap_or(f).display().to_string()
}

fn check_files(root: &Path, rels: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for rel in rels {
        if let Ok(text) = std::fs::read_to_string(root.join(rel)) {
            problems.extend(check_text(root, rel, &text));
        }
    }
    problems
}

/// Section numbers that are headings of the spec `name` (`kda` for `docs/specs/kda.md`).
fn headings(root: &Path, name: &str) -> Option<BTreeSet<String>> {
    let text = std::fs::read_to_string(root.join(format!("{SPEC_DIR}{name}.md"))).ok()?;
    Some(
        text.lines()
            .filter_map(|l| {
                let rest = l.trim_start_matches('#');
                if rest.len() == l.len() || !rest.starts_with(' ') {
                    return None;
                }
                let num = rest.split_whitespace().next()?;
                let num = num.trim_end_matches('.');
                (!num.is_empty() && num.split('.').all(|p| p.parse::<u32>().is_ok()))
                    .then(|| num.to_string())
            })
            .collect(),
    )
}

/// Every problem with the references in one file's `text`.
pub fn check_text(root: &Path, rel: &str, text: &str) -> Vec<String> {
    let own_spec = rel
        .strip_prefix(SPEC_DIR)
        .and_then(|n| n.strip_suffix(".md"))
        .filter(|n| !n.contains('/'));
    let spec_names: Vec<String> = std::fs::read_dir(root.join(SPEC_DIR))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_suffix(".md"))
                        .map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = |msg: String| format!("{rel}:{}: {msg}", i + 1);
        let mut covered = BTreeSet::new();
        // Qualified references.
        let mut from = 0;
        while let Some(p) = line[from..].find(SPEC_DIR) {
            let start = from + p + SPEC_DIR.len();
            from = start;
            let name: String = line[start..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            if !line[start + name.len()..].starts_with(".md") {
                continue;
            }
            let Some(heads) = headings(root, &name) else {
                problems.push(at(format!("{SPEC_DIR}{name}.md does not exist")));
                continue;
            };
            let after = start + name.len() + 3;
            for (pos, num) in section_list(line, after) {
                covered.insert(pos);
                if !heads.contains(&num) {
                    problems.push(at(format!(
                        "{SPEC_DIR}{name}.md has no section {SECTION}{num}"
                    )));
                }
            }
        }
        // Bare section numbers.
        for (pos, _) in line.match_indices(SECTION) {
            if covered.contains(&pos) {
                continue;
            }
            let Some(num) = number_at(line, pos + SECTION.len_utf8()) else {
                continue;
            };
            match own_spec {
                Some(name) => {
                    if !headings(root, name).is_some_and(|h| h.contains(&num)) {
                        problems.push(at(format!("{SECTION}{num} is no section of this spec")));
                    }
                }
                None => problems.push(at(format!(
                    "`{SECTION}{num}` names no spec: write `{SPEC_DIR}<spec>.md {SECTION}{num}`"
                ))),
            }
        }
        // A spec named without its folder.
        for name in &spec_names {
            let file = format!("{name}.md");
            for (pos, _) in line.match_indices(&file) {
                let before = &line[..pos];
                let prev = before.chars().next_back();
                if before.ends_with(SPEC_DIR)
                    || prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                {
                    continue;
                }
                problems.push(at(format!(
                    "spec `{file}` named without its folder: write `{SPEC_DIR}{file}`"
                )));
            }
        }
        // Notes must be files of this repository.
        for (pos, _) in line.match_indices("notes/") {
            let token = path_token(line, pos);
            let segment_start = token.rfind("notes/").map_or(0, |p| p);
            let is_notes_dir = segment_start == 0 || token[..segment_start].ends_with('/');
            let target = token.trim_end_matches(['.', ',', ':', ')']);
            if !is_notes_dir || target.ends_with("notes/") {
                continue;
            }
            if !root.join(target).exists() {
                problems.push(at(format!(
                    "`{target}` is no file of this repository (move the fact into docs/specs or drop the reference)"
                )));
            }
        }
    }
    problems
}

/// The section numbers of a list starting at byte `at` (after `docs/specs/<name>.md`): `(§ position, number)`.
fn section_list(line: &str, mut at: usize) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    at += line[at..].len() - line[at..].trim_start_matches(['`', ' ']).len();
    loop {
        if !line[at..].starts_with(SECTION) {
            break;
        }
        let Some(num) = number_at(line, at + SECTION.len_utf8()) else {
            break;
        };
        out.push((at, num.clone()));
        let mut next = at + SECTION.len_utf8();
        next += line[next..].len() - line[next..].trim_start().len();
        next += line[next..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .count();
        let rest = &line[next..];
        let sep = [", ", ",", " and ", " or ", "\u{2013}", "-", " \u{2013} "]
            .iter()
            .find(|s| rest.starts_with(**s) && rest[s.len()..].starts_with(SECTION));
        match sep {
            Some(s) => at = next + s.len(),
            None => break,
        }
    }
    out
}

/// The section number right after a `§` (an optional space allowed), without a trailing dot.
fn number_at(line: &str, at: usize) -> Option<String> {
    let rest = line[at..].strip_prefix(' ').unwrap_or(&line[at..]);
    let num: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let num = num.trim_end_matches('.');
    (!num.is_empty() && num.split('.').all(|p| p.parse::<u32>().is_ok())).then(|| num.to_string())
}

/// The path-like token around byte `pos`.
fn path_token(line: &str, pos: usize) -> &str {
    let is_path = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/');
    let start = line[..pos]
        .char_indices()
        .rev()
        .take_while(|(_, c)| is_path(*c))
        .last()
        .map_or(pos, |(i, _)| i);
    let end = line[pos..]
        .char_indices()
        .find(|(_, c)| !is_path(*c))
        .map_or(line.len(), |(i, _)| pos + i);
    &line[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A repository with one spec of two sections.
    fn repo() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("docs/specs")).unwrap();
        std::fs::create_dir_all(dir.path().join(fixture("docs/NOTES"))).unwrap();
        std::fs::write(
            dir.path().join(fixture("SPECS/KDA_MD")),
            "# KDA\n\n## 1. Math\n\n### 1.3 Recurrence\n\n## 2. API\n",
        )
        .unwrap();
        std::fs::write(dir.path().join(fixture("docs/NOTES/gpu.md")), "x").unwrap();
        dir
    }

    /// Writes the fixtures so that this file itself holds no reference: `@` is the section sign,
    /// `NOTES` the notes folder, `KDA_MD` the bare spec file name.
    fn fixture(text: &str) -> String {
        text.replace('@', "\u{a7}")
            .replace("NOTES", "notes")
            .replace("KDA_MD", concat!("kda", ".md"))
            .replace("SPECS/", SPEC_DIR)
    }

    fn problems(text: &str) -> Vec<String> {
        let r = repo();
        check_text(r.path(), "src/lib.rs", &fixture(text))
    }

    #[test]
    fn resolving_references_pass() {
        for ok in [
            "see SPECS/KDA_MD @1.3",
            "see SPECS/KDA_MD @1, @2 and @1.3",
            "SPECS/KDA_MD @1\u{2013}@2; also docs/NOTES/gpu.md",
            "`SPECS/KDA_MD` @2",
            "SPECS/KDA_MD (the whole spec)",
            "release notes/ and footnotes/x are prose",
        ] {
            assert_eq!(problems(ok), Vec::<String>::new(), "{ok}");
        }
    }

    #[test]
    fn broken_references_fail() {
        let cases = [
            ("spec @1.3", "names no spec"),
            ("SPECS/KDA_MD @4", "no section \u{a7}4"),
            ("SPECS/KDA_MD @1, @1.9", "no section \u{a7}1.9"),
            ("SPECS/moonep2.md @2", "moonep2.md does not exist"),
            ("spec `KDA_MD` @1", "named without its folder"),
            ("see NOTES/gpu-workflow.md", "no file of this repository"),
            ("SPECS/KDA_MD @1 and later @2", "names no spec"),
        ];
        for (text, want) in cases {
            let p = problems(text);
            assert!(
                p.iter().any(|m| m.contains(want)),
                "{text:?}: expected `{want}` in {p:?}"
            );
            assert!(p[0].starts_with("src/lib.rs:1: "), "{p:?}");
        }
    }

    #[test]
    fn a_spec_may_cite_its_own_sections_bare() {
        let r = repo();
        let own = |t: &str| check_text(r.path(), &fixture("SPECS/KDA_MD"), &fixture(t));
        assert!(own("as in @1.3").is_empty());
        assert!(own("as in @7")[0].contains("no section of this spec"));
    }

    #[test]
    fn the_checked_scope_of_this_repository_resolves() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let p = check(root);
        assert!(p.is_empty(), "unresolved references:\n{}", p.join("\n"));
    }
}
