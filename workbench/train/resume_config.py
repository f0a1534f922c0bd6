"""What a `--resume` may change about a run, checked before anything in the run folder is touched.

Each checkpoint's COMPLETE marker records the run's configuration (`TrainConfig.to_dict()` as
JSON). A resume compares the configuration it was given with the one of every complete
checkpoint it could pick, field by field, as JSON values (so a field whose Python type changes,
e.g. a typed recipe object that serialises to its name, compares the same way):

- bookkeeping fields (`FREE`) never matter: where the run lives, how often it validates or
  checkpoints, what it exports, where it logs. They change the record, not the training;
- fields that change the training but leave the checkpoint meaningful (`CHANGEABLE`: the run's
  length, the LR schedule, clipping, the validation sample) may change only when named in
  `--allow-config-change` (e.g. `--allow-config-change steps,lr` to extend a run at a new LR);
- everything else (preset, recipe, profile, batch, seq, seed, the optimizer's constants) is fixed:
  another value means another run, and training it from this run's state would mix the two
  (half of a "mxfp4" run trained in bf16, a data stream that restarts at another batch size).
Checkpoints whose marker predates the recorded configuration are compared on what they hold
(recipe, preset, seed) plus the run folder's `config.json`.

`FREE` and `CHANGEABLE` live in `workbench.train.config`: `TrainConfig` checks
`allow_config_change` against them at construction and must import without torch, which this
module loads (it reads checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.train.checkpointing import candidates
from workbench.train.config import CHANGEABLE, FREE

_LEGACY_KEYS = ("recipe", "preset", "seed")  # what markers held before the full configuration
_CONFIG_JSON_EXTRA = ("world_size", "ep_size", "device")  # config.json's non-TrainConfig keys


class ResumeConfigError(ValueError):
    """--resume was given a configuration the run's checkpoints were not trained with."""


def as_json(cfg: Any) -> dict[str, Any]:
    """`cfg.to_dict()` as the JSON values a marker records (tuples -> lists, objects -> str)."""
    return json.loads(json.dumps(cfg.to_dict(), default=str))


def checkpoint_meta(cfg: Any) -> dict[str, Any]:
    """What `checkpointing.save` records about the run in each COMPLETE marker."""
    conf = as_json(cfg)
    return {**{k: conf.get(k) for k in _LEGACY_KEYS}, "config": conf}


def recorded_config(meta: dict, out: Path) -> dict[str, Any]:
    """The configuration a checkpoint was trained with, as far as it is known."""
    conf = meta.get("config")
    if isinstance(conf, dict):
        return conf
    rec: dict[str, Any] = {}
    try:
        old = json.loads((out / "config.json").read_bytes())
        if isinstance(old, dict):
            rec.update({k: v for k, v in old.items() if k not in _CONFIG_JSON_EXTRA})
    except (OSError, ValueError):
        pass  # no (readable) record of the earlier attempt: the marker's keys are all there is
    rec.update({k: meta[k] for k in _LEGACY_KEYS if k in meta})
    return rec


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple]:
    """{field: (recorded, current)} for the compared fields whose values differ."""
    return {k: (recorded[k], current[k]) for k in sorted(recorded.keys() & current.keys())
            if k not in FREE and recorded[k] != current[k]}


def check_resume_config(cfg: Any) -> None:
    """Refuse a --resume whose configuration differs from a checkpoint's in a field that is
    fixed, or CHANGEABLE but not named in `cfg.allow_config_change`. Reads only; call it before
    anything in the run folder is written."""
    out = Path(cfg.out)
    current = as_json(cfg)
    allowed = set(getattr(cfg, "allow_config_change", ()) or ())
    for c in candidates(out):
        if isinstance(c, Exception):
            continue  # a damaged marker: resume skips that checkpoint anyway
        diff = {k: v for k, v in differences(recorded_config(c.meta, out), current).items()
                if k not in allowed}
        if diff:
            what = "; ".join(f"{k}: checkpoint {c.path.name} has {a!r}, this run asks for {b!r}"
                             for k, (a, b) in diff.items())
            fixed = [k for k in diff if k not in CHANGEABLE]
            how = (f"{', '.join(fixed)} cannot change on --resume (start a new --out)" if fixed
                   else f"pass --allow-config-change {','.join(diff)} to change it deliberately")
            raise ResumeConfigError(f"{out}: --resume with another configuration ({what}); {how}")
