"""The run config as a value: ``RunSettings``, read-only, ``cfg.<key with '-' -> '_'>`` for every option, and the
views the layers read (the data and model specs, a site's dataset, the resume fingerprint).

The contract and the methods read this value; they never build one. ``medflower/config.py`` builds it: it declares
every run-config key, validates a Flower run config and checks the fields against each other and against the
strategy (its ``ExperimentConfig`` is this value plus that assembly). This module imports no strategy: the
strategy class comes from the registry, filled by whoever imported the methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .contract.registry import STRATEGIES
from .data import DataSpec, describe_source
from .data.spec import SEGMENTATION_KINDS
from .models import ModelSpec, resolve_backbone
from .models.backbones import backbone_family
from .models.spec import ADAPTER as UNET_ADAPTER
from .models.spec import is_unet
from .options import ConfigError
from .tracking import TRACKING_KEYS


def holds_masks(dataset: str) -> bool:
    """True for a segmentation source (masks, not class labels)."""
    return dataset.split(":", 1)[0] in SEGMENTATION_KINDS


class RunSettings:
    """The validated run config, read-only: ``cfg.<key with '-' -> '_'>`` for every option the assembly declared."""

    __slots__ = ("_defaults", "_values")

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any] | None = None):
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))
        object.__setattr__(self, "_defaults", MappingProxyType(dict(defaults or {})))

    def __getattr__(self, attr: str) -> Any:
        if not attr.startswith("_"):
            try:
                return self._values[attr.replace("_", "-")]
            except KeyError:
                pass
        raise AttributeError(f"the run config has no option {attr.replace('_', '-')!r}")

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError("ExperimentConfig is read-only; build a new one with from_run_config")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunSettings) and dict(self._values) == dict(other._values)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __reduce__(self):
        return type(self), (dict(self._values), dict(self._defaults))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self._values)!r})"

    @property
    def strategy_class(self) -> Any:
        return STRATEGIES[self.strategy]

    @property
    def model_task(self) -> str:
        """The resolved task: 'segmentation' or 'classification'."""
        if self.task != "auto":
            return self.task
        return "segmentation" if holds_masks(self.dataset) else "classification"

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
            raise ConfigError(
                f"run-config 'site-datasets' lists {len(entries)} datasets for {num_partitions} "
                f"partitions; give one per partition id"
            )
        group = [p for p, entry in enumerate(entries) if entry == entries[partition_id]]
        return entries[partition_id], group.index(partition_id), len(group)

    @property
    def class_name_list(self) -> list[str]:
        """``class-names`` as a list (empty when unset)."""
        return [n.strip() for n in self.class_names.split(",") if n.strip()]

    @property
    def declared_num_classes(self) -> int:
        """The classes the run config declares: num-classes, else the length of class-names (only with dataset='site');
        0 = read them from the source."""
        return self.num_classes or len(self.class_name_list)

    def server_class_names(self, num_classes: int) -> list[str]:
        """The class names as the server sees them: with dataset='site', class-names, else indices (the names
        live on the sites only)."""
        if self.dataset == "site":
            return self.class_name_list or [str(i) for i in range(num_classes)]
        return describe_source(self.data_spec())[1]

    # ----- views for the layers
    def data_spec(self, **overrides: Any) -> DataSpec:
        fields = dict(
            dataset=self.dataset,
            data_dir=self.data_dir,
            partition=self.partition,
            dirichlet_alpha=self.dirichlet_alpha,
            pathological_k=self.pathological_k,
            val_fraction=self.val_fraction,
            test_fraction=self.test_fraction,
            img_size=self.img_size,
            seed=self.seed,
            synthetic_size=self.synthetic_size,
            use_source_splits=self.use_source_splits,
            intensity=self.intensity,
            slice_axis=self.slice_axis,
            empty_slices=self.empty_slices,
            mask_values=self.mask_values,
            augment=self.augment,
            split_limit=self.split_limit,
            qbli_classes=self.qbli_classes,
            task_classes=self.task_classes,
            classes_per_task=self.classes_per_task,
        )
        return DataSpec(**{**fields, **overrides})

    def model_spec(self, class_names: list[str] | None = None) -> ModelSpec:
        """The run's ModelSpec: the run config's backbone and adapter settings, then the fields the strategy
        decides (its adapter, its head; a head encoding class texts needs the class names)."""
        targets = tuple(t.strip() for t in self.adapter_targets.split(",") if t.strip())
        unet = is_unet(self.backbone)  # a U-Net baseline (models/unet.py): no timm name, no patches, adapter 'full'
        fields: dict[str, Any] = dict(
            backbone=self.backbone,
            # the run config's default adapter ('lora') means unset; any other adapter is refused by ModelSpec
            adapter=UNET_ADAPTER if unet and self.adapter == "lora" else self.adapter,
            img_size=self.img_size,
            patch_size=self.patch_size if not unet and backbone_family(resolve_backbone(self.backbone)) == "vit" else 0,
            weights=self.backbone_weights,
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            adapter_targets=targets,
            bottleneck_ratio=self.bottleneck_ratio,
            seed=self.seed,
            task=self.model_task,
            sam_prompt=self.sam_prompt if self.model_task == "segmentation" else "whole-image",
            input_norm=self.input_norm,
        )
        fields.update(self.strategy_class.model_fields(self, class_names or []))
        fields["encoded_inputs"] = self.frozen_encoder_problem(fields["adapter"]) is None
        return ModelSpec(**fields)

    def frozen_encoder_problem(self, adapter: str | None = None) -> str | None:
        """Why the frozen-encoder mode does not apply to this run (None: it does; docs/models.md#frozen-encoder-mode).
        ``adapter``: the model's (a strategy may fix its own)."""
        adapter = adapter or self.strategy_class.model_fields(self, []).get("adapter", self.adapter)
        if self.frozen_encoder == "off":
            return "frozen-encoder='off'"
        if is_unet(self.backbone) or adapter != "none":
            return (
                f"adapter {adapter!r} trains inside the encoder (the mode needs adapter='none': head or decoder only)"
            )
        if self.augment:
            return f"augment={self.augment!r} changes the images every step"
        if self.strategy_class.reads_pixels:
            return f"strategy {self.strategy!r} computes on the images themselves"
        return None

    @property
    def frozen_encoder_mode(self) -> str:
        """'on' or 'off': what the run does (run config ``frozen-encoder`` resolved)."""
        return "off" if self.frozen_encoder_problem() else "on"

    def defaults(self) -> dict[str, Any]:
        """Every option's default, as the run-config assembly that built this value declared them (a key a resumed
        checkpoint lacks had its default then)."""
        return dict(self._defaults)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def fingerprint(self) -> dict[str, Any]:
        """What must not change when a run resumes (everything but the length and paths)."""
        loose = {
            "num-rounds",
            "num-tasks",
            "resume-from",
            "output-dir",
            "run-name",
            "round-timeout",
            "node-wait-timeout",
            "min-nodes",
            "device",
            "precision",
            "data-dir",
            "overwrite",
            "keep-checkpoints",
            "site-registry",
            "run-figures",
            "site-figures",
            "cross-site-evaluation",  # only what happens after the last round: a finished run may be resumed for it
            *TRACKING_KEYS,
        }
        return {k: v for k, v in self.to_dict().items() if k not in loose}
