"""The checkpoint store (docs/layout.md, "Checkpoints"): one atomic round folder per save with the digest of its
arrays, the newest `keep-checkpoints` kept, a corrupt or partial one named and skipped for the previous good one,
the older layout still read, non-finite arrays refused; per-site state files; the run-folder refusal; resume
after a torn metrics line and after a corrupt newest checkpoint."""

import hashlib
import json
import logging
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import RecordDict
from helpers import TINY, records, run_dir_of
from safetensors.numpy import save_file

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import checkpoint as store
from medflower.contract.checkpoint import (
    Checkpointer,
    CheckpointError,
    PersonalState,
    resolve_checkpoint_dir,
    run_folder_of,
)
from medflower.inprocess import run_inprocess
from medflower.server_app import open_run_folder


def arrays_of(rnd: int) -> OrderedDict[str, np.ndarray]:
    """Small arrays that tell the round they were saved at; 'b' before 'a' to check the order survives."""
    return OrderedDict(
        [("b", np.full((2, 3), float(rnd), dtype=np.float32)), ("a", np.arange(4, dtype=np.int64) + rnd)]
    )


def meta_of(rnd: int) -> dict:
    return {"strategy": "fedavg", "completed_rounds": rnd, "array_order": ["b", "a"], "strategy_meta": {"r": rnd}}


def save_rounds(directory: Path, rounds, keep: int = 3) -> Checkpointer:
    ckpt = Checkpointer(directory, keep=keep)
    for rnd in rounds:
        ckpt.save(arrays_of(rnd), meta_of(rnd))
    return ckpt


def loaded_round(ckpt: Checkpointer) -> int:
    arrays, meta = ckpt.load()
    assert list(arrays) == ["b", "a"]
    assert float(arrays["b"][0, 0]) == meta["completed_rounds"] == meta["strategy_meta"]["r"]
    return meta["completed_rounds"]


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- the store
def test_a_save_is_one_round_folder_with_the_digest_of_its_arrays(tmp_path):
    ckpt = save_rounds(tmp_path / "checkpoint", [1])
    assert sorted(p.name for p in ckpt.dir.iterdir()) == ["round-000001"]
    folder = ckpt.dir / "round-000001"
    assert sorted(p.name for p in folder.iterdir()) == ["arrays.safetensors", "state.json"]
    state = json.loads((folder / "state.json").read_text())
    assert state["arrays_sha256"] == hashlib.sha256((folder / "arrays.safetensors").read_bytes()).hexdigest()
    arrays, meta = ckpt.load()
    assert meta == meta_of(1) and ckpt.loaded == folder  # the digest is checked, not returned
    np.testing.assert_array_equal(arrays["a"], arrays_of(1)["a"])


def test_files_and_folders_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    save_rounds(tmp_path / "checkpoint", [1])
    folder = tmp_path / "checkpoint" / "round-000001"
    tmp = tmp_path / "checkpoint" / f".tmp-round-000001-{os.getpid()}"
    assert {str(tmp / "arrays.safetensors"), str(tmp / "state.json"), str(tmp), str(folder.parent)} <= set(synced)
    synced.clear()
    runtime = FakeRuntime(tmp_path / "site")
    PersonalState(runtime).save(1, arrays_of(1))
    assert {str(tmp_path / "site" / "personal" / "round-1.safetensors.tmp"), str(tmp_path / "site" / "personal")} <= (
        set(synced)
    )


def test_only_the_newest_keep_rounds_are_kept(tmp_path):
    ckpt = save_rounds(tmp_path / "checkpoint", range(1, 6), keep=2)
    assert ckpt.rounds() == [4, 5]
    assert sorted(p.name for p in ckpt.dir.iterdir()) == ["round-000004", "round-000005"]
    assert loaded_round(ckpt) == 5
    assert save_rounds(tmp_path / "three", range(1, 6)).rounds() == [3, 4, 5]  # the default keep


def test_saving_a_round_again_replaces_it(tmp_path):
    """SiFT checkpoints after each hop with the same completed round; a resumed run redoes rounds."""
    ckpt = save_rounds(tmp_path / "checkpoint", [1, 2])
    ckpt.save(arrays_of(2) | {"b": np.zeros((2, 3), np.float32)}, meta_of(2) | {"strategy_meta": {"r": 0}})
    arrays, meta = ckpt.load()
    assert meta["strategy_meta"] == {"r": 0} and not arrays["b"].any()
    assert sorted(p.name for p in ckpt.dir.iterdir()) == ["round-000001", "round-000002"]


