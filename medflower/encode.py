"""Build the frozen-encoder caches of a run's sites before the run (docs/models.md#frozen-encoder-mode).

In the frozen-encoder mode each site encodes its images when it first trains; on a CPU that can take longer than a
round may (LiteMedSAM: seconds per 256-px image). This command does the same work ahead of time, through the same
code a site runs (``ClientRuntime.data``), so the run then reads the caches:

    # the simulated sites of a run config (partition-id 0..N-1 of its dataset)
    python -m medflower.encode --run-config "dataset='segfolder:/data/polyp' partition='natural' \\
        backbone='litemedsam' img-size=256 adapter='none'" --sites 2 --data-roots /data
    # one hospital's own data, as its SuperNode reads it (node-config data-path and cache-dir)
    python -m medflower.encode --run-config run.toml --data-path /data/site --cache-dir /var/cache/medflower

The run config is a TOML file or ``"key=value ..."`` as ``flwr run --run-config`` takes it; its model settings must
be the run's (backbone, weights, img-size, input-norm, adapter 'none'), since the cache is keyed by the encoder and
its input. The cache folder is node-config ``cache-dir``'s, here ``--cache-dir``, else ``MEDFLOWER_CACHE_DIR``, else
``~/.cache/medflower``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from flwr.app import Context, RecordDict
from flwr.common.config import parse_config_args

from .config import ConfigError, ExperimentConfig, defaults
from .data import DataError
from .models import ModelError
from .training import DeviceError


def prepare(
    run_config: dict,
    sites: int,
    data_path: str | None = None,
    cache_dir: str | None = None,
    device: str = "",
    data_roots: str | None = None,
) -> list[dict]:
    """Encode every site's splits (or the one site of ``data_path``); one summary per site."""
    full = {**defaults(), **run_config}
    if device:
        full["device"] = device
    cfg = ExperimentConfig.from_run_config(full)
    if (why := cfg.frozen_encoder_problem()) is not None:
        raise ConfigError(f"this run config is not in the frozen-encoder mode ({why}); there is nothing to encode")
    from .contract.client import ClientRuntime

    out = []
    for partition in range(1 if data_path else sites):
        node = {"data-path": data_path} if data_path else {"partition-id": partition, "num-partitions": sites}
        if cache_dir is not None:
            node["cache-dir"] = cache_dir
        if data_roots is not None:
            node["data-roots"] = data_roots
        context = Context(run_id=0, node_id=partition, node_config=node, state=RecordDict(), run_config=full)
        started = time.perf_counter()
        if data_path:
            runtime = ClientRuntime(cfg, context, {}, partition, 1, data_path)
        else:
            runtime = ClientRuntime(cfg, context, {}, partition, sites)
        data = runtime.data
        sizes = {split: len(getattr(data, split)) for split in ("train", "val", "test")}
        out.append({"site": runtime.client, **sizes, "seconds": time.perf_counter() - started})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-config", required=True, help='TOML file or "key=value ..." (as flwr run takes)')
    parser.add_argument("--sites", type=int, default=2, help="simulated sites: partition-id 0..N-1 of the dataset")
    parser.add_argument("--data-path", default=None, help="one site's own data (node-config data-path)")
    parser.add_argument("--cache-dir", default=None, help="the site's cache folder (node-config cache-dir)")
    parser.add_argument("--device", default="", help="cpu, cuda, cuda:1 ... (default: the run config's)")
    parser.add_argument(
        "--data-roots", default=None, help="folders the run config's paths may be below (node-config data-roots)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summaries = prepare(
            parse_config_args([args.run_config]),
            args.sites,
            args.data_path,
            args.cache_dir,
            args.device,
            args.data_roots,
        )
    except (ConfigError, DataError, ModelError, DeviceError) as err:  # the user's config, data, weights or device
        parser.exit(2, f"error: {err}\n")
    for s in summaries:
        print(
            f"{s['site']}: train {s['train']}, val {s['val']}, test {s['test']} images encoded in {s['seconds']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
