"""Ranks from flags and launcher variables; node-local endpoints."""

import pytest

from hsgen.generate.launcher import Ranks, endpoints_for_rank, expand_endpoint, resolve_ranks


def test_default_is_one_rank():
    assert resolve_ranks(env={}) == Ranks(1, 0, 0, 0, "default")


def test_slurm_variables():
    r = resolve_ranks(
        env={"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"}
    )
    assert (r.world_size, r.rank, r.local_rank, r.node_rank, r.source) == (4, 3, 1, 1, "SLURM")
    assert r.describe() == "rank 3 of 4 (local rank 1, from SLURM)"


def test_torchrun_beats_slurm_and_hsgen_beats_both():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    r = resolve_ranks(env=env)
    assert (r.world_size, r.rank, r.local_rank, r.source) == (8, 5, 1, "torchrun")
    r = resolve_ranks(env={**env, "HSGEN_RANK": "1", "HSGEN_WORLD_SIZE": "3"})
    assert (r.world_size, r.rank, r.source) == (3, 1, "HSGEN_*")
    assert r.local_rank == 1  # the launcher's local rank still picks the endpoint


def test_explicit_flags_win():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    r = resolve_ranks(world_size=1, rank=0, env=env)
    assert (r.world_size, r.rank, r.source) == (1, 0, "flags")
    r = resolve_ranks(world_size=4, env=env)  # the rank still comes from SLURM
    assert (r.world_size, r.rank, r.source) == (4, 1, "flags + SLURM")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, "rank 2 is not in 0..1 (world size 2; from SLURM)"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"WORLD_SIZE": "0"}, "world size 0 (from torchrun)"),
    ],
)
def test_bad_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        resolve_ranks(env=env)


def test_endpoint_templates():
    r = Ranks(8, 5, 1, 2, "torchrun")
    assert expand_endpoint("http://localhost:{8000+local_rank}", r) == "http://localhost:8001"
    assert expand_endpoint("http://node{node_rank}:{8000 + 2*local_rank}/x", r) == "http://node2:8002/x"
    assert expand_endpoint("http://localhost:8000", r) == "http://localhost:8000"
    for bad in ("{__import__('os')}", "{local_rank/2}", "{8000+}"):
        with pytest.raises(ValueError, match="endpoint template"):
            expand_endpoint("http://h:" + bad, r)


def test_local_rank_picks_one_of_a_list():
    urls = ["http://a:1", "http://b:2"]
    assert endpoints_for_rank(urls, Ranks(4, 3, 3, 1, "SLURM"), per_local_rank=True) == ["http://b:2"]
    assert endpoints_for_rank(urls, Ranks(4, 3, 0, 1, "SLURM"), per_local_rank=True) == ["http://a:1"]
    assert endpoints_for_rank(urls, Ranks(4, 3, 0, 1, "SLURM")) == urls


def test_generate_takes_its_share_from_slurm_variables(tmp_path, monkeypatch, caplog):
    """``SLURM_PROCID=1 SLURM_NTASKS=2 hsgen generate ...`` stores only rank 1's prompts."""
    import json
    import logging

    from click.testing import CliRunner
    from fake_vllm import FakeConfig, FakeVLLM

    from hsgen.cli.generate import generate as gen_cmd
    from hsgen.generate.pipeline import rank_of
    from hsgen.store import HiddenStateStore

    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"p{i}", "input_ids": [i + 1, i + 2]}) + "\n" for i in range(40))
    )
    shared = tmp_path / "shm"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HSGEN_RANK", "HSGEN_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    caplog.set_level(logging.INFO, logger="hsgen.generate.pipeline")
    with FakeVLLM(FakeConfig(str(shared))).in_thread() as url:
        args = [str(data), "--store", str(tmp_path / "st"), "--endpoint", url, "--shared-dir", str(shared)]
        args += ["--layer-ids", "1,2,4", "--no-progress"]
        r = CliRunner().invoke(gen_cmd, args)
        assert r.exit_code == 0, r.output
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert "rank 1 of 2 (local rank 0, from SLURM)" in caplog.text
        r0 = CliRunner().invoke(gen_cmd, [*args, "--rank", "0"])  # an explicit flag wins
        assert r0.exit_code == 0, r0.output
    mine = [f"p{i}" for i in range(40) if rank_of(f"p{i}", 2) == 1]
    assert summary["stored"] == len(mine) and summary["other_rank"] == 40 - len(mine)
    store = HiddenStateStore.open(tmp_path / "st")
    assert len(store) == 40, "rank 0 (from --rank) stored the rest"
    assert json.loads(r0.stdout.strip().splitlines()[-1])["stored"] == 40 - len(mine)