def test_a_digest_mismatch_is_named_and_the_previous_round_loaded(tmp_path, caplog):
    ckpt = save_rounds(tmp_path / "checkpoint", [1, 2, 3])
    newest = ckpt.dir / "round-000003" / "arrays.safetensors"
    flip_byte(newest)
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert loaded_round(ckpt) == 2
    assert ckpt.loaded == ckpt.dir / "round-000002"
    (warning, *_) = warnings_of(caplog)
    assert str(newest.parent) in warning and "does not match the sha256" in warning


def test_a_torn_state_a_missing_arrays_file_and_a_leftover_temp_dir_are_skipped(tmp_path, caplog):
    ckpt = save_rounds(tmp_path / "checkpoint", [1, 2, 3, 4], keep=4)
    state = ckpt.dir / "round-000004" / "state.json"
    state.write_text(state.read_text()[:40])  # torn
    (ckpt.dir / "round-000003" / "arrays.safetensors").unlink()
    (ckpt.dir / "round-000002" / "state.json").unlink()
    # a save of round 5 interrupted before its rename: complete files, but never made a round
    save_rounds(tmp_path / "other", [5]).dir.joinpath("round-000005").rename(ckpt.dir / ".tmp-round-000005-4242")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert loaded_round(ckpt) == 1
    refused = warnings_of(caplog)
    assert len(refused) == 4  # three refused, then which one is used
    assert "round-000004" in refused[0] and "state.json is not valid JSON" in refused[0]
    assert "round-000003" in refused[1] and "arrays.safetensors is missing" in refused[1]
    assert "round-000002" in refused[2] and "state.json is missing" in refused[2]
    assert "round-000001" in refused[3]
    # the next save cleans the leftover
    ckpt.save(arrays_of(5), meta_of(5))
    assert not (ckpt.dir / ".tmp-round-000005-4242").exists() and loaded_round(ckpt) == 5


