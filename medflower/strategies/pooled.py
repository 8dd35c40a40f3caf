"""The pooled (centralised) reference: one model trained on the union of the simulated sites' training splits.

This is the upper bound FLamby reports beside every federated result (du Terrail et al. 2022, "pooled training"):
what the sites would get if they could put their training images in one place. It is a reference for a
simulation, never a way to run a federation: the training site reads every partition's files, which a real
hospital cannot, so a site with its own node-config ``data-path`` refuses it.

Each round the first site (by partition id) trains the global model for ``local-epochs`` over the union of every
partition's training split, or with ``local-steps`` for that many steps times the number of partitions (either way
the same number of optimizer steps per round as all sites of ``fedavg`` together, with the same batch size,
optimizer and learning rate); every site then evaluates the global model on its own
validation and test splits, as for ``fedavg``. Nothing is aggregated: the trainer's reply is the model.
See docs/baselines-fedavg-like.md#pooled.
"""

from __future__ import annotations

import dataclasses

from flwr.app import Message, RecordDict
from torch.utils.data import ConcatDataset, Dataset

from ..contract import ClientHalf, FederatedStrategy, from_record, register_strategy
from ..contract.client import ClientRuntime
from ..data.errors import DataError
from ..data.transforms import target_attribute

LOADER_ATTRIBUTES = ("img_size", "encoded", "box_prompts", "augment")  # what make_loader reads from a split


def pooled_training_split(rt: ClientRuntime) -> Dataset:
    """The union of the training splits of every partition of the run's dataset, this site's first, each as its
    site's model takes it (in the frozen-encoder mode, the sites' cached encoder outputs)."""
    if rt.data_path is not None or rt.num_partitions < 2:
        raise DataError(
            "strategy 'pooled' trains on every simulated site's training images and needs the partitions of a "
            "shared dataset (node-config partition-id and num-partitions); a site with its own data-path cannot "
            "read the others' images: it is a reference for simulations, not a way to run a federation"
        )
    parts = [rt.data.train]
    for partition in range(rt.num_partitions):
        if partition != rt.partition_id:
            other = ClientRuntime(rt.cfg, rt.context, rt.config, partition, rt.num_partitions)
            parts.append(other.data.train)
    union = ConcatDataset(parts)
    # The loaders read how to batch a split from attributes it (or a dataset it wraps) carries: its size, whether
    # its items are encoder outputs (the frozen-encoder mode) or carry box prompts, and its augmentation. A
    # ConcatDataset wraps a list, which the loaders do not look through, so the union carries the site's own.
    for name in LOADER_ATTRIBUTES:
        values = {repr(target_attribute(part, name)) for part in parts}
        if len(values) > 1:
            raise DataError(f"strategy 'pooled': the sites' training splits differ in {name} ({sorted(values)})")
        if (value := target_attribute(parts[0], name)) is not None:
            setattr(union, name, value)
    return union


class PooledClient(ClientHalf):
    """Train the received model on the union of every partition's training split; evaluate on the site's own."""

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        rt.model.set_trainable(from_record(message.content["arrays"]))
        union = pooled_training_split(rt)
        # The runtime's loaders read ``rt.data``; this message's runtime trains on the union instead.
        rt.data = dataclasses.replace(rt.data, train=union)
        # As many steps as every site of a federation together: an epoch of the union, or local-steps per site
        steps = rt.cfg.local_steps * rt.num_partitions if rt.cfg.local_steps else None
        metrics = rt.train_local(max_steps=steps)
        # The server checks num-examples against what the site declared when it joined (its own split); the union's
        # size is reported apart. One reply is aggregated, so its weight does not matter.
        metrics["num-examples"] = len(rt.raw_data.train)
        metrics["pooled-examples"] = len(union)
        return self.reply(arrays=rt.model.get_trainable(), metrics=metrics)


@register_strategy
class Pooled(FederatedStrategy):
    """Pooled (centralised) training: the upper bound on what collaboration can reach (FLamby's reference).

    Leaves a site: the first site's trained arrays. It reads every partition's images, so it runs only in
    simulation; a site with its own data-path refuses it.
    """

    name = "pooled"
    client_half = PooledClient
    global_model = True
    trains_backbone = True
    contract_case = {
        "not_a_federation": "only the first site (by partition id) trains, on every partition's training split; "
        "tests/strategies/test_pooled.py checks it",
    }

    def sample_nodes(self, rnd: int) -> list[int]:
        """The first known site by partition id: it holds the pooled training split (``pooled_training_split``)."""
        return self.ordered_nodes()[:1]
