"""speculators' seven example scripts with our commands in place of theirs: each script's command
lines (tests/data/speculators_examples, verbatim) are run by bash with only sizes and paths
reassigned, and each call of ``scripts/X.py`` goes to ours with the same arguments: prepare_data.py
to ``hsgen prepare-data``, launch_vllm.py to ``hsgen launch-vllm``, data_generation_offline.py to
``hsgen generate-offline-data``, train.py to ``spectrain train --dry-run``. DFlash (both), Eagle3
online and offline and DSpark run; P-EAGLE and MTP are refused in one line naming the algorithm."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from click.testing import CliRunner

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "speculators_examples"
MARK = "# --- the example's command lines, verbatim ---"
SIZES = {"MAX_SAMPLES": "12", "SEQ_LENGTH": "256", "BLOCK_SIZE": "4", "MAX_ANCHORS": "16", "NUM_LAYERS": "1",
         "TARGET_LAYER_IDS": "1 2 3", "MARKOV_RANK": "8", "CONCURRENCY": "4"}  # fmt: skip
"""The sizes swapped for the tiny verifier (8 layers); every other configuration value is the example's."""
RECORD = r"""
record() {
    while [ $# -gt 0 ] && [[ "$1" != scripts/*.py ]]; do shift; done
    local name; name=$(basename "$1" .py); shift
    printf '%s\0' "$@" > "$DUMP/$name.args"
}
python() { record "$@"; }
torchrun() { record "$@"; }
"""
ONLINE = ["dflash_qwen3_8b_sharegpt_online_5k", "dflash_qwen3_8b_ultrachat_online_5k_bestpractices",
          "eagle3_qwen3_8b_sharegpt_online_5k", "dspark_qwen3_0_6b_sharegpt_online"]  # fmt: skip
OFFLINE = "eagle3_llama3_8b_ultrachat_offline_5k"


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny verifier's tokenizer and widths with 8 layers, randomly initialised: speculators'
    default layers ``2, n//2, n-3`` (the Eagle3 examples name none) are three distinct ones from 7 on."""
    import shutil

    import torch
    import transformers

    out = tmp_path_factory.mktemp("verifier")
    for f in tiny_model_dir.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    cfg.num_hidden_layers = 8
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[0]] * 8
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def script_args(name: str, tmp_path: Path, paths: dict[str, str]) -> dict[str, list[str]]:
    """The arguments each speculators script gets in example ``name`` (by script name), the
    configuration block followed by the reassigned sizes and paths."""
    config, commands = (EXAMPLES / f"{name}.sh").read_text().split(MARK)
    dump = tmp_path / f"argv-{name}"
    dump.mkdir(parents=True)
    assigned = "\n".join(f"{k}={shlex.quote(v)}" for k, v in {**SIZES, **paths}.items())
    script = "\n".join(["set -euo pipefail", config, assigned, RECORD, commands, "wait"])
    subprocess.run(["bash", "-c", script], check=True, env={**os.environ, "DUMP": str(dump)}, timeout=60)
    return {p.stem: p.read_text().split("\0")[:-1] for p in dump.glob("*.args")}


def _paths(tmp_path, model, data, port="8000") -> dict[str, str]:
    out = tmp_path / "output"
    return {"MODEL": str(model), "DATASET": str(data), "OUTPUT_DIR": str(out), "VLLM_PORT": port,
            "HIDDEN_STATES_DIR": str(out / "hidden_states"), "DATASET_DIR": str(data.parent)}  # fmt: skip


def _hsgen(*argv):
    from hsgen.cli import main

    return CliRunner().invoke(main, list(argv))


def _train(*argv):
    from spectrain.cli import main

    return CliRunner().invoke(main, ["train", *argv])


def _last_json(res) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


def _prepare(args: list[str], out: Path, samples: int) -> None:
    res = _hsgen("prepare-data", *args)
    assert res.exit_code == 0, res.output
    assert _last_json(res)["samples"] == samples
    import datasets

    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"] and len(ds) == samples
    assert max(ds["seq_len"]) <= int(SIZES["SEQ_LENGTH"])


@pytest.mark.parametrize("name", ONLINE)
def test_an_online_example_runs_with_our_commands(name, tmp_path, verifier, sample_chats_path):
    args = script_args(name, tmp_path, _paths(tmp_path, verifier, sample_chats_path))
    assert set(args) == {"prepare_data", "launch_vllm", "train"}
    out = tmp_path / "output"
    _prepare(args["prepare_data"], out, int(SIZES["MAX_SAMPLES"]))

    res = _train(*args["train"], "--dry-run")
    assert res.exit_code == 0, res.output
    plan = _last_json(res)
    kind = name.split("_")[0]
    assert plan["speculator_type"] == kind and plan["data"]["source"] == "online"
    assert plan["data"]["prompts"] == str(out) and plan["save_path"] == str(out / "checkpoints")

    cfg = json.loads(_train(*args["train"], "--dump-config").stdout)
    assert (cfg["epochs"], cfg["online"], cfg["delete_consumed"]) == (5, True, True)
    assert cfg["draft"].get("aux_layer_ids") == (None if kind == "eagle3" else [1, 2, 3])
    assert cfg["total_seq_len"] == 256 and cfg["endpoints"] == ["http://localhost:8000/v1"]
    d = cfg["draft"]
    if kind in ("dflash", "dspark"):
        assert (cfg["lr"], d["block_size"], d["max_anchors"], d["num_layers"]) == (3e-4, 4, 16, 1)
    if "bestpractices" in name:
        assert (cfg["draft"]["loss_weighting"], cfg["draft"]["target_mode"]) == ("dpace", "hard")
    if kind == "dspark":
        assert d["target_mode"] == "soft"  # its --loss-fn terms, as speculators computes them
        assert (d["markov_rank"], d["markov_head_type"], d["loss_mix"]) == (
            8,
            "vanilla",
            {"ce": 0.1, "tv": 0.9},
        )
        assert (
            d["enable_confidence_head"]
            and d["confidence_head_with_markov"]
            and d["confidence_head_alpha"] == 1.0
        )
    if kind == "eagle3":
        assert cfg["lr"] == 1e-4 and cfg["draft"]["draft_vocab_size"] == 32000


