//! The shell the builder runs in the guest: quoting, and the script of a COPY step.

/// `s` as one shell word.
pub(super) fn sh(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The guest-side script of a COPY: the archive on stdin is unpacked to a scratch folder, then `src`
/// (a path or glob in it) goes to `dest` as Docker's COPY does (a folder's contents into `dest`;
/// a file into `dest` when it ends with `/`, is a folder, or several match; else to `dest` itself).
pub(super) fn copy_script(
    src: &str,
    dest: &str,
    owner: &str,
    mode: Option<u32>,
    gzip: bool,
) -> String {
    let chmod = mode.map_or(String::new(), |m| format!("chmod -R {m:o} \"$t\"\n"));
    format!(
        r#"set -euo pipefail
t=$(mktemp -d /tmp/.copy.XXXXXX); trap 'rm -rf "$t" "$t.x"' EXIT
mkdir "$t.x"; tar -x{z} --no-same-owner -C "$t.x" -f -
mv "$t.x" "$t/x"; t="$t/x"; chown -R {owner} "$t"
{chmod}cd "$t"; shopt -s nullglob dotglob; m=( {src} )
[ ${{#m[@]}} -gt 0 ] || {{ echo "no files match {src_word} in the upload" >&2; exit 1; }}
d={dest}
for f in "${{m[@]}}"; do
  if [ -d "$f" ]; then mkdir -p "$d"; cp -a "$f"/. "$d"/
  elif [[ "$d" == */ ]] || [ -d "$d" ] || [ ${{#m[@]}} -gt 1 ]; then mkdir -p "$d"; cp -a "$f" "$d"/
  else mkdir -p "$(dirname "$d")"; cp -a "$f" "$d"; fi
done
"#,
        z = if gzip { "z" } else { "" },
        owner = sh(owner),
        // A glob stays a glob: only characters a path may not hold unquoted are escaped.
        src = src
            .chars()
            .map(|c| match c {
                '*' | '?' | '[' | ']' | '/' | '.' | '-' | '_' => c.to_string(),
                c if c.is_ascii_alphanumeric() => c.to_string(),
                c => format!("\\{c}"),
            })
            .collect::<String>(),
        src_word = sh(src).replace('"', ""),
        dest = sh(dest),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words_survive_quotes() {
        assert_eq!(sh("a'b"), r"'a'\''b'");
        let s = copy_script("dir/*.txt", "/home/user/x y/", "user", Some(0o755), true);
        assert!(s.contains("tar -xz"));
        assert!(s.contains("m=( dir/*.txt )"));
        assert!(s.contains("d='/home/user/x y/'"));
        assert!(s.contains("chmod -R 755"));
        let s = copy_script("a b;rm -rf /", "/d", "user", None, false);
        assert!(s.contains(r"m=( a\ b\;rm\ -rf\ / )"), "{s}");
    }
}
