"""Small frictions: ``--help`` never imports torch; ``hsgen render`` takes ``--endpoint`` like
every other command; errors about layer ids name the flag (online) or the store."""

from __future__ import annotations

import subprocess
import sys


def test_eval_help_does_not_import_torch():
    code = ("import sys; from click.testing import CliRunner; from spectrain.cli import main; "
            "r = CliRunner().invoke(main, ['eval', '--help']); assert r.exit_code == 0, r.output; "
            "print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_eval_dtypes_are_evals():
    from spectrain.cli.eval import DTYPES
    from spectrain.eval import decode as ev

    assert sorted(DTYPES) == sorted(ev.DTYPES)


def test_render_takes_endpoint():
    from hsgen.cli.render import render

    params = render.make_context("render", ["x.jsonl", "--endpoint", "http://h:8000"]).params
    assert params["server"] == "http://h:8000"


def test_online_layer_errors_name_the_flag(tiny_model_dir):
    import pytest

    from spectrain.models import get_config_class
    from spectrain.train.setup import resolve_layers

    cfg = get_config_class("dflash").from_dict({"aux_layer_ids": [1, 3]})
    with pytest.raises(
        ValueError, match=r"--target-layer-ids \[3\] are not in the servers' layers \(--layer-ids\)"
    ):
        resolve_layers(cfg, [1, 2, 4], 4, origin="the servers' layers (--layer-ids)")
