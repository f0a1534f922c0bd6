"""The layer, trainer and analysis benchmarks of two revisions, side by side in one run.

A restructuring claims "same speed"; this job checks it. It unpacks the base revision into a
temporary tree (``git archive``, or ``--base-tree`` for a tree unpacked elsewhere, e.g. on a
machine without git), then runs each benchmark in both trees, alternating which goes first from
one round to the next (so drift of a loaded machine falls on both), each run a fresh process of
that tree's own job script. Per measure it prints the median of the rounds for both trees and the
ratio head / base (for times; base / head for rates), i.e. > 1 is slower in the head, beside
the range of the rounds' own ratios (the noise to read it against).

    python jobs/bench_revisions.py --base 5785c6a                  # CPU, 2 rounds
    python jobs/bench_revisions.py --base-tree /tmp/old --rounds 3 --benches layer,trainer
    OUT=results python jobs/bench_revisions.py --base 5785c6a --gpu   # GPU shapes; table -> $OUT

The measures: ``layer`` is jobs/bench_qat_moe.py (per recipe, ms of a forward + backward step of
the expert layer); ``trainer`` is the throughput half of jobs/bench_train.py (per recipe, tokens/s
of the trainer's own step); ``analysis`` is jobs/bench_analysis.py (per question x format, the
warm second call's speed as a multiple of the plain read of the same files).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cmd(bench: str, gpu: bool, scratch: Path) -> list[str]:
    if bench == "layer":
        return ["jobs/bench_qat_moe.py", "--iters", "20" if gpu else "5", *(["--k3"] if gpu else [])]
    if bench == "trainer":
        return ["jobs/bench_train.py", "--steps", "12", "--ep", "1",
                *(["--preset", "small", "--batch", "8", "--seq", "256"] if gpu else [])]
    return ["jobs/bench_analysis.py", "--dir", str(scratch / "analysis"),
            "--size-gb", "1" if gpu else "0.1", "--device", "cuda" if gpu else "cpu"]


def _layer(out: Path, stdout: str) -> dict[str, float]:
    rows = json.loads((out / "bench_qat_moe.json").read_text())["rows"]
    return {f"{r['recipe']} ms": r["ms"] for r in rows}


def _trainer(out: Path, stdout: str) -> dict[str, float]:
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["recipe", "tokens_per_s"])
    found = {}
    for ln in lines[head + 1:]:
        if not ln.strip():
            break
        cells = ln.split()
        found[f"{cells[0]} tokens/s"] = float(cells[1])
    return found


def _analysis(out: Path, stdout: str) -> dict[str, float]:
    text = stdout[stdout.index("second call vs the plain read"):]
    rows = [ln.strip("|").split("|") for ln in text.splitlines() if ln.startswith("|")]
    fmts = [c.strip() for c in rows[0][1:]]
    found = {}
    for cells in rows[2:]:
        for fmt, cell in zip(fmts, cells[1:]):
            m = re.match(r"\s*([0-9.]+)x", cell)
            if m:
                found[f"{cells[0].strip()} {fmt} x read"] = float(m.group(1))
    return found


PARSE = {"layer": _layer, "trainer": _trainer, "analysis": _analysis}
HIGHER_IS_BETTER = ("tokens/s", "x read")


def _run(tree: Path, bench: str, gpu: bool, scratch: Path) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "PYTHONPATH": str(tree), "OUT": str(out), "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, *_cmd(bench, gpu, scratch)], cwd=tree, env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or [""])[-1]
        raise SystemExit(f"error: {bench} in {tree} exited {p.returncode}: {last}")
    return PARSE[bench](out, p.stdout)


def _unpack(rev: str, into: Path) -> Path:
    tree = into / "base"
    tree.mkdir()
    archive = into / "base.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO, stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(tree, filter="data")
    return tree


def _table(samples: dict[tuple[str, str], dict[str, list[float]]], label: str, rounds: int) -> str:
    lines = [f"After {rounds} round(s).", "",
             f"| bench | measure | base ({label}) | head | head vs base, time | rounds |",
             "|---|---|---|---|---|---|"]
    for (bench, k), by in samples.items():
        if set(by) != {"base", "head"}:
            continue
        inv = k.endswith(HIGHER_IS_BETTER)
        n = min(len(by["base"]), len(by["head"]))
        b, h = statistics.median(by["base"][:n]), statistics.median(by["head"][:n])
        # each round's own ratio: their spread is the noise the median ratio is read against
        per = sorted((x / y if inv else y / x) for x, y in zip(by["base"], by["head"]))
        lines.append(f"| {bench} | {k} | {b:.4g} | {h:.4g} | {(b / h if inv else h / b):.3f}x "
                     f"| {per[0]:.2f}-{per[-1]:.2f}x |")
    return "\n".join(lines)


def _write(text: str) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "bench_revisions.md").write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--base", help="git revision of this repository to compare against")
    g.add_argument("--base-tree", type=Path, help="an unpacked tree of the base revision")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--benches", default="layer,trainer,analysis")
    ap.add_argument("--gpu", action="store_true", help="GPU shapes (the layer at K3 size)")
    a = ap.parse_args(argv)
    benches = [b for b in a.benches.split(",") if b]
    if bad := [b for b in benches if b not in PARSE]:
        ap.error(f"unknown bench {bad[0]!r}: choose from {', '.join(PARSE)}")
    with tempfile.TemporaryDirectory(prefix="wb-revisions-") as tmp:
        scratch = Path(tmp)
        base = a.base_tree.resolve() if a.base_tree else _unpack(a.base, scratch)
        sides = {"base": base, "head": REPO}
        samples: dict[tuple[str, str], dict[str, list[float]]] = {}
        for rnd in range(a.rounds):
            for bench in benches:
                order = ["base", "head"] if rnd % 2 == 0 else ["head", "base"]
                for side in order:
                    print(f"round {rnd + 1}/{a.rounds}: {bench} in {side}", file=sys.stderr)
                    for k, v in _run(sides[side], bench, a.gpu, scratch).items():
                        samples.setdefault((bench, k), {}).setdefault(side, []).append(v)
            # the table so far after every round: a run cut short by a time limit keeps its rounds
            _write(_table(samples, a.base or str(a.base_tree), rnd + 1))
    print(_table(samples, a.base or str(a.base_tree), a.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
