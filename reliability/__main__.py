"""`python -m reliability [--fast] [--only NAME ...] [--render]` (`make reliability`).

Runs the fault-injection rows (all, or the fast subset), then writes
benchmarks/results/reliability.json and, from it, docs/RELIABILITY.md. Rows not run this time
keep their last recorded result (each row carries its own date and command); a row never run is
listed as not measured. Exits 1 if a row run now lost data or failed more than it allows.
`--render` runs nothing: it regenerates docs/RELIABILITY.md from the stored results.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from reliability import BY_NAME, ROWS, make_row, passed, row_function
from reliability.report import RESULTS, render, write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability", description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="only the fast rows (the ones `make test` runs)")
    parser.add_argument("--only", nargs="+", choices=sorted(BY_NAME), help="run just these rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--render", action="store_true",
                        help="run nothing; regenerate docs/RELIABILITY.md from benchmarks/results/reliability.json")
    args = parser.parse_args(argv)
    if args.render:
        print(f"{render()} regenerated from {RESULTS}", file=sys.stderr)
        return 0
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    names = args.only or [r.name for r in ROWS if r.fast or r.recorded or not args.fast]
    command = "python -m reliability " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    scratch = Path(tempfile.mkdtemp(prefix="workflows-reliability-"))
    rows, bad = [], []
    for name in names:
        print(f"reliability: {name} ...", file=sys.stderr, flush=True)
        t0 = time.time()
        workdir = scratch / name
        workdir.mkdir()
        try:
            fn = row_function(name)
            kwargs = {"full": True} if "full" in inspect.signature(fn).parameters and not args.fast else {}
            row = fn(workdir, seed=args.seed, **kwargs)
        except Exception as e:  # noqa: BLE001 - a row that crashes is a failed row, reported
            traceback.print_exc()
            row = make_row(
                name,
                injected=None,
                survived=0,
                failed=1,
                allowed_failures=0,
                lost=0,
                detail=f"the row itself crashed: {type(e).__name__}: {str(e)[:300]}",
            )
        row.setdefault("seconds", round(time.time() - t0, 1))
        row["command"] = command.strip()
        if row.get("measured") is not False:  # a recorded row keeps its source's date; an absent one has none
            row["measured_at"] = row.get("measured_at") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        row["fast"] = BY_NAME[name].fast
        ok = passed(row)
        print(
            f"reliability: {name}: injected {row['injected']}, survived {row['survived']}, failed {row['failed']} "
            f"(allowed {row['allowed_failures']}), lost {row['lost']} -> "
            f"{'ok' if ok else 'not measured' if ok is None else 'FAILED'} ({row['seconds']}s)",
            file=sys.stderr,
            flush=True,
        )
        if ok is False:
            bad.append(name)
        rows.append(row)
    results, doc = write_results(rows, command.strip())
    print(f"results written to {results} and {doc}", file=sys.stderr)
    if not args.keep:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"scratch kept in {scratch}", file=sys.stderr)
    if bad:
        print(f"reliability: rows that lost data or failed more than allowed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
