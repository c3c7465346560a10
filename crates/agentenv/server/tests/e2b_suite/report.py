"""One table of E2B suite results: the server-facing tests (folders api_*, sandbox_*, template_*) that
failed, each matched against expected.tsv. Usage: report.py [--all] EXPECTED.tsv LABEL JUNIT.xml... (--all: every
test, whatever its folder: the code-interpreter suite). Exit 1 when a failure is not expected."""

import sys
import xml.etree.ElementTree as ET

SERVER_FACING = ("api", "sandbox", "template")


def expected(path):
    rows = []
    for line in open(path, encoding="utf-8"):
        if line.strip() and not line.startswith("#"):
            name, kind, why = line.rstrip("\n").split("\t")
            rows.append((name, kind, why))
    return rows


def main():
    args = sys.argv[1:]
    every = args[:1] == ["--all"]
    args = args[1:] if every else args
    table, label, xmls = expected(args[0]), args[1], args[2:]
    kinds = ("passed", "skipped", "environment", "skew", "open", "unexpected")
    counts, per_suite = dict.fromkeys(kinds, 0), {}
    lines = []
    for xml in xmls:
        suite = xml.rsplit("/", 1)[-1].removesuffix(".xml")
        mine = per_suite.setdefault(suite, dict.fromkeys(kinds, 0))
        try:
            cases = list(ET.parse(xml).iter("testcase"))
        except (OSError, ET.ParseError) as e:
            print(f"{suite}: no results ({e})")
            counts["unexpected"] += 1
            mine["unexpected"] += 1
            continue
        for tc in cases:
            parts = (tc.get("classname") or "").split(".")
            folder = next((p for p in parts if p.split("_")[0] in SERVER_FACING), None)
            if folder is None and not every:
                continue
            tags = {c.tag for c in tc}
            name = tc.get("name", "")
            if "skipped" in tags:
                kind = "skipped"
            elif not tags & {"failure", "error"}:
                kind = "passed"
            else:
                hit = next((r for r in table if name.startswith(r[0]) or f"{parts[-1]}::{name}".startswith(r[0])), None)
                kind, why = (hit[1], hit[2]) if hit else ("unexpected", "")
                lines.append(f"| {suite} | {parts[-1]}::{name} | {kind} | {why} |")
            counts[kind] += 1
            mine[kind] += 1
    print(f"{label}: failing tests" if every else f"E2B SDK suites, {label}: failing server-facing tests")
    print("| suite | test | kind | why |\n|---|---|---|---|")
    print("\n".join(sorted(lines)) or "| - | none | | |")
    if len(per_suite) > 1:
        for suite, c in per_suite.items():
            print(f"{suite}: " + ", ".join(f"{v} {k}" for k, v in c.items()))
    print(", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if counts["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
