"""Hub model ids as ``--verifier`` for train and eval, resolved offline from a cache laid out as
huggingface_hub lays it out; ``spectrain eval --draft SAVE_PATH`` follows ``latest``."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from _hub_util import lay_out_hub_cache, sharded_model_files
from spectrain.cli import main
from spectrain.cli.train import build_train_config
from spectrain.models.verifier import VerifierHeads

REPO = "hsgen-test/tiny-qwen3"
LAYERS_SHARD = "model-00001-of-00002.safetensors"


def test_train_verifier_hub_id_reads_only_the_head_shard(hub_cache, tiny_model_dir, tmp_path):
    files = sharded_model_files(tiny_model_dir)
    snap = lay_out_hub_cache(hub_cache, REPO, {k: v for k, v in files.items() if k != LAYERS_SHARD})
    cfg = build_train_config(
        {"verifier": REPO, "store": str(tmp_path / "s"), "save_path": str(tmp_path / "r")}
    )
    assert cfg.verifier == str(snap)
    assert (
        cfg.verifier_name == REPO
    )  # what the export's speculators_config names, so vllm serve <draft> works
    heads, ref = VerifierHeads.load(cfg.verifier), VerifierHeads.load(tiny_model_dir)
    assert torch.equal(heads.embed_tokens, ref.embed_tokens) and torch.equal(heads.lm_head, ref.lm_head)
    assert torch.equal(heads.norm_weight, ref.norm_weight)
    named = build_train_config({"verifier": REPO, "verifier_name": "x/y", "store": "s", "save_path": "r"})
    assert named.verifier_name == "x/y"


def test_train_verifier_uncached_id_is_a_usage_error(hub_cache, tmp_path):
    res = CliRunner().invoke(main, ["train", "--verifier", "org/absent", "--store", str(tmp_path), "--save-path",
                                    str(tmp_path / "r")])  # fmt: skip
    assert res.exit_code == 2
    assert "org/absent: config.json is not in the Hugging Face cache" in res.output


@pytest.fixture(scope="module")
def save_path(tiny_model_dir, tmp_path_factory):
    """A training --save-path with two checkpoints; ``latest`` names the second."""
    from spectrain.export.write import export_draft
    from spectrain.models import build_draft, get_config_class

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hubeval") / "run"
    heads = VerifierHeads.load(tiny_model_dir)
    for name, block in (("checkpoint-00000001", 3), ("checkpoint-00000002", 4)):
        model = build_draft(
            get_config_class("dflash")(aux_layer_ids=(1, 2, 3), num_layers=1, block_size=block), heads
        )
        export_draft(model, root / name, verifier_name=REPO)
    (root / "latest").write_text("checkpoint-00000002\n")
    return root


def test_eval_with_hub_verifier_and_save_path_draft(hub_cache, tiny_model_dir, save_path, tmp_path):
    lay_out_hub_cache(hub_cache, REPO, sharded_model_files(tiny_model_dir))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "input_ids": [5, 6, 7, 8, 9]}) + "\n")
    args = ["eval", "--draft", str(save_path), "--verifier", REPO, "--prompts", str(prompts), "--max-new-tokens",
            "6", "--json", "--no-progress"]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["draft"].endswith("checkpoint-00000002")
    assert out["num_speculative_tokens"] == 3  # block 4: the latest, not checkpoint-1's block 3
    assert out["verifier"] == REPO and out["verifier_dtype"] == "float64"  # auto on CPU


def test_eval_renders_with_the_template_and_kwargs_generate_uses(tiny_model_dir, tmp_path, sample_chats_path):
    """``spectrain eval --chat-template/--template-kwargs`` give the token ids ``hsgen render`` gives."""
    from transformers import AutoTokenizer

    from hsgen.inputs.render import ChatRenderer, RenderConfig
    from spectrain.eval.decode import load_prompts

    tpl = tmp_path / "t.jinja"
    tpl.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}{% if tag %} [{{ tag }}]{% endif %}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    row = json.loads(sample_chats_path.read_text().splitlines()[0])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(row) + "\n")
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    got = load_prompts(str(prompts), tok, chat_template=str(tpl), template_kwargs={"tag": "x"})[0].token_ids
    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir), chat_template=str(tpl),
                                         template_kwargs={"tag": "x"}))  # fmt: skip
    text = renderer.apply_template(
        row["messages"][: _upto_last_user(row["messages"])], add_generation_prompt=True
    )
    assert list(got) == renderer.encode(text)[0]
    assert "[x]" in tok.decode(list(got))
    plain = load_prompts(str(prompts), tok)[0].token_ids
    assert list(plain) != list(got)


def _upto_last_user(messages) -> int:
    """Messages eval keeps: all but the trailing assistant turns."""
    n = len(messages)
    while n and messages[n - 1]["role"] == "assistant":
        n -= 1
    return n
