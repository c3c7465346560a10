//! Import loops inside agentenv's crates: a module that reaches another which reaches it back (through
//! `crate::` or `super::` paths, tests left out) is a loop. A module and its own ancestors or
//! descendants are not compared (a parent owns its children's items).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The import loops of every agentenv crate, one line per loop.
pub fn check(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let Ok(rd) = std::fs::read_dir(root.join("crates/agentenv")) else {
        return problems;
    };
    let mut crates: Vec<_> = rd.flatten().map(|e| e.path()).collect();
    crates.sort();
    for dir in crates {
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let graph = graph(&src);
        let rel = src.strip_prefix(root).unwrap_or(&src).display().to_string();
        for (krate, layers) in LAYERS {
            if rel == format!("crates/agentenv/{krate}/src") {
                problems.extend(upward(&rel, &graph, layers));
            }
        }
        for cycle in loops(&graph) {
            problems.push(format!(
                "{}: import loop between {}",
                src.strip_prefix(root).unwrap_or(&src).display(),
                cycle.join(" <-> ")
            ));
        }
    }
    problems
}

/// Crates whose top-level rooms are layered, lowest first: a room may use its own and lower rooms
/// (and the crate root's modules), never a higher one.
const LAYERS: &[(&str, &[&str])] = &[("runtime", &["net", "vmm", "image", "sync", "lifecycle"])];

/// Uses of a higher room, one line each.
fn upward(src: &str, g: &BTreeMap<String, BTreeSet<String>>, layers: &[&str]) -> Vec<String> {
    let layer = |m: &str| layers.iter().position(|l| m.split("::").next() == Some(*l));
    let mut out = Vec::new();
    for (m, to) in g {
        let Some(lm) = layer(m) else { continue };
        for t in to {
            if layer(t).is_some_and(|lt| lt > lm) {
                out.push(format!("{src}: {m} uses {t}, a higher room"));
            }
        }
    }
    out
}

/// Module path of a file under `src` (`net/mod.rs` → `net`, `net/slot.rs` → `net::slot`); `None` for
/// tests and binaries.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?.with_extension("");
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") || parts.iter().any(|p| p.contains("tests")) {
        return None;
    }
    let parts: Vec<&str> = parts
        .iter()
        .map(String::as_str)
        .filter(|p| !matches!(*p, "mod" | "lib" | "main"))
        .collect();
    Some(parts.join("::"))
}

/// Module → modules it names, from every non-test line of its file.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mods: BTreeMap<String, String> = files
        .iter()
        .filter_map(|f| Some((module_of(src, f)?, std::fs::read_to_string(f).ok()?)))
        .collect();
    let known: BTreeSet<&str> = mods.keys().map(String::as_str).collect();
    let mut g = BTreeMap::new();
    for (m, text) in &mods {
        // Code only: tests and comments (doc links) are not imports.
        let code: String = text
            .split("#[cfg(test)]")
            .next()
            .unwrap_or("")
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut to = BTreeSet::new();
        for path in paths(&code) {
            let segs: Vec<&str> = match path.strip_prefix("crate::") {
                Some(r) => r.split("::").collect(),
                None => {
                    let mut base: Vec<&str> = if m.is_empty() {
                        vec![]
                    } else {
                        m.split("::").collect()
                    };
                    let mut rest = path.as_str();
                    while let Some(r) = rest.strip_prefix("super::") {
                        base.pop();
                        rest = r;
                    }
                    base.extend(rest.split("::"));
                    base
                }
            };
            // The longest known module the path starts with.
            if let Some(t) = (1..=segs.len())
                .rev()
                .map(|n| segs[..n].join("::"))
                .find(|c| known.contains(c.as_str()))
                && !related(m, &t)
            {
                to.insert(t);
            }
        }
        g.insert(m.clone(), to);
    }
    g
}

/// Whether one module is the other or an ancestor of it.
fn related(a: &str, b: &str) -> bool {
    let under = |x: &str, y: &str| y.is_empty() || x == y || x.starts_with(&format!("{y}::"));
    under(a, b) || under(b, a)
}

/// Every `crate::a::b` and `super::a` path in `code`, with `{a, b::c}` groups expanded.
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for start in ["crate::", "super::"] {
        for (i, _) in code.match_indices(start) {
            if code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            expand(&code[i..], &mut out);
        }
    }
    out
}

/// Expands the path at the start of `s` (`a::b::{c, d::e}`) into `out`.
fn expand(s: &str, out: &mut Vec<String>) {
    let ident = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    let head_len = s.find(|c: char| !ident(c)).unwrap_or(s.len());
    let head = s[..head_len].trim_end_matches(':');
    if s[head_len..].starts_with('{') {
        let body = &s[head_len + 1..];
        let mut depth = 0;
        let mut item = 0;
        for (j, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    push(head, &body[item..j], out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    push(head, &body[item..j], out);
                    item = j + 1;
                }
                _ => {}
            }
        }
    } else {
        out.push(head.to_string());
    }
}

fn push(head: &str, item: &str, out: &mut Vec<String>) {
    let item = item.trim();
    if item.is_empty() || item == "self" {
        out.push(head.to_string());
    } else {
        expand(&format!("{head}::{item}"), out);
    }
}

/// The strongly connected parts of more than one module (Tarjan), each sorted.
fn loops(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut part = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                part.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if part.len() > 1 {
                part.sort();
                t.out.push(part);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_expand_and_loops_are_found_but_parents_are_not() {
        let mut p = paths("use crate::{a::{X, b}, c};\nlet y = super::d::f();\nfoo::crate::z;");
        p.sort();
        assert_eq!(p, ["crate::a::X", "crate::a::b", "crate::c", "super::d::f"]);
        let g: BTreeMap<String, BTreeSet<String>> = [
            ("a", vec!["b"]),
            ("b", vec!["c"]),
            ("c", vec!["a"]),
            ("d", vec!["a"]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
        .collect();
        assert_eq!(loops(&g), [["a", "b", "c"]]);
        assert!(related("net::slot", "net") && !related("net::slot", "net::policy"));
        assert!(related("x", ""));
        let g: BTreeMap<String, BTreeSet<String>> = [
            ("vmm::qemu", vec!["lifecycle::warm"]),
            ("lifecycle::warm", vec!["vmm::qemu", "config"]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
        .collect();
        let up = upward("x", &g, &["vmm", "lifecycle"]);
        assert_eq!(up, ["x: vmm::qemu uses lifecycle::warm, a higher room"]);
    }
}
