"""What the tests share that is not a fixture: the tiny run configs, small readers of a run's outputs, site-side
stand-ins and hand-checkable maths. Test modules import it (``from helpers import ...``); tests/conftest.py holds
the fixtures and the collection hooks.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

# The repository's root, wherever under tests/ the module using it lives.
ROOT = Path(__file__).resolve().parent.parent

# Small and fast: the synthetic source at 16x16 with 8x8 patches on timm's own test ViT (6 blocks, 64 wide; timm
# tests its models with it), which runs a tiny run in about 60 % of ViT-Tiny's time. Most tests check messages,
# checkpoints, faults, resume and maths, not the model; a test whose numbers rest on ViT-Tiny's 12 blocks of 192 (a
# layer or frequency budget) or whose learning check it needs asks for backbone='vit-tiny' and says why.
TINY = {
    "dataset": "synthetic",
    "synthetic-size": 320,
    "img-size": 16,
    "patch-size": 8,
    "backbone": "test_vit",
    "backbone-weights": "none",
    "num-rounds": 3,
    "batch-size": 32,
    "lr": 0.01,
    "partition": "iid",
    "site-figures": 0,  # no pictures of the sites' predictions: the tests of them ask for some
    "run-figures": False,  # nor curves.png and sites.png (a second of matplotlib a run): the tests of them ask for them
}
# TINY's test ViT in numbers, for the tests that count its arrays or shapes: blocks, embedding width and MLP width
# (mlp_ratio 3); tests/models/test_models.py checks them against the built model.
TINY_BLOCKS, TINY_WIDTH, TINY_MLP = 6, 64, 192
# What a test that rests on ViT-Tiny (12 blocks of 192) adds to TINY.
VIT_TINY = {"backbone": "vit-tiny"}


def records(run_dir: Path, kind: str) -> list[dict]:
    """The records of one kind ("train", "eval", "server", ...) in a run folder's metrics.jsonl, in order."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def run_dir_of(config: dict) -> Path:
    """The run folder of a run config with a run-name: <output-dir>/<run-name>."""
    return Path(config["output-dir"]) / config["run-name"]


def restart_processes() -> None:
    """What a restarted server or SuperNode keeps in memory: nothing. Empties every functools cache of medflower (a
    site's built model object, loaded data), so a strategy that carried state in them would not resume equal."""
    for name, module in list(sys.modules.items()):
        if name == "medflower" or name.startswith("medflower."):
            for obj in list(vars(module).values()):
                if callable(getattr(obj, "cache_clear", None)):
                    obj.cache_clear()


# The sub-model family's mixed federation: 2 segmentation sites and 1 classification site of three capacities.
MIXED_TASKS = {
    "dataset": "synthetic-seg",
    "site-datasets": "synthetic-seg,synthetic-seg,synthetic",
    "fedbkd-capacities": "0.5,0.125,0.25",
    "synthetic-size": 160,
}

# The run of the tests that start real Flower processes (flower-superlink, flower-supernode, flwr run): small enough
# that their time is the processes' start and the rounds' messages, not training.
REAL_PROCESSES = {
    "synthetic-size": 240,
    "img-size": 16,
    "patch-size": 8,
    "backbone": TINY["backbone"],  # these tests check processes and messages, not the model
    "backbone-weights": "none",
    "batch-size": 32,
    "partition": "iid",
}

# The class-incremental strategies' small setting: 2 tasks of 2 classes, 2 rounds each, QBLI sites.
INCREMENTAL = {
    "num-tasks": 2,
    "classes-per-task": 2,
    "rounds-per-task": 2,
    "n-frequency": 64,
    "lora-rank": 2,
    "optimizer": "adam",
    "lr": 0.01,
    "partition": "qbli",
}


def site_runtime(tmp_path, strategy: str, **run_config):
    """One site's ClientRuntime (partition 0 of 2, its state folder under ``tmp_path``) for driving a client half
    message by message; a second call with the same ``tmp_path`` is the same site restarted (empty context.state)."""
    from flwr.app import Context, RecordDict

    from medflower.config import ExperimentConfig, defaults
    from medflower.contract import ClientRuntime

    cfg = ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": strategy, **run_config})
    node = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "state")}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    return ClientRuntime(cfg, context, {"round": 0}, 0, 2)


def send_to_site(runtime, half: type, kind: str, rnd: int, arrays):
    """Round ``rnd``'s train or evaluate message with ``arrays``, handled by client half ``half`` on ``runtime``; a
    stand-in of what a client half reads of a message (its content: a Message proper needs a running Flower run)."""
    from types import SimpleNamespace

    from flwr.app import ConfigRecord, RecordDict

    from medflower.contract import to_record

    message = SimpleNamespace(content=RecordDict({"arrays": to_record(arrays), "config": ConfigRecord({"round": rnd})}))
    runtime.config["round"] = rnd
    client = half(runtime)
    return client.train(message) if kind == "train" else client.evaluate(message)