def test_no_valid_checkpoint_is_a_clear_error_listing_each_one_tried(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        Checkpointer(tmp_path / "none").load()
    ckpt = save_rounds(tmp_path / "checkpoint", [1, 2])
    flip_byte(ckpt.dir / "round-000002" / "arrays.safetensors")
    (ckpt.dir / "round-000001" / "state.json").write_text("{")
    with pytest.raises(CheckpointError) as err:
        ckpt.load()
    message = str(err.value)
    assert message.startswith(f"no valid checkpoint in {ckpt.dir}; tried:")
    assert f"{ckpt.dir / 'round-000002'}: arrays.safetensors does not match the sha256 in state.json" in message
    assert f"{ckpt.dir / 'round-000001'}: state.json is not valid JSON" in message


def write_legacy(directory: Path, rnd: int) -> None:
    """What the store wrote before round folders: both files directly in checkpoint/, no digest."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(arrays_of(rnd)), str(directory / "arrays.safetensors"))
    (directory / "state.json").write_text(json.dumps(meta_of(rnd), indent=1, sort_keys=True))


def test_the_older_layout_still_loads_and_goes_once_keep_rounds_are_saved(tmp_path):
    run = tmp_path / "run"
    write_legacy(run / "checkpoint", 4)
    assert resolve_checkpoint_dir(str(run)) == run / "checkpoint"
    ckpt = Checkpointer(resolve_checkpoint_dir(str(run)), keep=2)
    assert loaded_round(ckpt) == 4 and ckpt.loaded == run / "checkpoint"
    ckpt.save(arrays_of(5), meta_of(5))
    flip_byte(ckpt.dir / "round-000005" / "arrays.safetensors")
    assert loaded_round(ckpt) == 4  # the older layout is the last one tried
    ckpt.save(arrays_of(5), meta_of(5))
    ckpt.save(arrays_of(6), meta_of(6))
    assert sorted(p.name for p in ckpt.dir.iterdir()) == ["round-000005", "round-000006"]


def test_non_finite_arrays_are_refused_and_the_previous_checkpoint_stays(tmp_path):
    ckpt = save_rounds(tmp_path / "checkpoint", [1])
    for bad in (np.nan, np.inf, -np.inf):
        arrays = arrays_of(2)
        arrays["b"][1, 2] = bad
        with pytest.raises(ValueError, match=r"non-finite arrays \['b'\]"):
            ckpt.save(arrays, meta_of(2))
    assert ckpt.rounds() == [1] and loaded_round(ckpt) == 1
    assert [p.name for p in ckpt.dir.iterdir()] == ["round-000001"]


class Crash(Exception):
    pass


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = save_rounds(tmp_path / "checkpoint", [1, 2])
    real_rename = os.rename

    def crash_before_the_round_appears(src, dst):
        if Path(dst).name == "round-000003":
            raise Crash("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_before_the_round_appears)
    with pytest.raises(Crash):
        ckpt.save(arrays_of(3), meta_of(3))
    monkeypatch.setattr(os, "rename", real_rename)
    assert loaded_round(ckpt) == 2 and ckpt.rounds() == [1, 2]

    written = []
    real_write = store.write_durable

    def crash_after_the_arrays(path, data):
        real_write(path, data)
        written.append(path.name)
        if path.name == "arrays.safetensors":
            raise Crash("killed")

    monkeypatch.setattr(store, "write_durable", crash_after_the_arrays)
    with pytest.raises(Crash):
        ckpt.save(arrays_of(3), meta_of(3))
    monkeypatch.setattr(store, "write_durable", real_write)
    assert written == ["arrays.safetensors"] and loaded_round(ckpt) == 2
    assert sorted(p.name for p in ckpt.dir.iterdir()) == ["round-000001", "round-000002"]


def test_a_crash_while_a_round_is_replaced_loads_the_round_it_replaced(tmp_path, caplog):
    """Replacing round r takes two renames (r aside, the new r in): between them, the moved-aside r is loaded."""
    ckpt = save_rounds(tmp_path / "checkpoint", [1, 2])
    (ckpt.dir / "round-000002").rename(ckpt.dir / ".old-round-000002-4242")
    partial = ckpt.dir / ".tmp-round-000002-4242"
    partial.mkdir()
    (partial / "arrays.safetensors").write_bytes(b"\0" * 10)
    assert loaded_round(ckpt) == 2 and ckpt.loaded == ckpt.dir / ".old-round-000002-4242"
    ckpt.save(arrays_of(3), meta_of(3))
    assert sorted(p.name for p in ckpt.dir.iterdir()) == ["round-000001", "round-000003"]


def test_resume_from_names_a_run_folder_its_checkpoint_folder_or_one_round(tmp_path):
    run = tmp_path / "run"
    ckpt = save_rounds(run / "checkpoint", [1, 2, 3])
    round2 = ckpt.dir / "round-000002"
    assert resolve_checkpoint_dir(str(run)) == ckpt.dir
    assert resolve_checkpoint_dir(str(ckpt.dir)) == ckpt.dir
    assert resolve_checkpoint_dir(str(round2)) == round2
    assert run_folder_of(ckpt.dir) == run and run_folder_of(round2) == run
    assert loaded_round(Checkpointer(round2)) == 2  # that round, though round 3 is newer
    flip_byte(round2 / "arrays.safetensors")
    with pytest.raises(CheckpointError, match="round-000002: arrays.safetensors does not match"):
        Checkpointer(round2).load()  # a chosen round is never swapped for another
    with pytest.raises(FileNotFoundError, match="run-config 'resume-from'"):
        resolve_checkpoint_dir(str(tmp_path / "elsewhere"))
    shutil.copytree(ckpt.dir / "round-000001", ckpt.dir / ".old-round-000004-4242")  # moved aside, then a crash
    assert [p.name for p in ckpt.discard_after(1)] == [".old-round-000004-4242", "round-000003", "round-000002"]
    assert [p.name for p in ckpt.dir.iterdir()] == ["round-000001"]


# ----------------------------------------------------------------------------- per-site state
class FakeRuntime:
    """What PersonalState uses of a ClientRuntime: the node's context.state and its state folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.context = SimpleNamespace(state=RecordDict())

    def state_dir(self) -> Path:
        return self.folder


def test_an_unreadable_newest_per_site_state_falls_back_to_the_previous_version(tmp_path, caplog):
    for rnd in (1, 2, 3):
        PersonalState(FakeRuntime(tmp_path)).save(rnd, arrays_of(rnd))
    fresh = PersonalState(FakeRuntime(tmp_path))  # a restarted site: nothing in memory, only its disk
    got = fresh.load(before=4)
    assert list(got) == ["b", "a"] and got["b"][0, 0] == 3
    folder = tmp_path / "personal"
    (folder / "round-3.safetensors").write_bytes((folder / "round-3.safetensors").read_bytes()[:50])  # torn
    flip_byte(folder / "round-2.safetensors")  # a changed value: caught by the digest it carries
    with caplog.at_level(logging.WARNING, logger="flwr"):
        got = fresh.load(before=4)
    assert got["b"][0, 0] == 1
    refused = warnings_of(caplog)
    assert len(refused) == 2 and str(folder / "round-3.safetensors") in refused[0]
    assert str(folder / "round-2.safetensors") in refused[1] and "sha256" in refused[1]
    (folder / "round-1.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no readable per-site state before round 4"):
        fresh.load(before=4)
    assert fresh.load(before=1) is None  # nothing saved before round 1: a first round, not an error


# ----------------------------------------------------------------------------- run folders and resume
def test_a_new_run_refuses_a_folder_that_holds_a_run_unless_overwrite(tmp_path, caplog):
    config = {**TINY, "output-dir": str(tmp_path), "run-name": "r", "num-rounds": 1}
    folder = run_dir_of(config)

    def cfg(**extra):
        return ExperimentConfig.from_run_config({**defaults(), **config, **extra})

    assert open_run_folder(cfg()) == folder  # absent
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert open_run_folder(cfg()) == folder  # empty of runs
    for mark in ("metrics.jsonl", "checkpoint", "client-state"):
        path = folder / mark
        path.mkdir() if mark != "metrics.jsonl" else path.write_text('{"kind": "server", "round": 1}\n')
        with pytest.raises(ConfigError) as err:
            run_inprocess(config, num_nodes=2)
        message = str(err.value)
        assert str(folder.resolve()) in message and mark in message
        assert "'resume-from'" in message and "'overwrite=true'" in message
    assert (folder / "metrics.jsonl").read_text() == '{"kind": "server", "round": 1}\n'  # nothing deleted
    with caplog.at_level(logging.WARNING, logger="flwr"):
        summary, _ = run_inprocess({**config, "overwrite": True}, num_nodes=2)
    assert any("overwrite=true" in m for m in warnings_of(caplog))
    assert summary["rounds"] == 1 and [r["round"] for r in records(folder, "server")] == [1]
    assert Checkpointer(folder / "checkpoint").rounds() == [1]


def test_resume_after_a_torn_last_line_of_metrics(tmp_path):
    config = {**TINY, "output-dir": str(tmp_path), "run-name": "torn", "num-rounds": 2}
    run_inprocess(config, num_nodes=2)
    metrics = run_dir_of(config) / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"kind": "eval", "round": 3, "client": "site-0", "au')  # the process died while appending
    summary, grid = run_inprocess({**config, "num-rounds": 3, "resume-from": str(run_dir_of(config))}, num_nodes=2)
    assert summary["rounds"] == 3
    assert {int(m.metadata.group_id) for m in grid.sent} == {3}
    assert [r["round"] for r in records(run_dir_of(config), "server")] == [1, 2, 3]
    assert all(line.endswith("}") for line in metrics.read_text().splitlines())


def test_a_run_checkpointed_in_the_older_layout_resumes(tmp_path):
    config = {**TINY, "output-dir": str(tmp_path), "run-name": "old", "num-rounds": 1}
    run_inprocess(config, num_nodes=2)
    checkpoint = run_dir_of(config) / "checkpoint"
    for name in ("arrays.safetensors", "state.json"):  # as the store wrote it before round folders
        (checkpoint / "round-000001" / name).rename(checkpoint / name)
    (checkpoint / "round-000001").rmdir()
    state = json.loads((checkpoint / "state.json").read_text())
    del state["arrays_sha256"]
    (checkpoint / "state.json").write_text(json.dumps(state))
    summary, grid = run_inprocess({**config, "num-rounds": 2, "resume-from": str(run_dir_of(config))}, num_nodes=2)
    assert summary["rounds"] == 2 and {int(m.metadata.group_id) for m in grid.sent} == {2}
    assert Checkpointer(checkpoint).rounds() == [2] and (checkpoint / "state.json").is_file()


def test_a_corrupt_newest_checkpoint_resumes_from_the_previous_round_to_the_uninterrupted_result(tmp_path, caplog):
    common = {**TINY, "output-dir": str(tmp_path)}
    whole = {**common, "run-name": "whole", "num-rounds": 4}
    part = {**common, "run-name": "part", "num-rounds": 3}
    run_inprocess(whole, num_nodes=2)
    run_inprocess(part, num_nodes=2)
    newest = run_dir_of(part) / "checkpoint" / "round-000003" / "arrays.safetensors"
    flip_byte(newest, offset=-5)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        summary, grid = run_inprocess({**part, "num-rounds": 4, "resume-from": str(run_dir_of(part))}, num_nodes=2)
    assert any(str(newest.parent) in m and "sha256" in m for m in warnings_of(caplog))
    assert {int(m.metadata.group_id) for m in grid.sent} == {3, 4}, "resumed from round 2, rounds 3 and 4 redone"
    a, meta_a = Checkpointer(run_dir_of(whole) / "checkpoint").load()
    b, meta_b = Checkpointer(run_dir_of(part) / "checkpoint").load()
    assert meta_b["completed_rounds"] == 4 and list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert Checkpointer(run_dir_of(part) / "checkpoint").rounds() == [2, 3, 4]
    for rnd in (2, 3, 4):  # the corrupt round 3 was replaced by the redone one
        x, _ = Checkpointer(run_dir_of(whole) / "checkpoint" / f"round-{rnd:06d}").load()
        y, _ = Checkpointer(run_dir_of(part) / "checkpoint" / f"round-{rnd:06d}").load()
        assert all(np.array_equal(x[k], y[k]) for k in x), rnd
    for kind in ("train", "eval", "server"):
        assert timeless(records(run_dir_of(whole), kind)) == timeless(records(run_dir_of(part), kind)), kind
    assert summary["rounds"] == 4
    # resume-from one round folder, to 3 rounds: rounds 3 and 4 are dropped, round 3 redone to the same result
    round3, _ = Checkpointer(run_dir_of(whole) / "checkpoint" / "round-000003").load()
    round2 = run_dir_of(whole) / "checkpoint" / "round-000002"
    _, grid = run_inprocess({**whole, "num-rounds": 3, "resume-from": str(round2)}, num_nodes=2)
    assert {int(m.metadata.group_id) for m in grid.sent} == {3}
    ckpt = Checkpointer(run_dir_of(whole) / "checkpoint")
    c, meta_c = ckpt.load()
    assert ckpt.rounds() == [2, 3] and meta_c["completed_rounds"] == 3
    assert all(np.array_equal(round3[k], c[k]) for k in round3)
    assert [r["round"] for r in records(run_dir_of(whole), "server")] == [1, 2, 3]


def timeless(rows: list[dict]) -> list[dict]:
    """Records without their timings."""
    return [{k: v for k, v in r.items() if k != "time" and not k.endswith("_s")} for r in rows]


def test_same_named_runs_keep_their_own_site_state_and_a_resumed_run_finds_its_own(tmp_path, monkeypatch):
    """Sites with node-config state-dir key each run's state by its identity (kept in the checkpoint): a second run
    of the same name (another seed) in between neither prunes nor feeds the first, which resumes to the same
    personal models as an uninterrupted run."""
    from medflower.contract.server import FederatedStrategy

    class Stop(Exception):
        pass

    original = FederatedStrategy.run_round
    stop_at: list[int] = []

    def run_round(self, grid, rnd):
        if stop_at and rnd == stop_at[0]:
            raise Stop
        return original(self, grid, rnd)

    monkeypatch.setattr(FederatedStrategy, "run_round", run_round)
    common = {**TINY, "strategy": "local", "num-rounds": 2, "run-name": "same"}
    sites = [{"state-dir": str(tmp_path / "state")}, {"state-dir": str(tmp_path / "state")}]
    stop_at.append(2)
    with pytest.raises(Stop):
        run_inprocess({**common, "output-dir": str(tmp_path / "a")}, 2, node_configs=sites)
    stop_at.clear()
    run_inprocess({**common, "output-dir": str(tmp_path / "b"), "seed": 1}, 2, node_configs=sites)
    run_inprocess(
        {**common, "output-dir": str(tmp_path / "a"), "resume-from": str(tmp_path / "a" / "same")},
        2,
        node_configs=sites,
    )
    alone = [{"state-dir": str(tmp_path / "alone")}, {"state-dir": str(tmp_path / "alone")}]
    run_inprocess({**common, "output-dir": str(tmp_path / "c")}, 2, node_configs=alone)
    uids = {Checkpointer(tmp_path / d / "same" / "checkpoint").load()[1]["run_uid"] for d in ("a", "b")}
    assert len(uids) == 2 and {p.name for p in (tmp_path / "state").iterdir()} == {f"same-{u}" for u in uids}
    final = {d: [r for r in records(tmp_path / d / "same", "eval") if r["round"] == 2] for d in ("a", "c")}
    assert final["a"] and final["a"] == final["c"]
