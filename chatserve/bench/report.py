"""Shared reporting for the benchmarks: goal checks, the metric/value/goal table, the run stamp, the
`--json` flag and the printing of a result (in-process ones); the HTTP ones' results written to --out too.

Only formatting; each benchmark module owns its measurements and its GOALS.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from typing import Any, Callable, Coroutine

Goals = dict[str, tuple[str, float]]          # key → (comparison "<" or ">=", bound)
Row = tuple[str, str, str]                    # (key, label, format)


def run_stamp() -> dict[str, str]:
    """When and under which Python a result was measured (kept in each benchmark's `config`)."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "python": sys.version.split()[0]}


def goals_met(res: dict, goals: Goals) -> dict[str, bool]:
    return {k: (res[k] < b if op == "<" else res[k] >= b) for k, (op, b) in goals.items()}


def goal_table(res: dict, rows: list[Row], goals: Goals, label_width: int = 42) -> str:
    """One line per row: label, formatted value, and the goal with ok/MISSED where there is one."""
    lines = [f"{'metric':<{label_width}} {'value':>10}  goal"]
    for key, label, fmt in rows:
        goal = ""
        if key in goals:
            op, b = goals[key]
            goal = f"{op} {b:g}  " + ("ok" if res["goals_met"][key] else "MISSED")
        lines.append(f"{label:<{label_width}} {fmt.format(res[key]):>10}  {goal}")
    return "\n".join(lines)


def bench_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """The argument parser of an in-process benchmark, with the `--json` flag they all take."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return ap


def print_result(res: dict, as_json: bool, table: Callable[[dict], str]) -> int:
    """Print one result, as a JSON object with sorted keys or as its table; returns 0, the exit status."""
    print(json.dumps(res, sort_keys=True) if as_json else table(res))
    return 0


def write_results(res: dict, out: str | None, as_json: bool, report: Callable[[dict], str]) -> None:
    """The results as indented JSON into the file `out` when given, and on stdout as that JSON
    (`as_json`) or as `report` formats them."""
    text = json.dumps(res, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text if as_json else report(res))


def run_to_results(name: str, run: Callable[[argparse.Namespace], Coroutine[Any, Any, dict]],
                   args: argparse.Namespace, report: Callable[[dict], str]) -> dict | None:
    """A load-generating bench's main: run it, write its results (write_results) and return them; None
    (after one line on stderr) when the server could not be reached or the run failed."""
    import asyncio

    import httpx
    try:
        res = asyncio.run(run(args))
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"chatserve bench {name}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    write_results(res, args.out, args.json, report)
    return res
