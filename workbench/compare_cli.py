"""``workbench compare A B [--reference BF16] --out DIR``: the subcommand's parser and body.

A and B are checkpoint folders or ``ptq:RECIPE[@PATH]`` (post-training quantization of the
reference, or of PATH); see ``workbench.analysis.compare``. Writes compare.csv, summary.txt and
the comparison figures; bad input prints one line and exits 2.
"""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="two checkpoints expert by expert against a BF16 reference",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("a", metavar="A", help="checkpoint folder, or ptq:RECIPE[@PATH]")
    p.add_argument("b", metavar="B", help="checkpoint folder, or ptq:RECIPE[@PATH] (e.g. ptq:mxfp4)")
    p.add_argument("--reference", help="BF16 checkpoint both sides are measured against")
    p.add_argument("--metric", default="rel_err", choices=("rel_err", "max_abs_err"))
    p.add_argument("--tol-pct", type=float, default=1.0,
                   help="a change of more than this many percent of B's error is "
                        "'improved' or 'worse'; up to it (inclusive) 'same' (default 1; 0: any "
                        "difference counts, equal errors are 'same')")
    p.add_argument("--out", default="compare-out", help="folder for compare.csv, figures, summary")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=run)


def run(args) -> int:
    from workbench.analysis.compare import CompareError, compare
    from workbench.checkpoint import CheckpointError
    from workbench.report import write_compare_report

    try:
        result = compare(args.a, args.b, args.reference, metric=args.metric,
                         tol_pct=args.tol_pct, device=args.device)
    except (CompareError, CheckpointError) as e:
        print(f"workbench compare: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    out, figs = write_compare_report(result, args.out)
    print(result.summary())
    print(f"\nwrote {out}/compare.csv, summary.txt and {len(figs)} figures")
    return 0
