"""Typed, validated experiment configuration.

Every run-config key lives in ``OPTIONS`` (default, type, check, help). The same table
feeds ``pyproject.toml``'s defaults check, docs/run-config.md (``python -m medflower.config --write``)
and validation: a bad value stops the run before any training with one message that names
the key, the bad value and what is valid.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from .data import PARTITIONS, SOURCE_KINDS, DataSpec, describe_source
from .data.spec import ARGLESS_KINDS, SEGMENTATION_KINDS, unsupported_partition
from .data.tasks import TASK_ORDERS
from .models import ADAPTERS, BACKBONE_ALIASES, WEIGHT_MODES, ModelSpec, resolve_backbone
from .models.backbones import backbone_family


class ConfigError(ValueError):
    """A run-config value is unknown or out of range."""


def _bad(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"run-config '{key}' = {value!r} is invalid: {why}")


# ---------------------------------------------------------------------------
# Checks: each returns None when fine, else a short reason.
def positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def non_negative(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def unit_interval_open_left(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def fraction_below_one(v: float) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def one_of(*choices: str) -> Callable[[str], str | None]:
    def check(v: str) -> str | None:
        return None if v in choices else "valid choices are " + ", ".join(choices)

    check.choices = choices  # type: ignore[attr-defined]
    return check


@dataclass(frozen=True)
class Option:
    key: str
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None
    group: str = "run"
    parse: Callable[[Any], Any] | None = None  # own coercion (raises ValueError with the reason) instead of the type's

    @property
    def attr(self) -> str:
        return self.key.replace("-", "_")


# The strategy registry imports config, so the choices are filled in lazily.
def _strategy_check(v: str) -> str | None:
    from .strategies import STRATEGIES

    return None if v in STRATEGIES else "valid choices are " + ", ".join(STRATEGIES)


def _dataset_check(v: str) -> str | None:
    kind = v.split(":", 1)[0]
    valid = ("valid choices are synthetic, synthetic-seg, medmnist:<flag>, csv:<manifest.csv>, "
             "segfolder:<root>, site")
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
    if v in BACKBONE_ALIASES:
        return None
    import timm

    if v in timm.list_models():
        return None
    return "valid choices are " + ", ".join(BACKBONE_ALIASES) + " or any timm model name"


def _weights_check(v: str) -> str | None:
    if v in WEIGHT_MODES or Path(v).expanduser().is_file():
        return None
    return "valid choices are " + ", ".join(WEIGHT_MODES) + " or the path of an existing weights file"


def _parse_lat_layers(v: Any) -> int | str:
    """An integer >= 1 (also as a string) or 'all'."""
    if v == "all":
        return "all"
    if isinstance(v, bool):
        raise ValueError("must be an integer >= 1 or 'all'")
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError("must be an integer >= 1 or 'all'") from None
    if n < 1 or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("must be an integer >= 1 or 'all'")
    return n


CONTINUAL_STRATEGIES = ("fedkei",)  # strategies that walk a task stream instead of rounds
# Class-incremental strategies (docs/methods/pfedmxf.md) and the q/k adapter each one trains.
INCREMENTAL_ADAPTERS = {"pfedmxf": "fourier", "fedavg-lora": "lora-qk", "fedstack": "lora-qk"}
FEDKEI_VARIANTS = ("full", "A", "B", "C", "rand", "fedavg-init")
# Sub-model strategies (docs/methods/fedbkd.md): a width-reduced encoder per site; only the encoder is shared, so sites
# may hold different tasks (site-datasets).
SUBMODEL_STRATEGIES = ("fedbkd", "heterofl", "fedrolex", "feddrop", "submodel-fedprox", "submodel-local", "ditto")
FEDBKD_VARIANTS = ("full", "ase-only", "fco-only")
# Strategies that pick their own adapter (the run's 'adapter' must be left at its default).
STRATEGY_ADAPTERS = {**INCREMENTAL_ADAPTERS, **{s: "full" for s in SUBMODEL_STRATEGIES}}
# Strategies that can train the whole backbone (adapter='full'); the others select adapters by name.
FULL_MODEL_STRATEGIES = ("fedavg", "fedprox", "scaffold", "feddyn", "local", "sift", *SUBMODEL_STRATEGIES)
# SiFT's ablations (docs/methods/sift.md) and the head each one builds.
SIFT_HEADS = {"full": "text", "single": "text", "trainable-head": "linear", "random-head": "random",
              "trainable-proj": "text"}


def _n_frequency_list(v: Any) -> str:
    """'' or comma-separated integers >= 1 (one per partition id)."""
    text = str(v).strip()
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise ValueError("must be empty or comma-separated integers >= 1, one per partition id")
    return text


def _site_datasets(v: Any) -> str:
    """'' or comma-separated datasets, one per partition id, each a valid ``dataset`` value."""
    text = str(v).strip()
    for entry in filter(None, (e.strip() for e in text.split(","))):
        if (why := _dataset_check(entry)) or entry == "site":
            raise ValueError(f"entry {entry!r}: {why or 'site data comes from node-config data-path'}")
    return text


def _capacities(v: Any) -> str:
    """'' or comma-separated capacities in (0, 1], one per partition id."""
    text = str(v).strip()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"entry {part!r} is not a number") from None
        if not 0 < value <= 1:
            raise ValueError(f"entry {part!r} must be in (0, 1] (the share of FFN neurons a site keeps)")
    return text


def _holds_masks(dataset: str) -> bool:
    """True for a segmentation source (masks, not class labels)."""
    return dataset.split(":", 1)[0] in SEGMENTATION_KINDS


def _seed_check(v: int) -> str | None:
    return None if v >= 0 else "must be >= 0"


OPTIONS: tuple[Option, ...] = (
    # --- run
    Option("strategy", "fedavg", "federated method (see the methods table)", _strategy_check),
    Option("num-rounds", 5, "federated rounds", positive),
    Option("seed", 0, "seed of data partitioning, model init, client sampling and training", _seed_check),
    Option("fraction-train", 1.0, "fraction of connected nodes sampled for training each round", unit_interval_open_left),
    Option("min-nodes", 1, "nodes that must be connected before round 1 starts", positive),
    Option("node-wait-timeout", 120.0, "seconds to wait for min-nodes before giving up", positive),
    Option("round-timeout", 600.0, "seconds to wait for replies in one phase; late nodes are skipped", positive),
    Option("output-dir", "outputs", "where run folders go (relative paths: the ServerApp's working directory)"),
    Option("run-name", "", "run folder name; empty = <strategy>-<dataset>-<time>"),
    Option("resume-from", "", "run folder (or its checkpoint/) of a stopped run to continue"),
    # --- data
    Option("dataset", "synthetic", "synthetic | synthetic-seg | medmnist:<flag> | csv:<manifest.csv> | segfolder:<root> | site (each SuperNode's node-config data-path; needs num-classes)", _dataset_check, "data"),
    Option("task", "auto", "auto = segmentation for synthetic-seg/segfolder sources, else classification; set it for dataset='site'", one_of("auto", "classification", "segmentation"), "data"),
    Option("data-dir", "data", "folder holding <flag>.npz for medmnist sources", None, "data"),
    Option("partition", "dirichlet", "how data is split over clients", one_of(*PARTITIONS), "data"),
    Option("dirichlet-alpha", 0.5, "Dirichlet concentration of the label skew", positive, "data"),
    Option("pathological-k", 2, "classes per client for the pathological partition", positive, "data"),
    Option("val-fraction", 0.1, "per-client validation share (seeded, stratified)", fraction_below_one, "data"),
    Option("test-fraction", 0.2, "per-client test share (seeded, stratified)", fraction_below_one, "data"),
    Option("use-source-splits", True, "keep the split a source gives (MedMNIST official, csv split column)", None, "data"),
    Option("synthetic-size", 2400, "samples in the synthetic pool (all clients together)", positive, "data"),
    Option("site-datasets", "", "dataset per partition id, comma-separated (e.g. 'synthetic-seg,synthetic-seg,synthetic'); sites with the same entry split it; empty = dataset for all. Mixing segmentation and classification needs a sub-model strategy", None, "data", _site_datasets),
    Option("num-classes", 0, "classes of the head (segmentation: foreground classes); 0 = read from the data source", non_negative, "data"),
    # --- model
    Option("backbone", "vit-tiny", "timm backbone alias or timm model name", _backbone_check, "model"),
    Option("backbone-weights", "auto", "none | auto (cached timm weights, else random + warning) | file path", _weights_check, "model"),
    Option("img-size", 32, "input resolution", positive, "model"),
    Option("patch-size", 8, "ViT patch size; 0 = the backbone's own (other backbones ignore it)", non_negative, "model"),
    Option("adapter", "lora", "trainable adapter (pfedmxf trains fourier, fedavg-lora and fedstack lora-qk: q and k slices only)", one_of(*ADAPTERS), "model"),
    Option("lora-rank", 8, "LoRA rank r", positive, "model"),
    Option("lora-alpha", 16.0, "LoRA scaling alpha", positive, "model"),
    Option("adapter-targets", "", "comma-separated module names to adapt; empty = per-backbone default", None, "model"),
    Option("bottleneck-ratio", 0.25, "hidden/width ratio of bottleneck adapters", unit_interval_open_left, "model"),
    # --- training
    Option("local-epochs", 1, "local epochs per round", positive, "train"),
    Option("batch-size", 32, "local batch size", positive, "train"),
    Option("lr", 3e-3, "learning rate", positive, "train"),
    Option("lr-decay", 1.0, "learning rate factor per round: round r trains with lr * lr-decay^(r-1) (SiFT's baselines: 0.998)", unit_interval_open_left, "train"),
    Option("optimizer", "adamw", "local optimizer", one_of("adamw", "adam", "sgd"), "train"),
    Option("momentum", 0.9, "SGD momentum", non_negative, "train"),
    Option("weight-decay", 0.0, "weight decay", non_negative, "train"),
    Option("proximal-mu", 0.01, "FedProx proximal weight mu (strategy fedprox)", non_negative, "train"),
    Option("scaffold-global-lr", 1.0, "SCAFFOLD server step size eta_g (strategy scaffold; needs optimizer='sgd', momentum=0)", positive, "train"),
    Option("feddyn-alpha", 0.01, "FedDyn regulariser alpha (strategy feddyn)", positive, "train"),
    # --- SGCA (FedSCA) and LAT
    Option("lat-layers", 1, "sgca/lat: lowest adapter modules that travel (an integer, or 'all')", None, "sgca", _parse_lat_layers),
    Option("sgca-alpha", 0.8, "sgca: weight alpha of the distance term in the aggregation QP", non_negative, "sgca"),
    Option("sgca-beta", 0.01, "sgca: weight beta of the client's -cos(theta, aggregate) term", non_negative, "sgca"),
    Option("sgca-metric", "l2", "sgca: adapter distance (similarities enter as D = -sim)", one_of("l2", "l1", "cosine", "inner"), "sgca"),
    Option("sgca-distance-scale", "row-max", "sgca: how distances are made unit-free; row-max = each row divided by its largest entry, median = the whole matrix divided by the median off-diagonal distance (a site far from everyone then keeps more of its own adapter)", one_of("row-max", "median"), "sgca"),
    Option("sgca-solver", "cvxpy", "sgca: QP solver; closed-form = projection onto the simplex", one_of("cvxpy", "closed-form"), "sgca"),
    # --- continual task streams (fedkei)
    Option("num-tasks", 0, "continual runs: tasks to walk; 0 = one per class after the first of the order", non_negative, "continual"),
    Option("task-classes", "", "continual runs: class order c_0,c_1,... (names or indices); task t = c_t vs c_0..c_{t-1}; empty = the dataset's order", None, "continual"),
    Option("task-order", "sync", "continual runs: sync = every client the same order, reversed, shuffled = a seeded order per client", one_of(*TASK_ORDERS), "continual"),
    Option("task-epochs", 30, "continual runs: fine-tuning epochs per task (AUC on the task's test split after each)", positive, "continual"),
    # --- FedKEI
    Option("fedkei-variant", "full", "fedkei: full (bi-level), C (beta by plain gradient), B (clusters + alpha), A (per-client means + alpha); baselines rand, fedavg-init", one_of(*FEDKEI_VARIANTS), "fedkei"),
    Option("fedkei-k-adapter", 3, "fedkei: k-means++ clusters of the pooled adapters (K = min(K, pool size))", positive, "fedkei"),
    Option("fedkei-k-head", 3, "fedkei: k-means++ clusters of the pooled heads", positive, "fedkei"),
    Option("fedkei-eta1", 0.05, "fedkei: inner-loop SGD step on alpha (one epoch)", non_negative, "fedkei"),
    Option("fedkei-eta2", 0.05, "fedkei: outer step on beta", non_negative, "fedkei"),
    Option("fedkei-grad", "exact", "fedkei: gradient through the inner loop; exact = autograd with the Hessian term, first-order = the paper's closed form", one_of("exact", "first-order"), "fedkei"),
    # --- class-incremental runs (pfedmxf, fedavg-lora, fedstack)
    Option("classes-per-task", 2, "class-incremental runs: classes per task (task t = classes (t-1)C..tC-1 of task-classes' order); num-tasks 0 = every full group", positive, "incremental"),
    Option("rounds-per-task", 5, "class-incremental runs: federated rounds per task", positive, "incremental"),
    Option("qbli-classes", 1, "partition qbli: classes of each task a client holds (quantity-based label imbalance)", positive, "incremental"),
    Option("classifier", "aac", "class-incremental runs: aac = a head per task + prototype router, unified = one softmax over the seen classes", one_of("aac", "unified"), "incremental"),
    Option("aac-prototype", "feature-mean", "aac: the router's task prototype (mean of the task's head rows) is set to the task's mean feature after local training, or left as trained (weights: the paper taken literally; it never moves)", one_of("feature-mean", "weights"), "incremental"),
    Option("head-lr", 0.0, "class-incremental runs: learning rate of the heads (0 = lr; the paper uses 1e-3 heads, 1e-5 adapter)", non_negative, "incremental"),
    # --- pFedMxF
    Option("n-frequency", 3000, "pfedmxf: spectral coefficients per adapted matrix, client and task", positive, "pfedmxf"),
    Option("pfedmxf-n-frequency", "", "pfedmxf: per-site n-frequency by partition id, e.g. '3000,1500'; empty = n-frequency (a node-config n-frequency wins)", None, "pfedmxf", _n_frequency_list),
    Option("fourier-scale", 150.0, "pfedmxf: scale of Re(IDFT2(S)) (peft FourierFT's scaling)", positive, "pfedmxf"),
    Option("conjugate-aware", True, "pfedmxf: allocate coordinates disjoint modulo (u,v) ~ (-u,-v), so updates are exactly orthogonal; false = the paper", None, "pfedmxf"),
    Option("frequency-sharing", "disjoint", "pfedmxf: disjoint = own coordinates per (site, task); shared = one block per task for all sites (the paper's ablation)", one_of("disjoint", "shared"), "pfedmxf"),
    # --- SiFT
    Option("sift-variant", "full", "sift: full, single (no long-term model), trainable-head (a linear head, no text), random-head (frozen random W), trainable-proj", one_of(*SIFT_HEADS), "sift"),
    Option("sift-beta", 0.9, "sift: EMA factor of the long-term model, long = beta*long + (1-beta)*short", fraction_below_one, "sift"),
    Option("sift-tau", 0.07, "sift: temperature of the cosine logits cos(w_c, P f(x)) / tau", positive, "sift"),
    Option("sift-lr-first", 0.1, "sift: SGD learning rate in round 1", positive, "sift"),
    Option("sift-lr", 0.01, "sift: SGD learning rate after round 1 (momentum and weight-decay from the run config)", positive, "sift"),
    Option("sift-batch-size", 128, "sift: local batch size", positive, "sift"),
    Option("class-embeddings", "", "sift: .npy/.safetensors file with one text-embedding row per class (wins over text-encoder)", None, "sift"),
    Option("text-encoder", "", "sift: local transformers model folder (e.g. BioLinkBERT-large) that encodes class-texts; nothing is downloaded", None, "sift"),
    Option("class-texts", "", "sift: one text per class, separated by ';' (empty = the class names)", None, "sift"),
    # --- FedBKD and the sub-model baselines
    Option("fedbkd-capacities", "", "fedbkd and its sub-model baselines: share of FFN neurons each site keeps, by partition id, e.g. '0.5,0.25,0.125'; empty = 1 (a node-config capacity wins)", None, "fedbkd", _capacities),
    Option("fedbkd-lambda", 1.0, "fedbkd: weight of the alignment loss lambda*(1 - CKA(sub-encoder, global encoder))", non_negative, "fedbkd"),
    Option("fedbkd-eigen", "trace", "fedbkd: mu_k of the merge weights, from the covariance of the site's features; none = weigh by n_k (a diagnostic, not the paper's)", one_of("trace", "top", "none"), "fedbkd"),
    Option("ditto-lambda", 0.1, "ditto: weight lambda of the personal model's pull (lambda/2)*||v - w_global||^2 towards the received sub-encoder", non_negative, "fedbkd"),
    Option("fedbkd-variant", "full", "fedbkd: full, ase-only (saliency sub-models, no CKA, n_k weights), fco-only (prefix sub-models with CKA and eigenvalue weights)", one_of(*FEDBKD_VARIANTS), "fedbkd"),
    Option("device", "auto", "auto = cuda, then mps, then cpu", one_of("auto", "cpu", "cuda", "mps"), "train"),
)
OPTION_BY_KEY = {o.key: o for o in OPTIONS}


def _coerce(option: Option, value: Any) -> Any:
    """Cast a TOML value to the option's type, or raise ConfigError."""
    if option.parse is not None:
        try:
            return option.parse(value)
        except ValueError as e:
            raise _bad(option.key, value, str(e)) from None
    want = type(option.default)
    if want is bool:
        if isinstance(value, bool):
            return value
        raise _bad(option.key, value, "must be true or false")
    if want is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise _bad(option.key, value, "must be an integer")
        return int(value)
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(option.key, value, "must be a number")
        return float(value)
    if not isinstance(value, str):
        raise _bad(option.key, value, "must be a string (quote it: key='value')")
    return value