def training_starts(monkeypatch) -> list:
    """The trainable arrays each ``ClientRuntime.train_local`` call starts from, in call order (filled as they run)."""
    from medflower.contract import ClientRuntime

    seen = []
    original = ClientRuntime.train_local

    def train_local(self, *args, **kwargs):
        seen.append(self.model.get_trainable())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ClientRuntime, "train_local", train_local)
    return seen


# A linear model and the half mean-squared error with its gradient in numpy: the meta-learning baselines' steps
# (Per-FedAvg, ELCFS) checked by hand against them.
class LinearModel(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.tensor(b, dtype=torch.float64))

    def forward(self, x):
        return x @ self.w + self.b


def half_mse(pred, y):
    """f = ½·mean((x·w + b − y)²): ∇_w = Xᵀr/n, ∇_b = mean(r) with r = Xw + b − y."""
    return 0.5 * ((pred - y) ** 2).mean()


def half_mse_gradient(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return {"w": x.T @ r / len(y), "b": np.array([r.mean()])}


def half_mse_loss(p, x, y):
    return 0.5 * np.mean((x @ p["w"] + p["b"] - y) ** 2)


def extended_by_a_task(tiny, tasks: dict) -> tuple[Path, Path]:
    """A continual run of 3 tasks, and one of 2 tasks resumed for a 3rd (only task 3's fine-tuning is sent again);
    returns both run folders, for the caller to compare their records."""
    from medflower.inprocess import run_inprocess

    full = tiny(**{**tasks, "run-name": "full", "num-tasks": 3})
    run_inprocess(full, num_nodes=2)
    part = tiny(**{**tasks, "run-name": "part", "num-tasks": 2})
    run_inprocess(part, num_nodes=2)
    _, grid = run_inprocess(tiny(**{**tasks, "num-tasks": 3, "resume-from": str(run_dir_of(part))}), num_nodes=2)
    assert [m.metadata.group_id for m in grid.sent if m.metadata.message_type == "train"] == ["3", "3"]
    return run_dir_of(full), run_dir_of(part)


# A LiteMedSAM of tiny sizes in LiteMedSAM's key layout (image_encoder.*, prompt_encoder.*, mask_decoder.*): built by
# the package's modules, so backbone='litemedsam' loads it through the same path as the released file.
TINY_LITEMEDSAM = dict(
    embed_dims=(8, 16, 32, 320),  # the last width must be one TinyViT keeps the 1/4 grid for
    depths=(1, 1, 1, 1),
    num_heads=(2, 1, 2, 4),  # stage 0 (MBConv) has no attention: 2 as LiteMedSAM's, unused
    window_sizes=(7, 7, 7, 7),
    mlp_ratio=1.0,
    decoder_depth=1,
    decoder_mlp_dim=32,
    iou_head_depth=2,
    iou_head_hidden_dim=16,
    mask_in_chans=4,
)


def write_tiny_litemedsam(path: Path, seed: int = 0, img_size: int = 32) -> Path:
    """Save a seeded tiny LiteMedSAM's state dict to ``path`` (.pth) and return it."""
    import torch

    from medflower.models import litemedsam

    arch = litemedsam.Architecture(**TINY_LITEMEDSAM)
    torch.manual_seed(seed)
    encoder = litemedsam.build_encoder(arch, img_size)
    prompt_encoder, mask_decoder = litemedsam.build_prompt_decoder(arch, img_size)
    state = {
        **{f"image_encoder.{k}": v for k, v in encoder.state_dict().items()},
        **{f"prompt_encoder.{k}": v for k, v in prompt_encoder.state_dict().items()},
        **{f"mask_decoder.{k}": v for k, v in mask_decoder.state_dict().items()},
    }
    torch.save(state, path)
    return path


def declaring_size(size: float):
    """The join reply of partition 0 declares ``size`` training images and its training replies count as many
    (a site lying about its size at joining, so that its count passes the declared-size check)."""
    from medflower.contract.client import ClientHalf

    query, reply = ClientHalf.query, ClientHalf.reply

    def lying_query(self, message):
        content = query(self, message)
        if self.rt.partition_id == 0:
            content["metrics"]["num-train"] = float(size)
        return content

    def lying_reply(self, arrays=None, metrics=None):
        if self.rt.partition_id == 0 and metrics and "num-examples" in metrics:
            metrics = {**metrics, "num-examples": float(size)}
        return reply(self, arrays, metrics)

    return lying_query, lying_reply


def sent(grid, message_type: str, rnd: int) -> list:
    """The messages of ``message_type`` an in-process grid sent in round ``rnd``."""
    return [m for m in grid.sent if m.metadata.message_type == message_type and m.metadata.group_id == str(rnd)]
