"""The logger never stops training: wandb missing, wandb.init failing, calls failing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from track_runs import wandb_env

from workbench.track import Logger, NullLogger, WandbConfig, make_logger


def _run(code: str, tmp_path) -> dict:
    env = wandb_env(tmp_path)
    env["HOME"] = str(tmp_path)  # no ~/.netrc with a real API key
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_missing_wandb_gives_null_logger(tmp_path):
    out = _run("""
        import sys, json, warnings
        sys.modules["wandb"] = None  # import wandb now raises ImportError
        from workbench.track import make_logger, TrackingWarning
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            lg = make_logger("offline", rank=0, dir=".")
            lg.log({"loss": 1.0}, step=0); lg.summary({"a": 1}); lg.alert("t", "x")
            lg.log_config({"b": 2}); lg.finish()
        msgs = [str(x.message) for x in w if issubclass(x.category, TrackingWarning)]
        print(json.dumps({"type": type(lg).__name__, "warnings": msgs}))
    """, tmp_path)
    assert out["type"] == "NullLogger"
    assert len(out["warnings"]) == 1 and "workbench[track]" in out["warnings"][0]


def test_failed_init_and_failed_calls_do_not_raise(tmp_path):
    out = _run("""
        import json, sys, warnings
        import pandas as pd
        from workbench.track import make_logger, TrackingWarning
        res = {}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            # online without an API key: wandb.init raises; training must go on
            res["online"] = type(make_logger("online", 0, dir=".", init_timeout_s=20)).__name__
            lg = make_logger("offline", rank=0, dir=".", name="guarded")
            res["offline"] = type(lg).__name__
            lg.log({"loss": 1.0}, step=0)
            lg.log_table("t", "not a DataFrame", step=1)
            lg.log_table("t", "not a DataFrame", step=2)
            lg.finish()
            lg.log({"loss": 2.0}, step=3)  # after finish: wandb raises UsageError
            res["errors"] = lg.errors
        res["warnings"] = [str(x.message) for x in w if issubclass(x.category, TrackingWarning)]
        print(json.dumps(res))
    """, tmp_path)
    assert out["online"] == "NullLogger"
    assert out["offline"] == "WandbLogger"
    assert out["errors"] == {"log_table": 2, "log": 1}
    ws = out["warnings"]
    assert sum("wandb.init failed" in m for m in ws) == 1
    assert sum("log_table failed" in m for m in ws) == 1  # once, not per call
    assert sum("wandb log failed" in m for m in ws) == 1


def test_other_ranks_and_disabled_never_import_wandb(tmp_path):
    out = _run("""
        import json, sys
        from workbench.track import make_logger
        a = make_logger("offline", rank=3, dir=".")
        b = make_logger("disabled", rank=0, dir=".")
        print(json.dumps({"a": type(a).__name__, "b": type(b).__name__,
                          "wandb": "wandb" in sys.modules,
                          "mpl": "matplotlib" in sys.modules}))
    """, tmp_path)
    assert out == {"a": "NullLogger", "b": "NullLogger", "wandb": False, "mpl": False}


def test_config_validation():
    with pytest.raises(ValueError, match="mode"):
        WandbConfig(mode="cloud")
    with pytest.raises(ValueError, match="init_timeout_s"):
        WandbConfig(init_timeout_s=0)
    with pytest.raises(TypeError, match="tuple"):
        WandbConfig(tags=["a"])
    with pytest.raises(ValueError, match="mode"):
        make_logger("cloud", rank=1)
    assert isinstance(NullLogger(), Logger)
