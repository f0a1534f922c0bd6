"""``workbench compare A B [--reference BF16] --out DIR``: the subcommand's parser and body.

A and B are checkpoints (folders, hub ids ``ORG/NAME[@REVISION]`` or URLs) or
``ptq:RECIPE[@CHECKPOINT]`` (post-training quantization of the reference, or of CHECKPOINT); see
``workbench.analysis.compare``. ``--layers`` / ``--experts`` restrict the comparison (and the
bytes read). Writes compare.csv, summary.txt and the comparison figures; bad input prints one
``error:`` line and exits 2.
"""

from __future__ import annotations

import sys

from workbench.source import SourceError


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="two checkpoints expert by expert against a BF16 reference",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("a", metavar="A", help="checkpoint (folder, hub id ORG/NAME[@REVISION], "
                   "URL), or ptq:RECIPE[@CHECKPOINT]")
    p.add_argument("b", metavar="B", help="checkpoint, or ptq:RECIPE[@CHECKPOINT] (e.g. "
                   "ptq:mxfp4)")
    p.add_argument("--reference", help="BF16 checkpoint both sides are measured against")
    p.add_argument("--metric", default="rel_err", choices=("rel_err", "max_abs_err"))
    p.add_argument("--tol-pct", type=float, default=1.0,
                   help="a change of more than this many percent of B's error is "
                        "'improved' or 'worse'; up to it (inclusive) 'same' (default 1; 0: any "
                        "difference counts, equal errors are 'same')")
    p.add_argument("--out", default="compare-out", help="folder for compare.csv, figures, summary")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_selection(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from workbench.analysis.compare import CompareError, compare
    from workbench.checkpoint import CheckpointError
    from workbench.checkpoint.select import Selection
    from workbench.report import source_lines, write_compare_report

    try:
        select = Selection.of(args.layers, args.experts)
        result = compare(args.a, args.b, args.reference, metric=args.metric,
                         tol_pct=args.tol_pct, device=args.device, select=select)
    except CheckpointError as e:
        print(f"workbench {args.cmd}: error: {e.one_line()}", file=sys.stderr)
        return 2
    except (CompareError, SourceError, ValueError) as e:  # a selection that keeps nothing too
        print(f"workbench {args.cmd}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    lines = []
    for label, ck in result.checkpoints.items():
        lines += source_lines(ck, names=(label,))
    result.notes = [*lines, *([f"selection: {select}"] if not select.everything else [])]
    out, figs = write_compare_report(result, args.out)
    print(result.summary())
    print(f"\nwrote {out}/compare.csv, summary.txt and {len(figs)} figures")
    return 0


def one_line(text: str, limit: int = 400) -> str:
    """The first line of ``text``, printable (control characters escaped), cut to ``limit``."""
    text = text.split("\n", 1)[0] if text else text
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def add_selection(p) -> None:
    """--layers / --experts: the part of the checkpoint a question reads."""
    p.add_argument("--layers", metavar="L", help="only these layers, e.g. 30 or 0-3,40 "
                   "(reads only their bytes, also of a remote checkpoint)")
    p.add_argument("--experts", metavar="E", help="only these routed experts, e.g. 0-7 "
                   "(shared experts and dense MLPs are left out)")
