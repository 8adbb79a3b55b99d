"""Dataset inputs through the ``datasets`` library: a save_to_disk directory, a DatasetDict split,
a hub dataset id from a cache laid out as huggingface_hub lays it out (offline), and the CLI flags."""

from __future__ import annotations

import json

import datasets
import pytest
from click.testing import CliRunner

from _hub_util import lay_out_hub_cache
from hsgen.cli import main
from hsgen.inputs.formats import InputError, parse_record, read_inputs
from hsgen.inputs.hf_datasets import DatasetSpec, as_input


@pytest.fixture(scope="module")
def rows(sample_chats_path):
    return [json.loads(line) for line in sample_chats_path.read_text().splitlines()[:6]]


def _expected(rows):
    return [parse_record(r, "x") for r in rows]


def _same(got, rows):
    assert [(s.sample_id, s.kind, s.messages) for s in got] == [
        (s.sample_id, s.kind, s.messages) for s in _expected(rows)
    ]


def test_save_to_disk_directory(tmp_path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    got = list(read_inputs([str(tmp_path / "ds")]))
    _same(got, rows)
    assert got[2].source == f"{tmp_path / 'ds'}[train]:row 2"
    assert len(list(read_inputs([DatasetSpec(str(tmp_path / "ds"), max_samples=2)]))) == 2


def test_dataset_dict_split_and_missing_split(tmp_path, rows):
    dd = datasets.DatasetDict(
        {"train_sft": datasets.Dataset.from_list(rows[:4]), "test_sft": datasets.Dataset.from_list(rows[4:])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    _same(list(read_inputs([DatasetSpec(str(tmp_path / "dd"), split="test_sft")])), rows[4:])
    with pytest.raises(
        InputError, match=r"dd\[train\]: .*no split 'train' \(splits: \['test_sft', 'train_sft'\]\)"
    ):
        list(read_inputs([str(tmp_path / "dd")]))


def test_hub_dataset_id_from_an_offline_cache(hub_cache, tmp_path, rows, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds-cache"))
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    snap = lay_out_hub_cache(hub_cache, "org/chats", {"data/train.jsonl": data, "data/test.jsonl": data[:0]})
    (hub_cache / "models--org--chats").rename(hub_cache / "datasets--org--chats")  # a dataset repository
    assert snap.name == "0" * 40
    got = list(read_inputs([DatasetSpec("org/chats", max_samples=4)]))
    _same(got, rows[:4])
    assert got[0].source == "org/chats[train]:row 0"
    with pytest.raises(InputError, match="org/absent.*not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        list(read_inputs(["org/absent"]))


def test_files_stay_files(tmp_path, sample_chats_path):
    assert as_input(str(sample_chats_path), split="test") == str(sample_chats_path)
    assert as_input("-") == "-"
    with pytest.raises(InputError, match="no such file"):
        list(read_inputs([str(tmp_path / "missing.jsonl")]))


def test_render_cli_reads_a_dataset_with_split_and_max_samples(
    tmp_path, rows, tiny_model_dir, sample_chats_path
):
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    res = CliRunner().invoke(main, ["render", str(tmp_path / "dd"), "--split", "test", "--max-samples", "3",
                                    "--tokenizer", str(tiny_model_dir)])  # fmt: skip
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    head = tmp_path / "head.jsonl"
    head.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    ref = CliRunner().invoke(main, ["render", str(head), "--tokenizer", str(tiny_model_dir)])
    assert got == [json.loads(line) for line in ref.stdout.splitlines()] and len(got) == 3