@dataclass(frozen=True)
class ExperimentConfig:
    """The validated run config; attribute names are the keys with '-' -> '_'."""

    strategy: str
    num_rounds: int
    seed: int
    fraction_train: float
    min_nodes: int
    node_wait_timeout: float
    round_timeout: float
    output_dir: str
    run_name: str
    resume_from: str
    dataset: str
    data_dir: str
    partition: str
    dirichlet_alpha: float
    pathological_k: int
    val_fraction: float
    test_fraction: float
    use_source_splits: bool
    synthetic_size: int
    site_datasets: str
    task: str
    num_classes: int
    backbone: str
    backbone_weights: str
    img_size: int
    patch_size: int
    adapter: str
    lora_rank: int
    lora_alpha: float
    adapter_targets: str
    bottleneck_ratio: float
    local_epochs: int
    batch_size: int
    lr: float
    lr_decay: float
    optimizer: str
    momentum: float
    weight_decay: float
    proximal_mu: float
    scaffold_global_lr: float
    feddyn_alpha: float
    lat_layers: int | str
    sgca_alpha: float
    sgca_beta: float
    sgca_metric: str
    sgca_distance_scale: str
    sgca_solver: str
    num_tasks: int
    task_classes: str
    task_order: str
    task_epochs: int
    fedkei_variant: str
    fedkei_k_adapter: int
    fedkei_k_head: int
    fedkei_eta1: float
    fedkei_eta2: float
    fedkei_grad: str
    classes_per_task: int
    rounds_per_task: int
    qbli_classes: int
    classifier: str
    aac_prototype: str
    head_lr: float
    n_frequency: int
    pfedmxf_n_frequency: str
    fourier_scale: float
    conjugate_aware: bool
    frequency_sharing: str
    sift_variant: str
    sift_beta: float
    sift_tau: float
    sift_lr_first: float
    sift_lr: float
    sift_batch_size: int
    class_embeddings: str
    text_encoder: str
    class_texts: str
    fedbkd_capacities: str
    fedbkd_lambda: float
    fedbkd_eigen: str
    fedbkd_variant: str
    ditto_lambda: float
    device: str

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], *, check_paths: bool = True) -> "ExperimentConfig":
        """Validate a Flower run config; unknown keys are refused with the closest known key."""
        unknown = sorted(set(run_config) - set(OPTION_BY_KEY))
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, OPTION_BY_KEY, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see docs/run-config.md"
            raise ConfigError(f"run-config key '{key}' is unknown: {hint}")
        values: dict[str, Any] = {}
        for option in OPTIONS:
            raw = run_config.get(option.key, option.default)
            value = _coerce(option, raw)
            if option.check is not None and (why := option.check(value)):
                raise _bad(option.key, value, why)
            values[option.attr] = value
        cfg = cls(**values)
        cfg._check_cross_fields(check_paths)
        return cfg

    def _check_cross_fields(self, check_paths: bool) -> None:
        if self.val_fraction + self.test_fraction >= 1:
            raise _bad("test-fraction", self.test_fraction,
                       f"val-fraction + test-fraction must be < 1 (val-fraction = {self.val_fraction})")
        if self.task == "classification" and self._masks_in_source:
            raise _bad("task", self.task, f"dataset {self.dataset!r} is a segmentation source; use task='auto' or 'segmentation'")
        if self.task == "segmentation" and self.dataset != "site" and not self._masks_in_source:
            raise _bad("task", self.task, f"dataset {self.dataset!r} has class labels, not masks; use synthetic-seg or segfolder:<root>")
        if self.strategy in CONTINUAL_STRATEGIES and self.model_task != "classification":
            raise _bad("strategy", self.strategy, "continual task streams need a classification source "
                       f"(dataset {self.dataset!r} is {self.model_task})")
        if self.strategy == "scaffold" and (self.optimizer != "sgd" or self.momentum != 0):
            raise _bad("optimizer", self.optimizer, "scaffold's control variates (option II) assume plain SGD "
                       f"steps: use optimizer='sgd' momentum=0 (momentum is {self.momentum})")
        if self.strategy in INCREMENTAL_ADAPTERS:
            if self.model_task != "classification":
                raise _bad("strategy", self.strategy, "class-incremental tasks need a classification source "
                           f"(dataset {self.dataset!r} is {self.model_task})")
            if self.task_order != "sync":
                raise _bad("task-order", self.task_order, "class-incremental tasks share one class order (sync)")
        wanted = STRATEGY_ADAPTERS.get(self.strategy)
        if wanted and self.adapter not in ("lora", wanted):
            what = "the q and k projections" if wanted != "full" else "width-reduced whole encoders"
            raise _bad("adapter", self.adapter, f"strategy {self.strategy!r} trains adapter {wanted!r} ({what}); "
                       "leave adapter unset")
        if self.adapter == "full" and self.strategy not in FULL_MODEL_STRATEGIES:
            raise _bad("adapter", "full", f"strategy {self.strategy!r} exchanges adapters; the whole backbone trains "
                       f"only with {', '.join(FULL_MODEL_STRATEGIES)}")
        if self.strategy == "sift" and self.model_task != "classification":
            raise _bad("strategy", "sift", f"SiFT's text-guided head classifies; dataset {self.dataset!r} is "
                       f"{self.model_task}")
        if self.strategy == "sift" and self.head != "linear" and not (self.class_embeddings or self.text_encoder):
            raise _bad("sift-variant", self.sift_variant, "the text-guided head needs class embeddings: set "
                       "'class-embeddings' (a .npy/.safetensors file, one row per class) or 'text-encoder' (a local "
                       "model folder); sift-variant='trainable-head' needs neither")
        tasks = {"segmentation" if _holds_masks(d) else "classification" for d in self.site_dataset_list}
        if tasks and len(tasks | {self.model_task}) > 1 and self.strategy not in SUBMODEL_STRATEGIES:
            raise _bad("site-datasets", self.site_datasets, f"mixes tasks (the run's dataset is {self.model_task}); "
                       f"only the sub-model strategies ({', '.join(SUBMODEL_STRATEGIES)}) share just the encoder")
        if len(tasks) > 1 and self.task != "auto":
            raise _bad("task", self.task, "site-datasets mixes tasks: leave task='auto' (each site's data decides)")
        for dataset in self.split_datasets:
            if why := unsupported_partition(dataset, self.partition):
                raise _bad("partition", self.partition, why)
        if self.dataset == "site" and self.num_classes == 0:
            raise _bad("num-classes", 0, "dataset='site' reads data only on the sites, so the server needs num-classes > 0")
        if check_paths:
            self.check_data_paths()

    def check_data_paths(self) -> None:
        """Fail early when the run config names data that is not there."""
        self._check_dataset_path("dataset", self.dataset)
        for entry in self.site_dataset_list:
            self._check_dataset_path("site-datasets", entry)
        if self.strategy == "sift" and self.head != "linear":
            if self.class_embeddings and not Path(self.class_embeddings).expanduser().is_file():
                raise _bad("class-embeddings", self.class_embeddings,
                           f"file {Path(self.class_embeddings).expanduser().resolve()} does not exist")
            if not self.class_embeddings and not Path(self.text_encoder).expanduser().is_dir():
                raise _bad("text-encoder", self.text_encoder,
                           f"folder {Path(self.text_encoder).expanduser().resolve()} does not exist")

    def _check_dataset_path(self, key: str, dataset: str) -> None:
        kind, _, arg = dataset.partition(":")
        if kind == "medmnist":
            data_dir = Path(self.data_dir).expanduser()
            candidates = [data_dir / f"{arg}.npz"] + sorted(data_dir.glob(f"{arg}_*.npz"))
            if not any(p.is_file() for p in candidates):
                raise _bad(key, dataset,
                           f"no file {candidates[0]} (data-dir = {self.data_dir!r}, absolute: {data_dir.resolve()})")
        elif kind == "csv" and not Path(arg).expanduser().is_file():
            raise _bad(key, dataset, f"manifest {Path(arg).expanduser().resolve()} does not exist")
        elif kind == "segfolder" and not Path(arg).expanduser().is_dir():
            raise _bad(key, dataset, f"folder {Path(arg).expanduser().resolve()} does not exist")

    @property
    def _masks_in_source(self) -> bool:
        return _holds_masks(self.dataset)

    @property
    def model_task(self) -> str:
        """The resolved task: 'segmentation' or 'classification'."""
        if self.task != "auto":
            return self.task
        return "segmentation" if self._masks_in_source else "classification"

    @property
    def head(self) -> str:
        """The classifier head the run builds: SiFT's variant decides, every other strategy has a linear head."""
        return SIFT_HEADS[self.sift_variant] if self.strategy == "sift" else "linear"

    def class_text_list(self, class_names: list[str]) -> tuple[str, ...]:
        """``class-texts`` split on ';', else the class names: what a text encoder embeds, one per class."""
        texts = tuple(t.strip() for t in self.class_texts.split(";") if t.strip())
        return texts or tuple(class_names)

    @property
    def split_datasets(self) -> list[str]:
        """The datasets the server splits over sites with ``partition`` (not 'site': each node holds its own)."""
        return [d for d in dict.fromkeys(self.site_dataset_list or [self.dataset]) if d != "site"]

    @property
    def site_dataset_list(self) -> list[str]:
        return [e.strip() for e in self.site_datasets.split(",") if e.strip()]

    def site_dataset(self, partition_id: int, num_partitions: int) -> tuple[str, int, int]:
        """(dataset, partition index, partitions) of a site: its ``site-datasets`` entry, split among the sites
        with the same entry; else ``dataset`` split over all sites."""
        entries = self.site_dataset_list
        if not entries:
            return self.dataset, partition_id, num_partitions
        if len(entries) != num_partitions:
            raise ConfigError(f"run-config 'site-datasets' lists {len(entries)} datasets for {num_partitions} "
                              f"partitions; give one per partition id")
        group = [p for p, entry in enumerate(entries) if entry == entries[partition_id]]
        return entries[partition_id], group.index(partition_id), len(group)

    @property
    def model_adapter(self) -> str:
        """The adapter the run trains: the class-incremental strategies pick their q/k adapter, the sub-model
        strategies train the whole encoder."""
        return STRATEGY_ADAPTERS.get(self.strategy, self.adapter)

    def server_class_names(self, num_classes: int) -> list[str]:
        """The class names as the server sees them: with dataset='site' they live on the sites only, so
        indices stand in for them."""
        if self.dataset == "site":
            return [str(i) for i in range(num_classes)]
        return describe_source(self.data_spec())[1]

    # ----- views for the layers
    def data_spec(self, **overrides: Any) -> DataSpec:
        fields = dict(
            dataset=self.dataset, data_dir=self.data_dir, partition=self.partition,
            dirichlet_alpha=self.dirichlet_alpha, pathological_k=self.pathological_k,
            val_fraction=self.val_fraction, test_fraction=self.test_fraction, img_size=self.img_size,
            seed=self.seed, synthetic_size=self.synthetic_size, use_source_splits=self.use_source_splits,
            qbli_classes=self.qbli_classes, task_classes=self.task_classes, classes_per_task=self.classes_per_task,
        )
        return DataSpec(**{**fields, **overrides})

    def model_spec(self, class_names: list[str] | None = None) -> ModelSpec:
        """The run's ModelSpec; a cosine head encoding texts needs the class names (``class-texts`` unset)."""
        targets = tuple(t.strip() for t in self.adapter_targets.split(",") if t.strip())
        head: dict[str, Any] = {}
        if self.head != "linear":
            head = dict(head=self.head, class_embeddings=self.class_embeddings, head_tau=self.sift_tau,
                        text_encoder="" if self.class_embeddings else self.text_encoder,
                        class_texts=() if self.class_embeddings else self.class_text_list(class_names or []),
                        train_projector=self.sift_variant == "trainable-proj")
        return ModelSpec(
            backbone=self.backbone, adapter=self.model_adapter,
            n_frequency=self.n_frequency, fourier_scale=self.fourier_scale, img_size=self.img_size,
            patch_size=self.patch_size if backbone_family(resolve_backbone(self.backbone)) == "vit" else 0,
            weights=self.backbone_weights, lora_rank=self.lora_rank, lora_alpha=self.lora_alpha,
            adapter_targets=targets, bottleneck_ratio=self.bottleneck_ratio, seed=self.seed, task=self.model_task,
            **head,
        )

    def to_dict(self) -> dict[str, Any]:
        return {o.key: getattr(self, o.attr) for o in OPTIONS}

    def fingerprint(self) -> dict[str, Any]:
        """What must not change when a run resumes (everything but the length and paths)."""
        loose = {"num-rounds", "num-tasks", "resume-from", "output-dir", "run-name", "round-timeout",
                 "node-wait-timeout", "min-nodes", "device", "data-dir"}
        return {k: v for k, v in self.to_dict().items() if k not in loose}


