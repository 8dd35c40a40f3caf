"""Continual task streams: class orders, binary tasks, their errors and config checks."""

import numpy as np
import pytest

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.data import DataError, make_loader
from medflower.data.image_datasets import ArrayImageDataset
from medflower.data.tasks import binary_task, client_class_order, count_tasks, parse_task_classes, task_classes

NAMES = ["mel", "nv", "bcc", "ak", "bkl"]


def test_task_classes_accept_names_and_indices_and_default_to_the_dataset_order():
    assert parse_task_classes("", NAMES) == [0, 1, 2, 3, 4]
    assert parse_task_classes("nv, mel, 4", NAMES) == [1, 0, 4]


@pytest.mark.parametrize(
    "text, message",
    [
        ("nv,scc", "'scc' is neither a class name nor an index < 5 (classes: mel, nv, bcc, ak, bkl)"),
        ("nv,7", "'7' is neither"),
        ("nv,1", "class 'nv' appears twice"),
        ("nv", "at least two classes"),
    ],
)
def test_bad_task_classes_say_what_is_wrong(text, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_task_classes(text, NAMES)


def test_task_t_is_the_new_class_against_every_class_seen_before():
    order = [3, 0, 2, 1]
    assert task_classes(order, 1) == (0, [3])
    assert task_classes(order, 3) == (1, [3, 0, 2])
    with pytest.raises(DataError, match="task 4 is outside 1..3"):
        task_classes(order, 4)
    assert count_tasks(order, 0) == 3 and count_tasks(order, 2) == 2
    with pytest.raises(DataError, match="num-tasks = 4 needs 5 classes"):
        count_tasks(order, 4)


def test_orders_sync_reversed_and_a_seeded_shuffle_per_client():
    order = list(range(8))
    assert client_class_order(order, "sync", 0, 3) == order
    assert client_class_order(order, "reversed", 0, 3) == order[::-1]
    shuffled = [client_class_order(order, "shuffled", 0, p) for p in range(4)]
    assert all(sorted(s) == order for s in shuffled)
    assert len({tuple(s) for s in shuffled}) == 4  # a different order per client
    assert shuffled[2] == client_class_order(order, "shuffled", 0, 2)  # seeded
    assert shuffled[2] != client_class_order(order, "shuffled", 1, 2)


def test_binary_task_keeps_seen_and_new_rows_and_labels_the_new_class_one():
    labels = np.array([0, 1, 2, 3, 0, 1, 2, 3, 4])
    images = np.arange(len(labels), dtype=np.uint8)[:, None, None].repeat(4, 1).repeat(4, 2)
    data = ArrayImageDataset(images, labels, img_size=4)
    task = binary_task(data, [2, 0, 3], task=2)  # 3 vs {2, 0}
    assert sorted(task.positions.tolist()) == [0, 2, 3, 4, 6, 7]
    for i in range(len(task)):
        image, y = task[i]
        assert y == int(labels[image[0, 0]] == 3)
    x, y = next(iter(make_loader(task.take(np.array([0, 1])), 2, False, 0)))
    assert x.shape == (2, 3, 4, 4) and y.tolist() == [0, 0]


def test_fedkei_refuses_a_segmentation_source():
    with pytest.raises(ConfigError, match="trains classification models only; dataset .synthetic-seg. is segmentation"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedkei", "dataset": "synthetic-seg"})


def test_unknown_variant_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="valid choices are full, A, B, C, rand, fedavg-init"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedkei", "fedkei-variant": "D"})
