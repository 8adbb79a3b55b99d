"""Issue 23: an algorithm of one's own loads from the command line (``spectrain --plugin``,
``SPECTRAIN_PLUGINS``) or from an installed package's ``spectrain.algorithms`` entry point."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

PLUGIN = '''
from dataclasses import dataclass

from spectrain.models.dflash import DFlashConfig
from spectrain.models.registry import register


@register("{name}")
@dataclass
class Config(DFlashConfig):
    """DFlash under another name: enough to show the registry found the plugin."""
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _dry_run(tiny_store, tiny_model_dir, tmp_path, algorithm, *before):
    from spectrain.cli import main

    argv = [*before, "train", "--store", str(tiny_store), "--verifier", str(tiny_model_dir), "--save-path",
            str(tmp_path / "r"), "--speculator-type", algorithm, "--block-size", "4", "--num-layers", "1",
            "--max-anchors", "16", "--total-seq-len", "256", "--max-steps", "5", "--dry-run"]  # fmt: skip
    return CliRunner().invoke(main, argv)


def test_plugin_flag_and_environment_register_an_algorithm(
    plugin_dir, tiny_store, tiny_model_dir, monkeypatch
):
    (plugin_dir / "my_flag_plugin.py").write_text(PLUGIN.format(name="myflagdraft"))
    res = _dry_run(tiny_store, tiny_model_dir, plugin_dir, "myflagdraft")
    assert res.exit_code != 0 and "--plugin MODULE" in res.output, res.output
    res = _dry_run(tiny_store, tiny_model_dir, plugin_dir, "myflagdraft", "--plugin", "my_flag_plugin")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["step"]["flops"] > 0
    (plugin_dir / "my_env_plugin.py").write_text(PLUGIN.format(name="myenvdraft"))
    monkeypatch.setenv("SPECTRAIN_PLUGINS", "my_env_plugin")
    assert _dry_run(tiny_store, tiny_model_dir, plugin_dir, "myenvdraft").exit_code == 0
    monkeypatch.setenv("SPECTRAIN_PLUGINS", "no_such_plugin_module")
    res = _dry_run(tiny_store, tiny_model_dir, plugin_dir, "myenvdraft")
    assert res.exit_code == 2 and "--plugin no_such_plugin_module: no module named" in res.output


def test_an_installed_entry_point_is_found_by_name(plugin_dir):
    """A real distribution's metadata on sys.path (what `pip install` of a plugin package leaves)."""
    from spectrain.models.registry import get_config_class

    (plugin_dir / "my_ep_plugin.py").write_text(PLUGIN.format(name="myepdraft"))
    info = plugin_dir / "my_ep_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-ep-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[spectrain.algorithms]\nmyepdraft = my_ep_plugin\n")
    assert "my_ep_plugin" not in sys.modules
    assert get_config_class("myepdraft").algorithm == "myepdraft"