def defaults() -> dict[str, Any]:
    return {o.key: o.default for o in OPTIONS}


def markdown_table() -> str:
    """The run-config table of docs/run-config.md, generated from OPTIONS."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for o in OPTIONS:
        default = repr(o.default) if isinstance(o.default, str) else str(o.default).lower() if isinstance(o.default, bool) else o.default
        choices = getattr(o.check, "choices", None)
        meaning = (o.help + (f" ({', '.join(choices)})" if choices else "")).replace("|", "\\|")  # a bare | splits the cell
        rows.append(f"| `{o.key}` | `{default}` | {meaning} |")
    return "\n".join(rows)


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

This page is generated from `medflower/config.py` (`OPTIONS`): `python -m medflower.config` prints it,
`python -m medflower.config --write` rewrites it. Do not edit it by hand; `tests/test_docs.py` fails when
it differs from the code.
"""


def run_config_markdown() -> str:
    """docs/run-config.md: the intro and the run-config table, generated from OPTIONS."""
    return _RUN_CONFIG_INTRO + "\n" + markdown_table() + "\n"


_SAFE_RUN_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(text: str) -> str:
    return _SAFE_RUN_NAME.sub("-", text).strip("-")


if __name__ == "__main__":  # pragma: no cover - documentation helper
    if sys.argv[1:] == ["--write"]:
        RUN_CONFIG_DOC.write_text(run_config_markdown())
        sys.stdout.write(f"written: {RUN_CONFIG_DOC}\n")
    elif sys.argv[1:]:
        sys.exit("usage: python -m medflower.config [--write]  (prints docs/run-config.md; --write rewrites it)")
    else:
        sys.stdout.write(run_config_markdown())
