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

from hsgen import protocol
from hsgen.cli import main


def _cmd(*args):
    return CliRunner().invoke(main, ["vllm-command", *map(str, args)])


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_the_line_carries_both_configs_and_passes_extras(tiny_model_dir, tmp_path):
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


def test_layer_ids_old_vllm_and_errors_name_the_flag(tiny_model_dir):
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
