"""The validated run config: the generic options, the strategy's own options and checks, and views for the layers.

Every run-config key is an ``Option`` (``medflower/options.py``), declared once: the generic ones here, a method's
own ones on its strategy class. The same declarations feed validation (a bad value stops the run before any
training with one message naming the key, the bad value and what is valid), ``pyproject.toml``'s defaults check and
docs/run-config.md (``python -m medflower.config --write``). This module checks what holds for every strategy and
asks the strategy class for the rest (``FederatedStrategy.check_config``); it knows no method by name.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .contract.registry import strategies_with, strategies_with_dp
from .contract.server import FederatedStrategy
from .contract.site_registry import SiteRegistry
from .data import PARTITIONS, SOURCE_KINDS
from .data.maskmap import parse_mask_values
from .data.spec import (
    ARGLESS_KINDS,
    parse_augment,
    parse_empty_slices,
    parse_intensity,
    parse_split_limit,
    unsupported_partition,
)
from .data.tasks import TASK_ORDERS
from .models import ADAPTERS, BACKBONE_ALIASES, WEIGHT_MODES
from .models.build import MEDSAM_AUTO
from .models.litemedsam import PROMPTS, img_size_problem
from .models.normalisation import INPUT_NORMS
from .models.spec import is_unet
from .options import (
    ConfigError,
    Option,
    bad,
    fraction_below_one,
    in_range,
    non_negative,
    one_of,
    parsed,
    positive,
    unit_interval_open_left,
)
from .privacy import DP_OPTIONS, DP_SGD_OPTIONS, check_privacy_config
from .privacy.secagg import SECAGG_OPTIONS, check_secagg_config
from .settings import RunSettings, holds_masks
from .strategies import STRATEGIES
from .tracking import TRACKING_OPTIONS

__all__ = ["ConfigError", "ExperimentConfig", "Option", "all_options", "defaults", "run_config_markdown"]


class _RegisteredStrategy:
    """The check of ``strategy``: any registered name (its choices grow as strategies register)."""

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(STRATEGIES)

    def __call__(self, v: str) -> str | None:
        return None if v in STRATEGIES else "valid choices are " + ", ".join(STRATEGIES)


# dataset kinds whose argument is a path (a csv manifest; a segfolder or volumes folder): checked here, made absolute
# by the experiment runner
PATH_DATASETS = ("csv", "segfolder", "volumes")


def _dataset_check(v: str) -> str | None:
    kind = v.split(":", 1)[0]
    valid = (
        "valid choices are synthetic, synthetic-seg, medmnist:<flag>, csv:<manifest.csv>, segfolder:<root>, "
        "volumes:<root>, site"
    )
    if v == "site":
        return None
    if kind not in SOURCE_KINDS:
        return valid
    if kind in ARGLESS_KINDS and v != kind:
        return valid
    if kind not in ARGLESS_KINDS and (not v.split(":", 1)[1:] or v.endswith(":")):
        return f"'{kind}:' needs a value after the colon; " + valid
    return None


def _backbone_check(v: str) -> str | None:
    from .models.spec import UNET_BACKBONES

    if v in BACKBONE_ALIASES or v in UNET_BACKBONES:
        return None
    import timm

    if v in timm.list_models():
        return None
    return "valid choices are " + ", ".join([*BACKBONE_ALIASES, *UNET_BACKBONES]) + " or any timm model name"


def _weights_check(v: str) -> str | None:
    """none | auto | an existing weights file | a Hugging Face hub cache folder holding one (models/checkpoints.py)."""
    from .models.checkpoints import WEIGHT_FILE_SUFFIXES, weights_folder_problem

    path = Path(v).expanduser()
    if v in WEIGHT_MODES:
        return None
    if path.is_dir():
        return weights_folder_problem(path)
    if path.is_file():
        if path.suffix in WEIGHT_FILE_SUFFIXES:
            return None
        return f"a weights file must end in one of {', '.join(WEIGHT_FILE_SUFFIXES)}"
    return (
        f"valid choices are {', '.join(WEIGHT_MODES)}, the path of an existing weights file "
        f"({'/'.join(WEIGHT_FILE_SUFFIXES)}) or a Hugging Face hub cache folder"
    )


def _site_datasets(v: Any) -> str:
    """'' or comma-separated datasets, one per partition id, each a valid ``dataset`` value."""
    text = str(v).strip()
    for entry in filter(None, (e.strip() for e in text.split(","))):
        if (why := _dataset_check(entry)) or entry == "site":
            raise ValueError(f"entry {entry!r}: {why or 'site data comes from node-config data-path'}")
    return text


def _axis_check(v: int) -> str | None:
    return None if v in (0, 1, 2) else "valid choices are 0, 1, 2"


def _seed_check(v: int) -> str | None:
    """numpy's legacy seeding (used by the data layer's libraries) takes 32-bit seeds only."""
    return None if 0 <= v < 2**32 else "must be in [0, 2**32)"


GENERIC_OPTIONS: tuple[Option, ...] = (
    Option("strategy", "fedavg", "federated method (see the methods table)", _RegisteredStrategy()),
    Option("num-rounds", 5, "federated rounds", in_range(1, 100_000)),
    Option("seed", 0, "seed of data partitioning, model init, client sampling and training", _seed_check),
    Option(
        "fraction-train", 1.0, "fraction of connected nodes sampled for training each round", unit_interval_open_left
    ),
    Option("min-nodes", 1, "nodes that must be connected before round 1 starts", in_range(1, 100_000)),
    Option("node-wait-timeout", 120.0, "seconds to wait for min-nodes and for a new node's first answer", positive),
    Option("round-timeout", 600.0, "seconds to wait for replies in one phase; late nodes are skipped", positive),
    Option(
        "evaluate-in-train",
        False,
        "carry each round's evaluation in the next round's training replies (one message per site and round "
        "instead of two; the last round still has its evaluate phase); strategies with a single training phase "
        "only (docs/deployment.md#fewer-messages-per-round)",
    ),
    Option(
        "evaluate-every",
        1,
        "evaluate the sites' test splits every this many rounds, and always after the last round; 1 = every round. "
        "Saves the evaluation's cost where it is as large as training's (an encoder's forward on every test image); "
        "strategies with the default round and SiFT (docs/experiments.md#evaluating-every-few-rounds)",
        in_range(1, 100_000),
    ),
    Option(
        "cross-site-evaluation",
        False,
        "after the last round, every site evaluates every final model it may see and summary.json/summary.md get the "
        "site x model matrix: the global model on every site; with a personalised strategy only each site's own model "
        "on its own data (it never leaves the site); strategies with the default round only "
        "(docs/experiments.md#cross-site-evaluation)",
    ),
    Option("output-dir", "outputs", "where run folders go (relative paths: the ServerApp's working directory)"),
    Option("run-name", "", "run folder name; empty = <strategy>-<dataset>-<time>"),
    Option("resume-from", "", "run folder (or its checkpoint/) of a stopped run to continue"),
    Option(
        "overwrite",
        False,
        "start over in a run folder that already holds a run (deletes its metrics, checkpoints and client state); "
        "without it such a folder is refused unless resume-from names it",
    ),
    Option(
        "keep-checkpoints", 3, "checkpoints kept in the run folder (the newest valid one is resumed)", in_range(1, 1000)
    ),
    Option(
        "site-registry",
        "",
        "TOML file mapping each site name to its node id (the id 'flwr supernode register' printed for its key); "
        "a node whose claimed site name does not match is refused. Empty = no registry",
    ),
    Option(
        "run-figures",
        True,
        "draw the run folder's curves.png (test metrics per round) and sites.png (each site's final metrics) at the "
        "end of the run; false = neither (summary.md then shows none; an experiment file's comparison draws its own "
        "from metrics.jsonl)",
    ),
    Option(
        "site-figures",
        4,
        "test images in each site's picture of its model's predictions at the first and the last round (ground "
        "truth and predicted contours per structure; a classifier's class and probability), drawn by the site into "
        "its own folder: sites/<site>/ of the run folder in simulation, node-config figures-dir on a SuperNode (none "
        "without it); 0 = no pictures (docs/experiments.md#pictures)",
        in_range(0, 16),
    ),
    Option(
        "site-datasets",
        "",
        "dataset per partition id, comma-separated (e.g. 'synthetic-seg,synthetic-seg,synthetic'); sites with "
        "the same entry split it; empty = dataset for all. Mixing segmentation and classification needs a "
        "sub-model strategy",
        None,
        "data",
        _site_datasets,
    ),
    Option(
        "dataset",
        "synthetic",
        "synthetic | synthetic-seg | medmnist:<flag> | csv:<manifest.csv> | segfolder:<root> | volumes:<root> | "
        "site (each "
        "SuperNode's node-config data-path; needs num-classes)",
        _dataset_check,
        "data",
    ),
    Option(
        "task",
        "auto",
        "auto = segmentation for synthetic-seg/segfolder/volumes sources, else classification; set it for "
        "dataset='site'",
        one_of("auto", "classification", "segmentation"),
        "data",
    ),
    Option("data-dir", "data", "folder holding <flag>.npz for medmnist sources", None, "data"),
    Option("partition", "dirichlet", "how data is split over clients", one_of(*PARTITIONS), "data"),
    Option("dirichlet-alpha", 0.5, "Dirichlet concentration of the label skew", positive, "data"),
    Option("pathological-k", 2, "classes per client for the pathological partition", in_range(1, 100_000), "data"),
    Option("val-fraction", 0.1, "per-client validation share (seeded, stratified)", fraction_below_one, "data"),
    Option("test-fraction", 0.2, "per-client test share (seeded, stratified)", fraction_below_one, "data"),
    Option(
        "use-source-splits", True, "keep the split a source gives (MedMNIST official, csv split column)", None, "data"
    ),
    Option(
        "synthetic-size", 2400, "samples in the synthetic pool (all clients together)", in_range(1, 1_000_000), "data"
    ),
    Option(
        "intensity",
        "auto",
        "how >8-bit and float images (16-bit PNG/TIFF, DICOM, NIfTI) become 0..255: auto (8-bit as is, DICOM's own "
        "window if it has one, else percentile:0.5,99.5), none, minmax, percentile:<low>,<high>, "
        "window:<center>,<width>",
        parsed(parse_intensity),
        "data",
    ),
    Option("slice-axis", 2, "volumes: the array axis 2-D slices are cut across (0, 1 or 2)", _axis_check, "data"),
    Option(
        "empty-slices",
        "keep",
        "volumes: slices whose mask has no foreground: keep, drop, or keep:<fraction> (a seeded share per case)",
        parsed(parse_empty_slices),
        "data",
    ),
    Option(
        "mask-values",
        "",
        "what each mask value stands for, '<value>=<structure>[+<structure>],...' (e.g. '0=disc+cup,128=disc,255=' "
        "for REFUGE, '0=,1=peripheral,2=transition' for a label map); one output per structure; empty = binary "
        "(0/255, 0/1) or class-index masks",
        parsed(parse_mask_values),
        "data",
    ),
    Option(
        "augment",
        "",
        "training-only augmentation, seeded: a comma list of crop:<fraction>, flip, vflip, rotate:<degrees>, "
        "jitter:<strength>; empty = none",
        parsed(parse_augment),
        "data",
    ),
    Option(
        "split-limit",
        "",
        "a budget: at most this many rows in a split at each site, a seeded subset stratified by label, e.g. "
        "'train:40,val:10,test:20' (a split not named keeps all its rows); empty = every row",
        parsed(parse_split_limit),
        "data",
    ),
    Option(
        "class-names",
        "",
        "comma-separated class names in index order, fixed for the run: with dataset='site' each site maps its "
        "labels onto them (a label outside them is an error); empty = the source's names (dataset='site': "
        "integer labels 0..num-classes-1)",
        None,
        "data",
    ),
    Option(
        "num-classes",
        0,
        "classes of the head (segmentation: foreground classes); 0 = read from the data source",
        in_range(0, 100_000),
        "data",
    ),
    Option(
        "num-tasks",
        0,
        "continual runs: tasks to walk; 0 = one per class after the first of the order",
        non_negative,
        "tasks",
    ),
    Option(
        "task-classes",
        "",
        "continual runs: class order c_0,c_1,... (names or indices); task t = c_t vs c_0..c_{t-1}; empty = the "
        "dataset's order",
        None,
        "tasks",
    ),
    Option(
        "task-order",
        "sync",
        "continual runs: sync = every client the same order, reversed, shuffled = a seeded order per client",
        one_of(*TASK_ORDERS),
        "tasks",
    ),
    Option(
        "classes-per-task",
        2,
        "class-incremental runs: classes per task (task t = classes (t-1)C..tC-1 of task-classes' order); "
        "num-tasks 0 = every full group",
        positive,
        "tasks",
    ),
    Option(
        "qbli-classes",
        1,
        "partition qbli: classes of each task a client holds (quantity-based label imbalance)",
        positive,
        "tasks",
    ),
    Option(
        "backbone",
        "vit-tiny",
        "timm backbone alias or timm model name; unet / resunet[-<depth>] for the U-Net baselines (segmentation)",
        _backbone_check,
        "model",
    ),
    Option(
        "backbone-weights",
        "auto",
        "none | auto (cached timm weights, else random + warning) | a weights file (timm, SAM/MedSAM, MAE/RETFound, "
        "DINO, torchvision) | a Hugging Face cache folder",
        _weights_check,
        "model",
    ),
    Option("img-size", 32, "input resolution", in_range(1, 4096), "model"),
    Option(
        "patch-size",
        8,
        "ViT patch size; 0 = the backbone's own (other backbones ignore it)",
        in_range(0, 4096),
        "model",
    ),
    Option(
        "adapter",
        "lora",
        "trainable adapter (pfedmxf trains fourier, fedavg-lora and fedstack lora-qk: q and k slices only)",
        one_of(*ADAPTERS),
        "model",
    ),
    Option("lora-rank", 8, "LoRA rank r", in_range(1, 4096), "model"),
    Option("lora-alpha", 16.0, "LoRA scaling alpha", positive, "model"),
    Option("adapter-targets", "", "comma-separated module names to adapt; empty = per-backbone default", None, "model"),
    Option("bottleneck-ratio", 0.25, "hidden/width ratio of bottleneck adapters", unit_interval_open_left, "model"),
    Option(
        "sam-prompt",
        "whole-image",
        "litemedsam segmentation: prompt of SAM's mask decoder, whole-image (the image's box; nothing from the labels) "
        "or box (each structure's ground-truth box, MedSAM's interactive setting; needs masks at test time)",
        one_of(*PROMPTS),
        "model",
    ),
    Option(
        "input-norm",
        "auto",
        "input normalisation the backbone's weights expect: auto (litemedsam/medsam min-max, loaded timm weights "
        "their pretrained config's mean/std, random weights ImageNet's) | imagenet | min-max | mean-std",
        one_of(*INPUT_NORMS),
        "model",
    ),
    Option(
        "frozen-encoder",
        "auto",
        "cache each site's encoder outputs once and train only above them: auto (when nothing in the encoder trains, "
        "adapter='none', no augmentation and the strategy reads no pixels) | on (the same, refused when it cannot "
        "apply) | off (the full forward every step)",
        one_of("auto", "on", "off"),
        "model",
    ),
    Option("local-epochs", 1, "local epochs per round", in_range(1, 10_000), "train"),
    Option(
        "local-steps",
        0,
        "optimizer steps per round instead of local-epochs' full passes (0: local-epochs); batches are drawn from the "
        "shuffled training split, a new pass when it runs out (FLamby's benchmarks train 100 steps a round)",
        in_range(0, 10_000_000),
        "train",
    ),
    Option("batch-size", 32, "local batch size", in_range(1, 65_536), "train"),
    Option("lr", 3e-3, "learning rate", positive, "train"),
    Option(
        "lr-decay",
        1.0,
        "learning rate factor per round: round r trains with lr * lr-decay^(r-1) (SiFT's baselines: 0.998)",
        unit_interval_open_left,
        "train",
    ),
    Option("optimizer", "adamw", "local optimizer", one_of("adamw", "adam", "sgd"), "train"),
    Option("momentum", 0.9, "SGD momentum", non_negative, "train"),
    Option("weight-decay", 0.0, "weight decay", non_negative, "train"),
    Option(
        "empty-masks",
        "skip",
        "segmentation scores of a structure an image's ground truth lacks: skip = left out of Dice, IoU and HD95 "
        "(false positives on such images are counted in empty_fp), one = Dice and IoU 1 when the prediction is "
        "empty too, else 0",
        one_of("skip", "one"),
        "train",
    ),
    Option(
        "device",
        "auto",
        "auto = cuda, then mps, then cpu; a SuperNode's node-config device (e.g. cuda:1) overrides it on that site",
        one_of("auto", "cpu", "cuda", "mps"),
        "train",
    ),
    Option(
        "precision",
        "auto",
        "forward passes and losses: auto = bf16 autocast on CUDA, float32 elsewhere; bf16 = bf16 autocast on any "
        "device; fp32 = float32 everywhere",
        one_of("auto", "bf16", "fp32"),
        "train",
    ),
    Option(
        "max-client-share",
        1.0,
        "cap of one site's share of any weighted aggregate (the excess goes to the others in proportion); 1 = no cap",
        unit_interval_open_left,
        "replies",
    ),
    Option(
        "max-weight-over-median",
        10.0,
        "with 3 or more sites, a site's aggregation weight (its count or spread) is capped at this many times the "
        "round's median weight before the shares are formed, so one site's declared size cannot take an aggregate; "
        "0 = no cap",
        non_negative,
        "replies",
    ),
    Option(
        "max-update-over-median",
        10.0,
        "with 3 or more training replies, a site's update (its reply minus what it was sent, L2 over the arrays of "
        "the same names) is scaled down to at most this many times the round's median update norm before "
        "aggregation, so one in-range reply cannot move the model by more; 0 = no bound",
        non_negative,
        "replies",
    ),
    Option(
        "reply-value-limit",
        1e6,
        "largest absolute value in the arrays of a site's reply (a reply beyond it is rejected before aggregation)",
        positive,
        "replies",
    ),
    *DP_OPTIONS,
    *DP_SGD_OPTIONS,
    *SECAGG_OPTIONS,
    *TRACKING_OPTIONS,
)
GENERIC_GROUPS = ("run", "data", "tasks", "model", "train", "replies", "privacy")
GENERIC_KEYS = frozenset(o.key for o in GENERIC_OPTIONS)


def all_options() -> tuple[Option, ...]:
    """The generic options, then every registered strategy's own, each key once (in registration order).

    The registry already refuses a key two strategies declare differently; here a strategy's key may not take a
    generic key's name."""
    options = {o.key: o for o in GENERIC_OPTIONS}
    for name, cls in STRATEGIES.items():
        for option in cls.options:
            if option.key in GENERIC_KEYS:
                raise ConfigError(f"strategy {name!r} declares run-config key {option.key!r}, a generic key")
            options[option.key] = option
    return tuple(options.values())


