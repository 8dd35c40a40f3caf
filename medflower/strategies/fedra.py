"""FedRA (Su, Li, Xue, "FedRA: A Random Allocation Strategy for Federated Tuning to Unleash the Power of
Heterogeneous Clients", ECCV 2024), as the authors' code (github.com/leondada/FedRA, ``Server.get_para_range``,
``Server.agg_range_fill``) runs it.

Each round the server draws a random allocation matrix A (sites × layers): site i gets c_i of the model's L
transformer layers, drawn without replacement (a fresh draw per site and round, seeded by the run's seed, the round
and the site's partition id). c_i is the site's capacity: node-config ``fedra-layers``, else run-config
``fedra-layers`` by partition id (the reference's 12,10,8,6,4,3 by default), else every layer. The site fine-tunes the
adapters of its allocated layers and the shared arrays (the head or decoder, and any adapter outside a numbered
block) on a shallower encoder: its allocated layers in depth order, the others skipped (the reference builds a
``depth = c_i`` ViT from them). The server then takes, per layer, the n_k-weighted mean over the sites allocated that
layer; a layer no valid reply covered keeps its value; the shared arrays are averaged over every reply, as in FedAvg.
The method as implemented and its decisions: docs/methods/baselines-fedavg-like.md#fedra.

A layer is the transformer block an adapter module sits in (``backbone.blocks.3.adapter_attn`` and
``backbone.blocks.3.adapter_mlp`` form layer ``backbone.blocks.3``), layers in depth order (``adapter_modules``).

What leaves a site: the adapters of its allocated layers and the shared arrays (head or decoder) after local
training, n_k and its layer count c_i (in its query). What comes to it: the same arrays of the global model and its
allocation (with run-config evaluate-in-train, the whole global model, which it evaluates first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from torch import nn

from ..contract import (
    ArraySpec,
    ClientHalf,
    FederatedStrategy,
    Reply,
    derive_seed,
    from_record,
    register_strategy,
    to_record,
    weighted_mean,
)
from ..models import adapter_modules
from ..options import Option, bad

ALLOCATION = "fedra-allocation"  # config key of a training message: the site's allocated layer indices
LAYERS = "fedra-layers"  # node-config key and query metric: the site's layer count c_i
FEDRA_SEED = 41  # seed purpose of the allocation draw


def parse_layer_counts(value: Any) -> str:
    """'' or comma-separated layer counts (integers >= 1), one per partition id."""
    text = str(value).strip()
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"entry {part!r} is not a layer count (an integer >= 1)")
    return text


def layer_counts(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


OPTIONS = (
    Option(
        LAYERS,
        "12,10,8,6,4,3",
        "fedra: how many transformer layers each site fine-tunes per round, by partition id (the reference's "
        "12,10,8,6,4,3); empty = every layer (a node-config fedra-layers wins)",
        None,
        "fedra",
        parse_layer_counts,
    ),
)


# ----------------------------------------------------------------------------- layers
def adapter_layers(names: Iterable[str]) -> OrderedDict[str, list[str]]:
    """Layer -> its adapter parameter names, layers in depth order. An adapter module's layer is its name up to its
    last numbered part (``backbone.blocks.3.attn.qkv`` -> ``backbone.blocks.3``); modules outside any numbered
    part belong to no layer (they are shared, like the head)."""
    layers: OrderedDict[str, list[str]] = OrderedDict()
    for module, params in adapter_modules(names).items():
        parts = module.split(".")
        numbered = [i for i, part in enumerate(parts) if part.isdigit()]
        if numbered:
            layers.setdefault(".".join(parts[: numbered[-1] + 1]), []).extend(params)
    return layers


def allocated_names(names: Iterable[str], layers: Mapping[str, list[str]], allocation: Iterable[int]) -> list[str]:
    """The arrays a site with ``allocation`` (layer indices) exchanges, in ``names``' order: its layers' adapters and
    every array outside all layers."""
    names = list(names)
    groups = list(layers.values())
    in_layers = {n for group in groups for n in group}
    keep = {n for i in allocation for n in groups[i]} | {n for n in names if n not in in_layers}
    return [n for n in names if n in keep]


def draw_allocation(seed: int, rnd: int, partition_id: int, count: int, num_layers: int) -> list[int]:
    """Row i of the round's allocation matrix: ``count`` of ``num_layers`` layer indices drawn without replacement
    (the reference's ``np.random.choice(12, c_i, replace=False)``), sorted."""
    rng = np.random.default_rng(derive_seed(seed, rnd, partition_id, FEDRA_SEED))
    return sorted(int(i) for i in rng.choice(num_layers, size=count, replace=False))


def layerwise_mean(
    global_arrays: Mapping[str, np.ndarray], replies: list[Mapping[str, np.ndarray]], shares: Iterable[float]
) -> tuple[OrderedDict[str, np.ndarray], list[str]]:
    """Each array: the mean of the replies that carry it, weighted by their ``shares`` renormalised over them; an
    array no reply carries keeps its value (returned second). The reference's ``agg_range_fill`` per layer."""
    shares = list(shares)
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    untouched = []
    for name, value in global_arrays.items():
        covering = [i for i, r in enumerate(replies) if name in r]
        if not covering:
            out[name] = value
            untouched.append(name)
            continue
        out[name] = weighted_mean([{name: replies[i][name]} for i in covering], [shares[i] for i in covering])[name]
    return out, untouched


def _skip(x, *args, **kwargs):
    """A skipped layer's forward: its input, unchanged (as if the block were not in the stack)."""
    return x


@contextmanager
def skipped_layers(model: nn.Module, layers: Iterable[str]) -> Iterator[None]:
    """The model with the transformer blocks ``layers`` left out of the forward pass and their parameters frozen: the
    reference's shallower sub-model of the allocated blocks in depth order. Restored on exit (the site's model
    object is shared between messages)."""
    blocks = []
    for layer in layers:
        block = model.get_submodule(layer)
        if not all(isinstance(getattr(block, part, None), nn.Module) for part in ("attn", "mlp")):
            raise ValueError(
                f"fedra skips whole transformer blocks, but adapter layer {layer!r} is a {type(block).__name__}: "
                "put the adapters inside the encoder's blocks (adapter-targets)"
            )
        blocks.append(block)
    frozen = [p for block in blocks for p in block.parameters() if p.requires_grad]
    try:
        for block in blocks:
            block.forward = _skip  # an instance attribute: nn.Module.__call__ runs it instead of the class's forward
        for p in frozen:
            p.requires_grad_(False)
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)
        for p in frozen:
            p.requires_grad_(True)