def _fake_vllm(tmp_path: Path) -> tuple[dict, Path]:
    bin_dir, record = tmp_path / "bin", tmp_path / "vllm-argv.json"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"  # stands in for vllm: records what it was started with
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VENV"}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}, record


@pytest.mark.parametrize("name", [*ONLINE, OFFLINE, "peagle_qwen3_8b_sharegpt_online_5k"])
def test_launch_vllm_lines_start_vllm_extracting_the_same_layers(name, tmp_path, verifier, sample_chats_path):
    args = script_args(name, tmp_path, _paths(tmp_path, verifier, sample_chats_path))["launch_vllm"]
    env, record = _fake_vllm(tmp_path)
    ran = subprocess.run([sys.executable, "-m", "hsgen.cli", "launch-vllm", *args],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    argv = json.loads(record.read_text())
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    layers = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert layers == (
        [1, 2, 3, 8] if "--target-layer-ids" in args else [2, 4, 5, 8]
    )  # default 2, n//2, n-3; + n
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    shared = str(tmp_path / "output" / "hidden_states") if name.startswith("peagle") else "/tmp/hidden_states"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == shared
    after = args[args.index("--") + 1 :]
    assert argv[-len(after) :] == after and "--port" in after  # vLLM's own arguments, as they are


def test_launch_vllm_refuses_what_has_no_meaning_here(tiny_model_dir):
    res = _hsgen("launch-vllm", str(tiny_model_dir), "--hidden-states-backend", "mooncake", "--dry-run")
    assert (
        res.exit_code == 2
        and "--hidden-states-backend mooncake: hsgen reads vLLM's file connector" in res.output
    )
    res = _hsgen(
        "launch-vllm", str(tiny_model_dir), "--target-layer-ids", "1", "--no-include-last-layer", "--dry-run"
    )
    assert res.exit_code == 0 and '"eagle_aux_hidden_state_layer_ids":[1]}' in res.output


def test_the_offline_example_end_to_end(tmp_path, verifier, sample_chats_path):
    from hsgen.cli.speculators_scripts import launch_layer_ids
    from hsgen.serve.testing import running_server

    launch = script_args(OFFLINE, tmp_path, _paths(tmp_path, verifier, sample_chats_path))["launch_vllm"]
    layers = launch_layer_ids(launch[0], None, True)  # the line names no layers: speculators' default
    with running_server(verifier, layers, tmp_path / "served", dtype="float32") as url:
        port = str(urlparse(str(url)).port)
        args = script_args(OFFLINE, tmp_path / "again", _paths(tmp_path, verifier, sample_chats_path, port))
        assert set(args) == {"prepare_data", "launch_vllm", "data_generation_offline", "train"}
        out, n = tmp_path / "output", int(SIZES["MAX_SAMPLES"])
        _prepare(args["prepare_data"], out, n)
        res = _hsgen("generate-offline-data", *args["data_generation_offline"])
        assert res.exit_code == 0, res.output
        assert _last_json(res)["stored"] == n

    res = _train(*args["train"], "--dry-run")
    assert res.exit_code == 0, res.output
    plan = _last_json(res)
    assert plan["speculator_type"] == "eagle3" and plan["data"]["store"] == str(out / "hidden_states")
    cache = plan["data"]["speculators_cache"]
    assert (cache["rows"], cache["rows_without_file"]) == (n, 0) and plan["data"]["samples_per_epoch"] > 0

    from hsgen.store import HiddenStateStore

    store = HiddenStateStore.open(out / "hidden_states")
    assert len(store.sample_ids()) == n and list(store.header.layer_ids) == layers

    more = [
        *args["prepare_data"],
        "--overwrite",
    ]  # the dataset prepared anew with 4 rows more: they have no states
    more[more.index("--max-samples") + 1] = str(n + 4)
    (out / "hidden_states").rename(tmp_path / "aside")  # --overwrite, as speculators', clears only its files
    _prepare(more, out, n + 4)
    (tmp_path / "aside").rename(out / "hidden_states")
    res = _train(*args["train"], "--dry-run")
    assert (
        res.exit_code == 1
        and f"no hidden states in {out / 'hidden_states'} for 4 of its {n + 4} rows (rows {n}, "
        in res.output.strip().splitlines()[-1]
    )


@pytest.mark.parametrize(
    ("name", "line"),
    [("peagle_qwen3_8b_sharegpt_online_5k", "--num-depths: an option of speculators' peagle, an algorithm spectrain "
      "does not implement"),
     ("mtp_qwen3_5_9b_gsm8k_online", "--num-speculative-steps: an option of speculators' mtp, an algorithm "
      "spectrain does not implement")],
)  # fmt: skip
def test_peagle_and_mtp_are_refused_in_one_line(name, line, tmp_path, verifier, sample_chats_path):
    args = script_args(name, tmp_path, _paths(tmp_path, verifier, sample_chats_path))
    res = _train(*args["train"], "--dry-run")
    assert res.exit_code == 2
    errors = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and line in errors[0], res.output