class ExperimentConfig(RunSettings):
    """The run config validated (``from_run_config``): the value of ``settings.py`` plus its assembly and checks."""

    __slots__ = ()

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], *, check_paths: bool = True) -> ExperimentConfig:
        """Validate a Flower run config; unknown keys are refused with the closest known key."""
        options = all_options()
        known = [o.key for o in options]
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see docs/run-config.md"
            raise ConfigError(f"run-config key '{key}' is unknown: {hint}")
        cfg = cls(
            {o.key: o.value(run_config.get(o.key, o.default)) for o in options}, {o.key: o.default for o in options}
        )
        cfg._check_cross_fields(check_paths)
        return cfg

    def _check_cross_fields(self, check_paths: bool) -> None:
        if self.val_fraction + self.test_fraction >= 1:
            raise bad(
                "test-fraction",
                self.test_fraction,
                f"val-fraction + test-fraction must be < 1 (val-fraction = {self.val_fraction})",
            )
        if self.task == "classification" and holds_masks(self.dataset):
            raise bad(
                "task",
                self.task,
                f"dataset {self.dataset!r} is a segmentation source; use task='auto' or 'segmentation'",
            )
        if self.task == "segmentation" and self.dataset != "site" and not holds_masks(self.dataset):
            raise bad(
                "task",
                self.task,
                f"dataset {self.dataset!r} has class labels, not masks; use synthetic-seg or segfolder:<root>",
            )
        method = self.strategy_class
        if self.model_task not in method.tasks:
            raise bad(
                "strategy",
                self.strategy,
                f"it trains {' or '.join(method.tasks)} models only; dataset {self.dataset!r} is {self.model_task}",
            )
        if self.backbone == "medsam" and self.backbone_weights == "auto":
            raise bad("backbone-weights", "auto", MEDSAM_AUTO)
        self._check_litemedsam()
        if self.frozen_encoder == "on" and (why := self.frozen_encoder_problem()):
            raise bad("frozen-encoder", "on", f"the mode cannot apply: {why}; use 'auto' or 'off'")
        if is_unet(self.backbone):  # a whole-network baseline: every parameter trains, LAT/SGCA share encoder stages
            if method.adapter:
                raise bad(
                    "backbone",
                    self.backbone,
                    f"strategy {self.strategy!r} builds {method.adapter!r} variants of a transformer encoder; the "
                    "U-Net baselines run under the strategies that exchange a model's named arrays (e.g. fedavg, "
                    "fedprox, local, lat, sgca)",
                )
            if self.adapter not in ("lora", "full"):
                raise bad(
                    "adapter",
                    self.adapter,
                    f"backbone {self.backbone!r} trains every parameter; leave adapter unset or set 'full'",
                )
        elif method.adapter and self.adapter not in ("lora", method.adapter):
            what = "width-reduced whole encoders" if method.adapter == "full" else "the q and k projections"
            raise bad(
                "adapter",
                self.adapter,
                f"strategy {self.strategy!r} trains adapter {method.adapter!r} ({what}); leave adapter unset",
            )
        if self.adapter == "full" and not method.trains_backbone and not is_unet(self.backbone):
            raise bad(
                "adapter",
                "full",
                f"strategy {self.strategy!r} exchanges adapters; the whole backbone trains "
                f"only with {', '.join(strategies_with('trains_backbone'))}",
            )
        tasks = {"segmentation" if holds_masks(d) else "classification" for d in self.site_dataset_list}
        if tasks and len(tasks | {self.model_task}) > 1 and not method.mixed_tasks:
            raise bad(
                "site-datasets",
                self.site_datasets,
                f"mixes tasks (the run's dataset is {self.model_task}); "
                f"only the strategies that share just the encoder ({', '.join(strategies_with('mixed_tasks'))}) "
                "can",
            )
        if len(tasks) > 1 and self.task != "auto":
            raise bad("task", self.task, "site-datasets mixes tasks: leave task='auto' (each site's data decides)")
        for dataset in self.split_datasets:
            if why := unsupported_partition(dataset, self.partition):
                raise bad("partition", self.partition, why)
        names = self.class_name_list
        if names and self.dataset != "site":
            raise bad("class-names", self.class_names, "is for dataset='site'; other sources name their classes")
        if len(set(names)) != len(names):
            raise bad("class-names", self.class_names, "lists a name twice")
        if names and self.num_classes not in (0, len(names)):
            raise bad("num-classes", self.num_classes, f"class-names lists {len(names)} classes")
        if self.dataset == "site" and self.num_classes == 0 and not names:
            raise bad(
                "num-classes",
                0,
                "dataset='site' reads data only on the sites, so the server needs num-classes > 0 or class-names",
            )
        method.check_config(self, check_paths)
        check_privacy_config(
            self,
            self.strategy,
            method.client_dp,
            method.dp_sgd,
            {mode: strategies_with_dp(mode) for mode in ("site", "server", "dp-sgd")},
            self.num_rounds,
        )
        check_secagg_config(self, self.strategy, method.secagg, strategies_with("secagg"))
        if self.local_steps and not method.local_steps:
            raise bad(
                "local-steps",
                self.local_steps,
                f"strategy {self.strategy!r} trains by its own loop, in local-epochs (or task-epochs); local-steps "
                f"works with {', '.join(strategies_with('local_steps'))}",
            )
        if self.evaluate_in_train and not method.folds_evaluation:
            raise bad(
                "evaluate-in-train",
                True,
                f"strategy {self.strategy!r} needs its own evaluate phase; it works with "
                f"{', '.join(strategies_with('folds_evaluation'))}",
            )
        if self.evaluate_in_train and self.dp_target_epsilon > 0:
            raise bad(
                "evaluate-in-train",
                True,
                f"dp-target-epsilon = {self.dp_target_epsilon:g} may stop the run before a round, which would leave "
                "the last round trained without its evaluation; leave one of them off",
            )
        if self.evaluate_in_train and self.secagg:
            raise bad(
                "evaluate-in-train",
                True,
                "with secagg a training reply carries only the masked update, no evaluation; leave one of them off",
            )
        if self.evaluate_every > 1:

            def sparse(c) -> bool:  # its round skips the evaluate phase evaluates_round says no to
                return c.run_round is FederatedStrategy.run_round or c.sparse_evaluation

            if not sparse(method):
                supported = [n for n, c in STRATEGIES.items() if sparse(c)]
                raise bad(
                    "evaluate-every",
                    self.evaluate_every,
                    f"strategy {self.strategy!r} evaluates in its own protocol (per task or phase); it works with "
                    f"{', '.join(supported)}",
                )
            if self.evaluate_in_train:
                raise bad(
                    "evaluate-every",
                    self.evaluate_every,
                    "evaluate-in-train carries every round's evaluation in the next round's training replies; leave "
                    "one of them off",
                )
            if self.dp_target_epsilon > 0:
                raise bad(
                    "evaluate-every",
                    self.evaluate_every,
                    f"dp-target-epsilon = {self.dp_target_epsilon:g} may stop the run before a round, which would "
                    "leave the last round trained without its evaluation; leave one of them off",
                )
        if self.cross_site_evaluation and method.run_round is not FederatedStrategy.run_round:
            supported = [n for n, c in STRATEGIES.items() if c.run_round is FederatedStrategy.run_round]
            raise bad(
                "cross-site-evaluation",
                True,
                f"strategy {self.strategy!r} runs a protocol of its own (phases or tasks beyond train and evaluate), "
                f"whose final evaluation is its own too; it works with {', '.join(supported)}",
            )
        if check_paths:
            self.check_data_paths()
            if self.site_registry:
                SiteRegistry.load(self.site_registry)

    def check_data_paths(self) -> None:
        """Fail early when the run config names data that is not there."""
        self._check_dataset_path("dataset", self.dataset)
        for entry in self.site_dataset_list:
            self._check_dataset_path("site-datasets", entry)

    def _check_dataset_path(self, key: str, dataset: str) -> None:
        kind, _, arg = dataset.partition(":")
        if kind == "medmnist":
            data_dir = Path(self.data_dir).expanduser()
            candidates = [data_dir / f"{arg}.npz"] + sorted(data_dir.glob(f"{arg}_*.npz"))
            if not any(p.is_file() for p in candidates):
                raise bad(
                    key,
                    dataset,
                    f"no file {candidates[0]} (data-dir = {self.data_dir!r}, absolute: {data_dir.resolve()})",
                )
        elif kind == "csv" and not Path(arg).expanduser().is_file():
            raise bad(key, dataset, f"manifest {Path(arg).expanduser().resolve()} does not exist")
        elif kind in PATH_DATASETS and kind != "csv" and not Path(arg).expanduser().is_dir():
            raise bad(key, dataset, f"folder {Path(arg).expanduser().resolve()} does not exist")

    def _check_litemedsam(self) -> None:
        """LiteMedSAM's input size, and box prompts only where SAM's mask decoder segments with labelled masks."""
        if self.backbone == "litemedsam" and (why := img_size_problem(self.img_size)):
            raise bad("img-size", self.img_size, why)
        if self.sam_prompt != "box":
            return
        if self.backbone != "litemedsam" or self.model_task != "segmentation":
            raise bad(
                "sam-prompt",
                "box",
                f"box prompts feed SAM's mask decoder: they need backbone='litemedsam' and a segmentation dataset "
                f"(backbone {self.backbone!r}, task {self.model_task!r})",
            )