# ----------------------------------------------------------------------------- client half
def site_layer_count(rt, num_layers: int) -> int:
    """c_i: node-config ``fedra-layers``, else run-config ``fedra-layers`` by partition id, else every layer."""
    node = rt.context.node_config
    if node.get(LAYERS) is not None:
        raw, source = node[LAYERS], f"node-config '{LAYERS}'"
        if not str(raw).strip().isdigit():
            raise ValueError(f"{source} = {raw!r}: a layer count (an integer >= 1)")
        count = int(str(raw).strip())
    else:
        listed, source = layer_counts(rt.cfg.fedra_layers), f"run-config '{LAYERS}'"
        if not listed:
            return num_layers
        if rt.partition_id >= len(listed):
            raise ValueError(
                f"{source} lists {len(listed)} layer counts but this site is partition {rt.partition_id}; give one "
                f"per partition id or set node-config {LAYERS}"
            )
        count = listed[rt.partition_id]
    if not 1 <= count <= num_layers:
        raise ValueError(f"{source} gives this site {count} layers; the model has {num_layers}")
    return count


class FedRAClient(ClientHalf):
    """Trains the received adapters of its allocated layers and the shared arrays, with every other layer skipped;
    sends those arrays back. Its evaluation: the whole global model (the default ``evaluate``)."""

    def layers(self) -> OrderedDict[str, list[str]]:
        return adapter_layers(self.rt.model.trainable_names())

    def query(self, message: Message) -> RecordDict:
        content = super().query(message)
        content["metrics"][LAYERS] = float(site_layer_count(self.rt, len(self.layers())))
        return content

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        layers = self.layers()
        names = rt.model.trainable_names()
        allocation = [int(i) for i in rt.config.get(ALLOCATION, [])]
        count = site_layer_count(rt, len(layers))
        distinct = len(set(allocation)) == len(allocation) > 0
        if not distinct or not all(0 <= i < len(layers) for i in allocation):
            raise ValueError(f"{ALLOCATION} {allocation} is not a set of distinct layer indices below {len(layers)}")
        if len(allocation) > count:
            raise ValueError(f"allocated {len(allocation)} layers; this site fine-tunes at most {count}")
        exchanged = allocated_names(names, layers, allocation)
        received = from_record(message.content["arrays"])
        if list(received) not in (exchanged, names):  # its sub-model, or the whole model with evaluate-in-train
            raise ValueError(f"received arrays {list(received)[:3]}... are not this site's allocated sub-model")
        rt.model.set_trainable(rt.initial_arrays)
        rt.model.set_trainable(received, strict=False)
        skipped = [layer for i, layer in enumerate(layers) if i not in set(allocation)]
        with skipped_layers(rt.model, skipped):
            metrics = rt.train_local()
        trained = rt.model.get_trainable()
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(arrays=OrderedDict((k, trained[k]) for k in exchanged), metrics=metrics)


