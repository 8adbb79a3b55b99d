"""``hsgen prepare-data``, ``launch-vllm`` and ``generate-offline-data`` read speculators' script
flags: a flag with a meaning here is translated, one without is refused in one line naming it
(the example scripts themselves run in tests/e2e/test_speculators_examples.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hsgen.cli import main
from hsgen.cli.speculators_scripts import _offline_parser, dataset_input, offline_tokens


def _run(*argv):
    return CliRunner().invoke(main, list(argv))


def _one_error_line(res) -> str:
    errors = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1, res.output
    return errors[0]


@pytest.mark.parametrize(
    ("flag", "says"),
    [(["--seed", "0"], "--seed: rows are taken in input order"),
     (["--render-endpoint", "http://localhost:8000"], "--render-endpoint: renders with --model's tokenizer"),
     (["--token-freq-path", "f.pt"], "--token-freq-path: no token-frequency file: spectrain train counts"),
     (["--data", "gsm8k"], "--data gsm8k: speculators reshapes this dataset's records"),
     (["--no-such-flag"], "unrecognized arguments: --no-such-flag")],
)  # fmt: skip
def test_prepare_data_refuses_in_one_line(flag, says, tmp_path, tiny_model_dir, sample_chats_path):
    res = _run("prepare-data", "--model", str(tiny_model_dir), "--data", str(sample_chats_path), "--output",
               str(tmp_path / "out"), *flag)  # fmt: skip
    assert res.exit_code == 2 and says in _one_error_line(res)
    assert not (tmp_path / "out").exists()


def test_speculators_dataset_names_are_their_hub_datasets():
    sharegpt, ultrachat = dataset_input("sharegpt", 5), dataset_input("ultrachat", None)
    assert (sharegpt.name, sharegpt.split, sharegpt.max_samples) == (
        "Aeala/ShareGPT_Vicuna_unfiltered",
        "train",
        5,
    )
    assert (ultrachat.name, ultrachat.split) == ("HuggingFaceH4/ultrachat_200k", "train_sft")


def test_prepare_data_rows_limits_and_rerun(tmp_path, tiny_model_dir, sample_chats_path):
    import datasets

    out = tmp_path / "out"
    base = ["prepare-data", "--model", str(tiny_model_dir), "--data", str(sample_chats_path), "--data",
            str(sample_chats_path), "--output", str(out), "--seq-length", "40"]  # fmt: skip
    res = _run(*base, "--max-samples", "7", "--num-preprocessing-workers", "4", "--trust-remote-code")
    assert res.exit_code == 0, res.output
    ds = datasets.load_from_disk(str(out))
    assert len(ds) == 7 and max(ds["seq_len"]) == 40  # the first 7 in all, each cut to --seq-length
    assert all(
        len(i) == len(m) == n for i, m, n in zip(ds["input_ids"], ds["loss_mask"], ds["seq_len"], strict=True)
    )

    again = _run(*base, "--max-samples", "3")
    assert again.exit_code == 0 and "holds a prepared dataset already, kept" in again.output
    assert len(datasets.load_from_disk(str(out))) == 7
    res = _run(*base, "--max-samples", "3", "--overwrite", "--minimum-valid-tokens", "10")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    ds = datasets.load_from_disk(str(out))
    assert len(ds) == summary["samples"] == 3 and all(sum(m) >= 10 for m in ds["loss_mask"])

    none = _run(*base, "--output", str(tmp_path / "empty"), "--minimum-valid-tokens", "1000")
    assert none.exit_code == 1 and "--allow-empty-output writes it anyway" in none.output
    res = _run(
        *base, "--output", str(tmp_path / "empty"), "--minimum-valid-tokens", "1000", "--allow-empty-output"
    )
    assert res.exit_code == 0 and json.loads(res.stdout.strip().splitlines()[-1])["samples"] == 0
    assert (tmp_path / "empty" / "dataset_info.json").is_file()


def test_generate_offline_data_flags_become_hsgen_generates(tmp_path):
    def tokens(*argv):
        return offline_tokens(_offline_parser().parse_args(["--layer-ids", "1,2,4", *argv]))

    data = str(tmp_path / "data")
    t = tokens("--preprocessed-data", data, "--endpoint", "http://h:1/v1", "--concurrency", "8",
               "--validate-outputs", "--request-timeout", "30", "--max-retries", "2", "--fail-on-error",
               "--world-size", "2", "--rank", "1", "--max-samples", "9")  # fmt: skip
    assert (
        t[0] == data and t[t.index("--store") + 1] == f"{data}/hidden_states"
    )  # speculators' default output
    pairs = dict(zip(t[1::2], t[2::2], strict=True))
    assert pairs == {"--endpoint": "http://h:1/v1", "--store": f"{data}/hidden_states", "--concurrency": "8",
                     "--max-samples": "9", "--timeout": "30.0", "--retries": "2", "--world-size": "2",
                     "--rank": "1", "--layer-ids": "1,2,4", "--max-consecutive-failures": "1"}  # fmt: skip
    t = tokens("--output", str(tmp_path / "hs"), "--max-consecutive-errors", "7")
    assert (
        t[t.index("--store") + 1] == str(tmp_path / "hs")
        and t[t.index("--max-consecutive-failures") + 1] == "7"
    )
    assert (
        t[t.index("--concurrency") + 1] == "32" and t[t.index("--endpoint") + 1] == "http://localhost:8000/v1"
    )


def test_generate_offline_data_without_a_server_says_so(tmp_path, tiny_model_dir):
    res = _run(
        "generate-offline-data", "--preprocessed-data", str(tmp_path), "--endpoint", "http://127.0.0.1:9/v1"
    )
    assert res.exit_code == 2 and "no model listed at /v1/models; pass --model or --layer-ids" in res.output
    res = _run("generate-offline-data", "--preprocessed-data", str(tmp_path), "--bogus")
    assert res.exit_code == 2 and "unrecognized arguments: --bogus" in _one_error_line(res)
