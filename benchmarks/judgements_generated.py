"""The judgements (goodput ledger, fail-slow) on many generated shapes of job: the
families of tests/step_streams.py (healthy noise, stalls anywhere, slowdowns that
come back near the old level, creeps, restarts), each case against its stated truth.
``make test`` runs 500 a family with a fixed seed
(tests/unit/agent/reducers/test_judgements_generated.py);
this runs --cases a family (default 10,000) with a random seed, or --seed N, and
reports for each figure its worst error and its worst error against its bound, the
failures, and the false fail-slow rate, with the case of each.

    .venv/bin/python benchmarks/judgements_generated.py
    .venv/bin/python benchmarks/judgements_generated.py --cases 2000 --families stalls
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.step_streams import FAMILIES, run_family  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000, help="cases a family")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--seed", type=int, default=None, help="(default: a random one, printed)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}, {args.cases} cases a family", flush=True)
    failed = 0
    for family in args.families:
        began = time.monotonic()
        report = run_family(family, args.cases, derandomize=False, seed=seed)
        print("\n".join(report.lines()), flush=True)
        print(f"  ({time.monotonic() - began:.0f} s)", flush=True)
        failed += len(report.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