def defaults() -> dict[str, Any]:
    return {o.key: o.default for o in all_options()}


def _default_text(o: Option) -> str:
    if isinstance(o.default, str):
        return repr(o.default)
    return str(o.default).lower() if isinstance(o.default, bool) else str(o.default)


def markdown_table() -> str:
    """The run-config tables of docs/run-config.md: one per group, generated from ``all_options()``."""
    groups: dict[str, list[Option]] = {}
    for o in all_options():
        groups.setdefault(o.group, []).append(o)
    sections = []
    for group, options in groups.items():
        users = [name for name, cls in STRATEGIES.items() if any(o in cls.options for o in options)]
        title = f"## {group}" + (f" (strategies: {', '.join(users)})" if group not in GENERIC_GROUPS else "")
        rows = [title, "", "| key | default | meaning |", "|---|---|---|"]
        for o in options:
            meaning = o.help + (f" ({', '.join(o.choices)})" if o.choices else "")
            rows.append(f"| `{o.key}` | `{_default_text(o)}` | {meaning.replace('|', chr(92) + '|')} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


RUN_CONFIG_DOC = Path(__file__).resolve().parent.parent / "docs" / "run-config.md"

_RUN_CONFIG_INTRO = """\
# Run config

Every key, its default and what is valid. Values are checked before any training: an unknown key, an
unknown strategy/dataset/adapter/backbone, a missing data file or a nonsensical number stops the run
with one message naming the key, the bad value and the valid choices, e.g.
`run-config 'adapter' = 'prefix' is invalid: valid choices are lora, ia3, bottleneck, none`.

Values are TOML: strings need quotes, e.g.
`flwr run . --stream --run-config "strategy='fedprox' num-rounds=10 lr=0.001"`, or put many keys in
a TOML file: `flwr run . --run-config my-experiment.toml`. Each method's page in [methods/](methods/)
explains its own keys.

This page is generated from the generic options in `medflower/config.py` and each strategy class's own
`options`: `python -m medflower.config` prints it, `python -m medflower.config --write` rewrites it. Do not edit
it by hand; `tests/test_docs.py` fails when it differs from the code.
"""


def run_config_markdown() -> str:
    """docs/run-config.md: the intro and the run-config tables, generated from the options."""
    return _RUN_CONFIG_INTRO + "\n" + markdown_table() + "\n"


if __name__ == "__main__":  # pragma: no cover - documentation helper
    if sys.argv[1:] == ["--write"]:
        RUN_CONFIG_DOC.write_text(run_config_markdown())
        sys.stdout.write(f"written: {RUN_CONFIG_DOC}\n")
    elif sys.argv[1:]:
        sys.exit("usage: python -m medflower.config [--write]  (prints docs/run-config.md; --write rewrites it)")
    else:
        sys.stdout.write(run_config_markdown())