# ----------------------------------------------------------------------------- server half
@register_strategy
class FedRA(FederatedStrategy):
    """FedRA (Su, Li, Xue, ECCV 2024; reference code): each round a random allocation matrix gives site i c_i of the
    L transformer layers; it fine-tunes their adapters (and the head/decoder) on the shallower encoder of those
    layers; the server averages each layer's adapters over the sites allocated it (n_k weights; a layer nobody
    trained keeps its value) and the head/decoder over every site.

    Leaves a site: the adapters of its allocated layers and the head/decoder after local training, n_k, and c_i.
    """

    name = "fedra"
    contract_case = {
        "config": {LAYERS: "6,4,3"},
        "why": "three capacities that fit the contract suites' 6-block test ViT (the default 12,10,8,6,4,3 needs 12)",
    }
    global_model = True
    client_half = FedRAClient
    folds_evaluation = True  # the default round; with evaluate-in-train the training message carries the whole model
    options = OPTIONS

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        self.layers = adapter_layers(initial)
        if not self.layers:
            raise bad("adapter", self.cfg.adapter, "fedra allocates the adapters of transformer layers; none found")
        too_many = [c for c in layer_counts(self.cfg.fedra_layers) if c > len(self.layers)]
        if too_many:
            raise bad(LAYERS, self.cfg.fedra_layers, f"the model has {len(self.layers)} layers, not {too_many[0]}")
        self.exchanged: dict[int, list[str]] = {}  # node -> the arrays sent to it this round

    # ------------------------------------------------------------------ allocation
    def layer_count(self, node_id: int) -> int:
        return int(self.nodes[node_id].extra[LAYERS])

    def allocation(self, rnd: int, node_id: int) -> list[int]:
        node = self.nodes[node_id]
        return draw_allocation(self.cfg.seed, rnd, node.partition_id, self.layer_count(node_id), len(self.layers))

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        allocation = self.allocation(rnd, node_id)
        self.exchanged[node_id] = allocated_names(self.global_arrays, self.layers, allocation)
        self.stats.extra.setdefault("fedra_allocation", {})[self.client_name(node_id)] = allocation
        if self.evaluates_in_train(rnd):  # the site evaluates the previous round's global model first
            arrays = self.global_arrays
        else:
            arrays = OrderedDict((k, self.global_arrays[k]) for k in self.exchanged[node_id])
        return RecordDict({"arrays": to_record(arrays), "config": self.base_config(rnd, **{ALLOCATION: allocation})})

    def reply_spec(self, node_id: int) -> ArraySpec:
        return OrderedDict((k, self.spec[k]) for k in self.exchanged[node_id])

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        """A query declares c_i (``fedra-layers``), an integer in 1..L."""
        if problem := super().check_reply_values(phase, reply):
            return problem
        if phase == "query":
            count = reply.metrics.get(LAYERS)
            if count is None:
                return f"a fedra query reply must declare {LAYERS}"
            if not (float(count).is_integer() and 1 <= count <= len(self.layers)):
                return f"{LAYERS} must be an integer in 1..{len(self.layers)} (the model's layers), got {count}"
        return None

    # ------------------------------------------------------------------ aggregation
    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        """Per array, the n_k-weighted mean over the replies that carry it (capped at max-client-share within the
        round); a layer no reply covered keeps its value."""
        shares = self.shares([r.num_examples for r in replies])
        self.global_arrays, untouched = layerwise_mean(self.global_arrays, [r.arrays for r in replies], shares)
        untouched = set(untouched)
        self.stats.extra["fedra_untrained_layers"] = [
            i for i, group in enumerate(self.layers.values()) if set(group) <= untouched
        ]
