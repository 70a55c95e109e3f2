"""Run the reliability catalogue (tests/catalogue_cases.py) and print one markdown row per case.

    python scripts/lab/reliability_table.py [--only ID,ID] [--json OUT.json] [--before BEFORE.json] [--after AFTER.json]

Run it with an older checkout's interpreter (its mirrorsd installed) and --json to record the "before" column, then
with this one and --before to print both columns side by side (--after prints a recorded run instead of running);
docs/reliability.md is such a table.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from catalogue import Workspace, execute  # noqa: E402
from catalogue_cases import CASES  # noqa: E402
from catalogue_native import CASES as NATIVE_CASES  # noqa: E402

CASES = CASES + NATIVE_CASES
from catalogue_fixtures import build_fixtures  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated case ids")
    parser.add_argument("--json", type=Path, help="write {case id: summary, ok} here")
    parser.add_argument("--before", type=Path, help="a --json file of an older run: printed as the before column")
    parser.add_argument("--after", type=Path, help="a --json file of this run: print it instead of running")
    args = parser.parse_args()
    only = {c for c in args.only.split(",") if c}
    before = json.loads(args.before.read_text()) if args.before else {}
    record = json.loads(args.after.read_text()) if args.after else run_cases(only, args.json)
    rows = [f"| {c.id} | {c.issue} | {cell(c.what)} | {observed(before.get(c.id))} | {observed(record[c.id])} |"
            for c in CASES if c.id in record]
    print("| case | issue | what | before | after |\n|---|---|---|---|---|\n" + "\n".join(rows))
    return 0 if all(r["ok"] for r in record.values()) else 1


SUMMARIZED = ("exit", "traceback", "lost", "left", "still running", "took")  # problems the summary already shows


def observed(entry: dict | None) -> str:
    """The summary of a recorded outcome, plus the problems it does not show (noise on stderr, failed checks)."""
    if not entry:
        return ""
    extra = [p[:100] for p in entry["problems"] if not p.startswith(SUMMARIZED)]
    return cell("; ".join([entry["summary"], *extra]))


def cell(text: str) -> str:
    """A table cell: no workspace paths, no pipes."""
    return re.sub(r"/tmp/catalogue-[^/ ]+/[^/ `']+/?", "", text).replace("|", "\\|")


def run_cases(only: set[str], json_path: Path | None) -> dict:
    record = {}
    with tempfile.TemporaryDirectory(prefix="catalogue-") as tmp:
        fixtures = build_fixtures(Path(tmp) / "fixtures")
        for case in CASES:
            if only and case.id not in only:
                continue
            workspace = Workspace(Path(tmp) / case.id, fixtures)
            outcome = execute(case, workspace)
            problems = outcome.problems(case, workspace)
            record[case.id] = {"summary": outcome.summary(), "ok": not problems, "problems": problems}
            print(f"{case.id}: {'ok' if not problems else 'PROBLEMS ' + '; '.join(problems)}", file=sys.stderr,
                  flush=True)
            if json_path:  # after every case: a long run that breaks off keeps what it has
                json_path.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    sys.exit(main())
