"""One flag vocabulary: the seed workflow's command line, speculators spellings as aliases,
--log-level and --progress on every command, defaults shown, train options in sections."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from _hub_util import lay_out_hub_cache, sharded_model_files
from hsgen.cli import main as hsgen_main
from spectrain.cli import main as spectrain_main
from spectrain.cli.train import DEFAULT_SAVE_PATH, build_train_config, train

SEED = ('--verifier-name-or-path Qwen/Qwen3-8B --vllm-endpoint http://localhost:8000/v1 --speculator-type dflash '
        '--draft-vocab-size 8192 --block-size 8 --max-anchors 3072 --num-layers 5 --target-layer-ids "2 18 33" '
        '--epochs 5 --lr 1e-4')  # fmt: skip


def _params(argv: list[str]) -> dict:
    ctx = train.make_context("train", argv)
    return ctx.params


def test_the_seed_command_line_parses_verbatim(hub_cache, tiny_model_dir, tmp_path):
    import shlex

    snap = lay_out_hub_cache(hub_cache, "Qwen/Qwen3-8B", {k: v for k, v in sharded_model_files(tiny_model_dir).items()
                                                          if k != "model-00001-of-00002.safetensors"})  # fmt: skip
    cfg = build_train_config(_params([*shlex.split(SEED), "--data-path", "chats.jsonl"]))
    assert cfg.verifier == str(snap) and cfg.verifier_name == "Qwen/Qwen3-8B"
    assert (
        cfg.online is True and cfg.endpoints == ["http://localhost:8000/v1"] and cfg.prompts == "chats.jsonl"
    )
    assert (cfg.speculator_type, cfg.epochs, cfg.lr, cfg.save_path) == ("dflash", 5, 1e-4, DEFAULT_SAVE_PATH)
    assert cfg.draft == {"draft_vocab_size": 8192, "block_size": 8, "max_anchors": 3072, "num_layers": 5,
                         "aux_layer_ids": [2, 18, 33]}  # fmt: skip


def test_online_rendering_and_layer_flags_reach_the_online_config(tmp_path, tiny_model_dir):
    from hsgen.inputs.hf_datasets import DatasetSpec
    from spectrain.online.config import OnlineConfig

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_dict.json").write_text("{}")
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages }}")
    argv = ["--verifier", str(tiny_model_dir), "--endpoint", "http://h:8000", "--prompts", str(tmp_path / "ds"),
            "--split", "test", "--max-samples", "7", "--layer-ids", "1 2 4", "--chat-template", str(tpl),
            "--template-kwargs", '{"enable_thinking": false}', "--save-path", str(tmp_path / "r")]  # fmt: skip
    cfg = build_train_config(_params(argv))
    oc = OnlineConfig.from_train_config(cfg)
    assert oc.layer_ids == [1, 2, 4] and oc.chat_template == str(tpl)
    assert oc.template_kwargs == {"enable_thinking": False}
    assert oc.prompt_inputs() == [DatasetSpec(str(tmp_path / "ds"), split="test", max_samples=7)]
    with pytest.raises(Exception, match="must be a JSON object"):
        build_train_config(_params([*argv, "--template-kwargs", "[1]"]))


def _commands(group) -> list[tuple[str, object]]:
    ctx = group.make_context(group.name, ["--help"], resilient_parsing=True)
    return [(name, group.get_command(ctx, name)) for name in group.list_commands(ctx)]


@pytest.mark.parametrize("group", [hsgen_main, spectrain_main], ids=["hsgen", "spectrain"])
def test_every_command_has_log_level_progress_and_shows_defaults(group):
    for name, _ in _commands(group):
        res = CliRunner().invoke(group, [name, "--help"], terminal_width=200)
        assert res.exit_code == 0, (name, res.output)
        assert "--log-level" in res.output, name
        assert "--progress / --no-progress" in res.output, name
    res = CliRunner().invoke(hsgen_main, ["generate", "--help"], terminal_width=200)
    assert "[default: 600.0; x>=0.1]" in res.output  # --timeout


def test_train_help_lists_sections_and_algorithms():
    res = CliRunner().invoke(spectrain_main, ["train", "--help"], terminal_width=200)
    out = res.output
    for title in ("Run:", "Optimization:", "Draft (algorithm options):", "Online data (vLLM):", "Logging:"):
        assert title in out
    assert out.index("Run:") < out.index("--verifier, --verifier-name-or-path") < out.index("Optimization:")
    assert "--speculator-type [dflash|eagle3]" in out
    assert "--prompts, --data-path" in out and "--endpoint, --vllm-endpoint" in out
    assert "Other options:" not in out  # every option is in a section


def test_serve_layer_ids_and_shared_dir_spellings(tmp_path):
    from hsgen.cli.serve import serve

    for argv in (["--layer-ids", "1,4", "--shared-dir", str(tmp_path)],
                 ["--layers", "1,4", "--shared-storage-path", str(tmp_path)]):  # fmt: skip
        params = serve.make_context("serve", ["--model", "tiny", *argv]).params
        assert params["layers"] == "1,4" and params["shared_storage_path"] == str(tmp_path)


def test_eval_takes_the_vocabulary(tmp_path):
    from spectrain.cli.eval import eval_command

    params = eval_command.make_context("eval", [
        "--draft", "d", "--verifier", "v", "--prompts", "p", "--layer-ids", "1,2,3,4", "--split", "test",
        "--max-samples", "5", "--chat-template", __file__, "--template-kwargs", '{"enable_thinking": false}',
    ]).params  # fmt: skip
    assert params["layer_ids"] == "1,2,3,4" and params["split"] == "test" and params["num_prompts"] == 5
    assert json.loads(params["template_kwargs"]) == {"enable_thinking": False}
