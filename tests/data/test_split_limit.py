"""A budget of rows (docs/data.md#a-budget-of-rows): ``split-limit`` keeps at most N rows of a site's split, a
seeded subset of the split the site would use without it, stratified by label; groups stay apart; a bad value is
refused with the key and the reason."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_groups import groups_of, write_grouped_manifest

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.data import DataError, DataSpec, load_client_data
from medflower.data.sources import open_source
from medflower.data.spec import parse_split_limit

POOL = DataSpec(synthetic_size=1200, partition="iid", seed=5)


def image_bytes(data, split: str, index: int) -> bytes:
    return np.asarray(getattr(data, split)[index][0]).tobytes()


def split_lines(data, split: str) -> np.ndarray:
    """The source rows of one split of a csv site (``lines`` counts the header as line 1)."""
    return getattr(data, split).lines - 2


def test_a_limited_split_is_a_seeded_subset_of_the_unlimited_one():
    whole = load_client_data(POOL, 1, 3)
    limited = load_client_data(replace(POOL, split_limit="train:40,test:15"), 1, 3)
    assert (len(limited.train), len(limited.val), len(limited.test)) == (40, len(whole.val), 15)
    for split in ("train", "val", "test"):  # every kept row is one the split already had, in the same order
        rows = {image_bytes(whole, split, i): i for i in range(len(getattr(whole, split)))}
        assert len(rows) == len(getattr(whole, split))  # the synthetic images are all different
        positions = [rows[image_bytes(limited, split, i)] for i in range(len(getattr(limited, split)))]
        assert positions == sorted(positions) and len(set(positions)) == len(positions), split
    again = load_client_data(replace(POOL, split_limit="train:40,test:15"), 1, 3)
    assert np.array_equal(again.train.labels, limited.train.labels)  # the same choice in every process
    other = load_client_data(replace(POOL, split_limit="train:40,test:15", seed=6), 1, 3)
    assert [image_bytes(other, "train", i) for i in range(40)] != [image_bytes(limited, "train", i) for i in range(40)]


def test_the_kept_rows_keep_each_class_in_its_share():
    whole = load_client_data(POOL, 0, 2)
    limited = load_client_data(replace(POOL, split_limit="train:64"), 0, 2)
    classes = np.arange(whole.num_classes)
    share = np.array([(whole.train.labels == c).mean() for c in classes])
    counts = np.array([(limited.train.labels == c).sum() for c in classes])
    assert counts.sum() == 64
    assert np.all(np.abs(counts - 64 * share) <= 1), (counts, 64 * share)


def test_a_limit_above_the_split_keeps_it_whole():
    whole = load_client_data(POOL, 0, 4)
    limited = load_client_data(replace(POOL, split_limit="train:100000,val:100000"), 0, 4)
    assert np.array_equal(limited.train.labels, whole.train.labels)
    assert np.array_equal(limited.val.labels, whole.val.labels)


def test_a_limited_split_never_shares_a_group_with_another(tmp_path):
    manifest = write_grouped_manifest(tmp_path, num_groups=90)
    for seed in range(3):
        spec = DataSpec(dataset=f"csv:{manifest}", partition="natural", seed=seed, img_size=8)
        limited_spec = replace(spec, split_limit="train:12,val:3,test:5")
        groups = open_source(spec).groups
        for p in range(3):
            whole, limited = load_client_data(spec, p, 3), load_client_data(limited_spec, p, 3)
            train, val, test = (split_lines(limited, s) for s in ("train", "val", "test"))
            assert (len(train), len(val), len(test)) == (12, 3, 5)
            for split, rows in zip(("train", "val", "test"), (train, val, test)):
                assert set(rows.tolist()) <= set(split_lines(whole, split).tolist()), (seed, p, split)
            train_g, val_g, test_g = (groups_of(r, groups) for r in (train, val, test))
            assert not (train_g & val_g or train_g & test_g or val_g & test_g), (seed, p)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:0", "'train:0': the rows must be a whole number >= 1"),
        ("train:2.5", "'train:2.5': the rows must be a whole number >= 1"),
        ("train:-3", "'train:-3': the rows must be a whole number >= 1"),
        ("train:\u00b2", "'train:\u00b2': the rows must be a whole number >= 1"),
        ("training:40", "'training:40' is not <split>:<rows> with the split one of train, val, test"),
        ("train", "'train' is not <split>:<rows>"),
        ("train:40,train:20", "train is limited twice"),
    ],
)
def test_a_bad_limit_is_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message):
        parse_split_limit(text)
    with pytest.raises(DataError, match=f"split_limit {text!r}"):
        DataSpec(split_limit=text)
    with pytest.raises(ConfigError, match=f"run-config 'split-limit' = {text!r} is invalid"):
        ExperimentConfig.from_run_config({**defaults(), "split-limit": text}, check_paths=False)


def test_the_run_config_reaches_the_sites_data_spec():
    cfg = ExperimentConfig.from_run_config({**defaults(), "split-limit": " train:40 , test:20 "}, check_paths=False)
    assert cfg.data_spec().split_limit == " train:40 , test:20 "
    assert parse_split_limit(cfg.data_spec().split_limit) == {"train": 40, "test": 20}
    assert parse_split_limit("") == {}
