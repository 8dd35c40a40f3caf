"""SiFT (docs/methods/sift.md): serial federated learning with a short-term model, an EMA long-term model and a
frozen text-embedding classifier head.

Server half (``SiFT``): a seeded cyclic order of the sites (by partition id, fixed at round 1; sites that join
later are appended). A round sends the pair (short-term θ_s, long-term θ_l) to the first site of the order,
waits for its reply, sends the reply's pair to the next site, and so on: every site trains exactly once per
round, the pair passes from site to site through the SuperLink, and the server only relays and records (no
aggregation). A site that fails or sends an invalid pair is skipped and the pair it received goes to the next
one. After every hop the pair, the order and the position in the round are checkpointed, so ``resume-from``
continues mid-round exactly where the run stopped. After the round every site evaluates the long-term model and
the server sums the sites' test confusion counts into ``pooled_balanced_accuracy``: balanced accuracy on the union
of the test splits, the metric the paper reports (beside the mean over sites).

Client half (``SiFTClient``): ``local-epochs`` epochs of SGD on θ_s with cross-entropy on
``cos(w_c, P·F(x))/τ`` (``sift-lr-first`` in round 1, ``sift-lr`` after, ``sift-batch-size``; momentum and
weight decay from the run config), then θ_l ← β·θ_l + (1−β)·θ_s over every exchanged array, BatchNorm
running statistics included (the paper's Eq. 2).

The head's W (class text embeddings) and P (random projector from the run seed) are rebuilt on every site and
never travel, unless ``sift-variant='trainable-proj'`` (P trains and travels with the pair) or
``'trainable-head'`` (a plain linear head that travels). ``'single'`` has no long-term model: the short-term
model travels alone and is evaluated.

What leaves a site: the pair (θ_s, θ_l) after its local training (with a fully trained backbone: every
backbone parameter and BatchNorm statistic), plus n_k and the training loss; evaluation metrics, with the test
split's C×C confusion counts (``confusion``, integers; no per-sample output).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..contract import ClientHalf, FederatedStrategy, derive_seed, from_record, register_strategy, to_record
from ..options import Option, bad, fraction_below_one, one_of, positive
from ..training import OptimizerSpec

SHORT, LONG = "short/", "long/"
# SiFT's ablations (docs/methods/sift.md) and the head each one builds.
HEADS = {
    "full": "text",
    "single": "text",
    "trainable-head": "linear",
    "random-head": "random",
    "trainable-proj": "text",
}
OPTIONS = (
    Option(
        "sift-variant",
        "full",
        "sift: full, single (no long-term model), trainable-head (a linear head, no "
        "text), random-head (frozen random W), trainable-proj",
        one_of(*HEADS),
        "sift",
    ),
    Option(
        "sift-beta",
        0.9,
        "sift: EMA factor of the long-term model, long = beta*long + (1-beta)*short",
        fraction_below_one,
        "sift",
    ),
    Option("sift-tau", 0.07, "sift: temperature of the cosine logits cos(w_c, P f(x)) / tau", positive, "sift"),
    Option("sift-lr-first", 0.1, "sift: SGD learning rate in round 1", positive, "sift"),
    Option(
        "sift-lr",
        0.01,
        "sift: SGD learning rate after round 1 (momentum and weight-decay from the run config)",
        positive,
        "sift",
    ),
    Option("sift-batch-size", 128, "sift: local batch size", positive, "sift"),
    Option(
        "class-embeddings",
        "",
        "sift: .npy/.safetensors file with one text-embedding row per class (wins over text-encoder)",
        None,
        "sift",
    ),
    Option(
        "text-encoder",
        "",
        "sift: local transformers model folder (e.g. BioLinkBERT-large) that encodes "
        "class-texts; nothing is downloaded",
        None,
        "sift",
    ),
    Option("class-texts", "", "sift: one text per class, separated by ';' (empty = the class names)", None, "sift"),
)


def class_text_list(cfg, class_names: list[str]) -> tuple[str, ...]:
    """``class-texts`` split on ';', else the class names: what a text encoder embeds, one per class."""
    texts = tuple(t.strip() for t in cfg.class_texts.split(";") if t.strip())
    return texts or tuple(class_names)


def ema_update(
    long: Mapping[str, np.ndarray], short: Mapping[str, np.ndarray], beta: float
) -> OrderedDict[str, np.ndarray]:
    """θ_l ← β·θ_l + (1−β)·θ_s (SiFT Eq. 2) for every array, computed in float64, returned in float32."""
    return OrderedDict(
        (k, (beta * long[k].astype(np.float64) + (1.0 - beta) * short[k].astype(np.float64)).astype(np.float32))
        for k in long
    )


def split_pair(arrays: Mapping[str, np.ndarray]) -> tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray]]:
    """(short-term, long-term) arrays with their prefixes removed; the long-term part is empty for 'single'."""
    short = OrderedDict((k[len(SHORT) :], v) for k, v in arrays.items() if k.startswith(SHORT))
    long = OrderedDict((k[len(LONG) :], v) for k, v in arrays.items() if k.startswith(LONG))
    return short, long


def join_pair(short: Mapping[str, np.ndarray], long: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    return OrderedDict([*((SHORT + k, v) for k, v in short.items()), *((LONG + k, v) for k, v in long.items())])


class SiFTClient(ClientHalf):
    """Train the received short-term model, fold it into the long-term model by EMA, send the pair on."""

    def train(self, message: Message) -> RecordDict:
        rt, cfg = self.rt, self.rt.cfg
        short, long = split_pair(from_record(message.content["arrays"]))
        rt.model.set_trainable(short)
        lr = cfg.sift_lr_first if rt.round == 1 else cfg.sift_lr
        optimizer = OptimizerSpec("sgd", lr, cfg.momentum, cfg.weight_decay)
        metrics = rt.train_local(optimizer=optimizer, batch_size=cfg.sift_batch_size)
        short = rt.model.get_trainable()
        if long:
            long = ema_update(long, short, cfg.sift_beta)
        metrics.update({"num-examples": len(rt.data.train), "lr": lr})
        return self.reply(arrays=join_pair(short, long), metrics=metrics)


@register_strategy
class SiFT(FederatedStrategy):
    """Serial training: the pair visits every site once per round in a seeded cyclic order; no aggregation.

    Leaves a site: the pair (θ_s, θ_l) after its local training, n_k.
    """

    name = "sift"
    contract_case = {
        "config": {"sift-variant": "trainable-head", "sift-batch-size": 32, "sift-lr-first": 0.05, "sift-lr": 0.01},
        "why": "'trainable-head': a linear head needs no class embeddings",
    }
    client_half = SiFTClient
    options = OPTIONS
    client_dp = ("site",)  # each hop of the relay sends on a noised update of the pair it received
    tasks = ("classification",)  # the text-guided head classifies
    trains_backbone = True
    sparse_evaluation = True  # run_round evaluates the rounds evaluates_round names (run-config evaluate-every)

    @classmethod
    def model_fields(cls, cfg, class_names: list[str]) -> dict[str, Any]:
        """The head of the variant: a linear one, or the cosine head over class text embeddings."""
        head = HEADS[cfg.sift_variant]
        if head == "linear":
            return {}
        return dict(
            head=head,
            class_embeddings=cfg.class_embeddings,
            head_tau=cfg.sift_tau,
            text_encoder="" if cfg.class_embeddings else cfg.text_encoder,
            class_texts=() if cfg.class_embeddings else class_text_list(cfg, class_names),
            train_projector=cfg.sift_variant == "trainable-proj",
        )

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        if HEADS[cfg.sift_variant] == "linear":
            return
        if not (cfg.class_embeddings or cfg.text_encoder):
            raise bad(
                "sift-variant",
                cfg.sift_variant,
                "the text-guided head needs class embeddings: set "
                "'class-embeddings' (a .npy/.safetensors file, one row per class) or 'text-encoder' (a local "
                "model folder); sift-variant='trainable-head' needs neither",
            )
        if not check_paths:
            return
        if cfg.class_embeddings and not Path(cfg.class_embeddings).expanduser().is_file():
            raise bad(
                "class-embeddings",
                cfg.class_embeddings,
                f"file {Path(cfg.class_embeddings).expanduser().resolve()} does not exist",
            )
        if not cfg.class_embeddings and not Path(cfg.text_encoder).expanduser().is_dir():
            raise bad(
                "text-encoder",
                cfg.text_encoder,
                f"folder {Path(cfg.text_encoder).expanduser().resolve()} does not exist",
            )

    def server_arrays(self, initial: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The pair (θ_s, θ_l), both the initial model; the short-term one alone for 'single'."""
        return join_pair(initial, {} if self.cfg.sift_variant == "single" else initial)

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        self.order: list[int] = []  # partition ids, the cyclic order
        self.position = 0  # hops done in the round in progress (checkpointed mid-round)
        self.partial: list[dict[str, Any]] = []  # that round's hops so far: client, metrics, bytes, failures

    # ------------------------------------------------------------------ order and persistence
    def cyclic_order(self) -> list[int]:
        """The seeded order of partition ids, fixed at the first round; sites seen later are appended."""
        known = sorted({info.partition_id for info in self.nodes.values()})
        if not self.order:
            rng = np.random.default_rng(derive_seed(self.cfg.seed, 23))
            self.order = [known[i] for i in rng.permutation(len(known))]
            log(INFO, "[medflower] sift: cyclic order of partitions %s", self.order)
        added = [p for p in known if p not in self.order]
        if added:
            log(INFO, "[medflower] sift: partitions %s joined; they train last in each round", added)
            self.order.extend(added)
        return self.order

    def inference_arrays(self) -> OrderedDict[str, np.ndarray]:
        """The model sites evaluate: the long-term model (the short-term one for 'single')."""
        short, long = split_pair(self.global_arrays)
        return long or short

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        return self.global_arrays, {"order": self.order, "position": self.position, "partial": self.partial}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state(arrays, meta)
        self.order = [int(p) for p in meta.get("order", [])]
        self.position = int(meta.get("position", 0))
        self.partial = list(meta.get("partial", []))
        if self.position:
            log(
                INFO,
                "[medflower] sift: resuming round %d after hop %d of %d",
                self.completed_rounds + 1,
                self.position,
                len(self.order),
            )

    # ------------------------------------------------------------------ protocol
    def run_round(self, grid: Grid, rnd: int) -> None:
        node_of = {info.partition_id: node_id for node_id, info in self.nodes.items()}
        order = self.cyclic_order()
        for hop in self.partial:  # hops done before a resume: their records and bytes belong to this round
            if hop["metrics"]:
                self.recorder.log_client(rnd, hop["client"], "train", hop["metrics"])
            self.stats.bytes_down += hop["bytes_down"]
            self.stats.bytes_up += hop["bytes_up"]
            self.stats.failed.extend(hop["failed"])
            self.stats.rejected.extend(hop["rejected"])
        for position in range(self.position, len(order)):
            self.hop(grid, rnd, position, node_of.get(order[position]))
        self.position, self.partial = 0, []
        if not self.evaluates_round(rnd):
            return
        inference = self.inference_arrays()
        evaluation = {
            n: RecordDict({"arrays": to_record(inference), "config": self.base_config(rnd)})
            for n in self.ordered_nodes()
        }
        self.stats.extra.update(self.record_evaluation(rnd, self.exchange(grid, "evaluate", evaluation, rnd)))

    def hop(self, grid: Grid, rnd: int, position: int, node_id: int | None) -> None:
        """Send the pair to the site at ``position``; keep its reply's pair if valid; checkpoint."""
        before = (self.stats.bytes_down, self.stats.bytes_up, len(self.stats.failed), len(self.stats.rejected))
        metrics: dict[str, float] = {}
        client = f"partition-{self.order[position]}"
        if node_id is None:
            log(WARNING, "[medflower] round %d: %s is not connected; the pair goes to the next site", rnd, client)
            self.stats.failed.append(f"{client}: not connected")
        else:
            client = self.client_name(node_id)
            content = RecordDict({"arrays": to_record(self.global_arrays), "config": self.base_config(rnd)})
            replies = self.exchange(grid, "train", {node_id: content}, rnd, expect=self.spec)
            if replies:
                self.global_arrays = replies[0].arrays
                metrics = {**replies[0].metrics, "position": float(position)}
                self.recorder.log_client(rnd, client, "train", metrics)
            else:
                log(WARNING, "[medflower] round %d: %s skipped; the pair goes on unchanged", rnd, client)
        self.position = position + 1
        self.partial.append(
            {
                "client": client,
                "metrics": metrics,
                "bytes_down": self.stats.bytes_down - before[0],
                "bytes_up": self.stats.bytes_up - before[1],
                "failed": self.stats.failed[before[2] :],
                "rejected": self.stats.rejected[before[3] :],
            }
        )
        if self.position < len(self.order):  # the last hop's state is saved by ``run`` with the round
            self.save_checkpoint()
