"""python -m medflower.predict: a run's model (a site's own with a personalised method) applied to images written
here, checked against the model assembled by hand from the run's files and against the run's own last evaluation."""

import csv
import json
import shutil

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from trained_runs import hand_model, last_evaluation, last_round, model_outputs, site_test_split, trained_run

from medflower.data.image_datasets import read_rgb
from medflower.predict import PredictError, main, predict
from medflower.trained import RunError, TrainedRun


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return trained_run(tmp_path_factory, "classifier")


@pytest.fixture(scope="module")
def segmenter(tmp_path_factory):
    return trained_run(tmp_path_factory, "segmenter")


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def write_images(folder, images, prefix="img"):
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, image in enumerate(images):
        names.append(f"{prefix}{i:02d}.png")
        Image.fromarray(image).save(folder / names[-1])
    return names


def test_classifier_probabilities_are_the_run_models(classifier, tmp_path):
    images, labels = site_test_split(classifier, 0)
    names = write_images(tmp_path / "in" / "images", images)
    manifest = tmp_path / "in" / "manifest.csv"
    manifest.write_text("path,label\n" + "".join(f"images/{n},{y}\n" for n, y in zip(names, labels)))

    report = predict(classifier, manifest, tmp_path / "out", device="cpu", batch_size=3)

    expected = torch.softmax(model_outputs(hand_model(classifier), images), dim=1).numpy()
    rows = read_csv(tmp_path / "out" / "predictions.csv")
    run = TrainedRun(classifier)
    written = np.array([[float(r[f"p_{c}"]) for c in run.class_names] for r in rows])
    np.testing.assert_allclose(written, expected, atol=1e-6)
    assert [r["predicted"] for r in rows] == [run.class_names[i] for i in expected.argmax(axis=1)]
    assert [r["label"] for r in rows] == [run.class_names[y] for y in labels]
    # the same images and model as the run's last evaluation of site-0's test split: the same scores
    scores = json.loads((tmp_path / "out" / "scores.json").read_text())
    record = last_evaluation(classifier, "site-0")
    for metric in ("auc", "balanced_accuracy", "accuracy"):
        assert scores[metric] == pytest.approx(record[metric], abs=1e-9), metric
    assert report["model"]["model"] == "global" and report["inputs"] == len(images)


def test_a_personalised_segmenter_is_the_sites_own(segmenter, tmp_path):
    images, masks = site_test_split(segmenter, 1)
    names = write_images(tmp_path / "in" / "images", images)
    write_images(tmp_path / "in" / "masks", [np.asarray(m, dtype=np.uint8) for m in masks])

    report = predict(segmenter, tmp_path / "in", tmp_path / "out", site="site-1", device="cpu", probabilities=True)

    logits = model_outputs(hand_model(segmenter, partition=1), images).numpy()
    other = model_outputs(hand_model(segmenter, partition=0), images).numpy()
    assert not np.allclose(logits, other, atol=1e-4)  # the site's own state makes its model
    for name, expected in zip(names, logits):
        stem = name[: -len(".png")]
        probabilities = np.load(tmp_path / "out" / "probabilities" / f"{stem}.npy")
        np.testing.assert_allclose(probabilities, torch.sigmoid(torch.from_numpy(expected)).numpy(), atol=1e-6)
        mask = np.asarray(Image.open(tmp_path / "out" / "masks" / name))
        assert mask.shape == images[0].shape[:2]
        on = expected > 0
        label = np.where(on.any(axis=0), np.where(on, expected, -np.inf).argmax(axis=0) + 1, 0)
        np.testing.assert_array_equal(mask, label)
    scores = json.loads((tmp_path / "out" / "scores.json").read_text())
    record = last_evaluation(segmenter, "site-1")
    compared = [k for k in record if k.split("_")[0] in ("dice", "iou", "hd95") and not k.startswith("val_")]
    assert "dice" in compared
    for metric in compared:
        assert scores[metric] == pytest.approx(record[metric], abs=1e-9), metric
    per_image = read_csv(tmp_path / "out" / "scores.csv")
    assert len(per_image) == len(images) * 2 and {r["structure"] for r in per_image} == {"ellipse", "rectangle"}
    assert report["model"]["site"] == {"name": "site-1", "partition": 1}


def test_masks_keep_the_inputs_geometry(segmenter, tmp_path):
    """A 2-D image of another size gets a mask of its size; a NIfTI volume a label volume with its affine."""
    images, masks = site_test_split(segmenter, 1)
    model = hand_model(segmenter, partition=1)
    wide = np.asarray(Image.fromarray(images[0]).resize((40, 24), Image.Resampling.NEAREST))
    write_images(tmp_path / "flat", [wide])
    volume = np.stack([images[i][..., 0] for i in range(3)], axis=-1)  # (16, 16, 3): 3 grey slices along k
    labels = np.stack([np.asarray(masks[i], dtype=np.uint8) for i in range(3)], axis=-1)
    affine = np.array([[0.0, -0.8, 0, 12.5], [0.7, 0, 0, -3.0], [0, 0, 2.5, 40.0], [0, 0, 0, 1]])
    (tmp_path / "vol" / "images").mkdir(parents=True)
    (tmp_path / "vol" / "masks").mkdir()
    nib.save(nib.Nifti1Image(volume, affine), tmp_path / "vol" / "images" / "case1.nii.gz")
    nib.save(nib.Nifti1Image(labels, affine), tmp_path / "vol" / "masks" / "case1.nii.gz")

    predict(segmenter, tmp_path / "flat", tmp_path / "out-flat", site="site-1", device="cpu")
    predict(segmenter, tmp_path / "vol", tmp_path / "out-vol", site="partition-1", device="cpu")

    mask = np.asarray(Image.open(tmp_path / "out-flat" / "masks" / "img00.png"))
    assert mask.shape == (24, 40)
    read = read_rgb(tmp_path / "flat" / "img00.png", 16)  # the data layer's reader: resized to the run's img-size
    resized = F.interpolate(model_outputs(model, [read]), size=(24, 40), mode="bilinear", align_corners=False)[0]
    on = (resized > 0).numpy()
    np.testing.assert_array_equal(mask > 0, on.any(axis=0))
    written = nib.load(tmp_path / "out-vol" / "masks" / "case1.nii.gz")
    assert written.shape == volume.shape
    np.testing.assert_allclose(written.affine, affine)
    slices = [np.repeat(volume[..., k][..., None], 3, axis=-1) for k in range(3)]
    expected = model_outputs(model, slices).numpy() > 0  # [k, K, i, j]
    np.testing.assert_array_equal(np.asarray(written.dataobj) > 0, np.moveaxis(expected.any(axis=1), 0, -1))
    rows = read_csv(tmp_path / "out-vol" / "scores.csv")
    assert [r["image"] for r in rows] == ["images/case1.nii.gz"] * 2


def test_planes_write_one_mask_per_structure(segmenter, tmp_path):
    images, _ = site_test_split(segmenter, 0)
    write_images(tmp_path / "in", images[:2])
    predict(segmenter, tmp_path / "in", tmp_path / "out", site="site-0", device="cpu", masks="planes")
    logits = model_outputs(hand_model(segmenter, partition=0), images[:2]).numpy()
    for k, structure in enumerate(("ellipse", "rectangle")):
        for i in range(2):
            plane = np.asarray(Image.open(tmp_path / "out" / f"masks-{structure}" / f"img{i:02d}.png"))
            np.testing.assert_array_equal(plane, np.where(logits[i, k] > 0, 255, 0))
    assert not (tmp_path / "out" / "masks").exists()


def test_a_run_folder_without_a_model_is_refused(classifier, tmp_path):
    with pytest.raises(RunError, match="does not exist"):
        TrainedRun(tmp_path / "nowhere")
    with pytest.raises(RunError, match="no config.json"):
        TrainedRun(tmp_path)
    (tmp_path / "unfinished").mkdir()
    shutil.copy(classifier / "config.json", tmp_path / "unfinished" / "config.json")
    with pytest.raises(RunError, match="has no checkpoint"):
        TrainedRun(tmp_path / "unfinished")


def test_an_unknown_site_and_a_missing_site_are_refused(segmenter, tmp_path):
    images, _ = site_test_split(segmenter, 0)
    write_images(tmp_path / "in", images[:1])
    with pytest.raises(RunError, match=r"'site-7' is not a site of the run .*site-0, site-1"):
        predict(segmenter, tmp_path / "in", tmp_path / "out", site="site-7")
    with pytest.raises(RunError, match="keeps part of each site's model on the site .*pass --site"):
        predict(segmenter, tmp_path / "in", tmp_path / "out")
    empty = tmp_path / "empty-state" / "partition-0"
    empty.mkdir(parents=True)
    with pytest.raises(RunError, match="site site-0 has no saved fedsa state"):
        predict(segmenter, tmp_path / "in", tmp_path / "out", site="site-0", state_dir=empty)


def test_missing_images_are_refused(classifier, tmp_path):
    with pytest.raises(PredictError, match="no such file or folder"):
        predict(classifier, tmp_path / "absent", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PredictError, match="no images in it"):
        predict(classifier, tmp_path / "empty", tmp_path / "out")
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("path,label\nthere.png,1\n")
    with pytest.raises(PredictError, match=r"1 image\(s\) not found .*line 2 \('there.png'\)"):
        predict(classifier, manifest, tmp_path / "out")
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 4), dtype=np.uint8), np.eye(4)), tmp_path / "ct.nii.gz")
    with pytest.raises(PredictError, match="volume.*classifier of 2-D images"):
        predict(classifier, tmp_path / "ct.nii.gz", tmp_path / "out")


def test_the_command_line_says_what_is_wrong(tmp_path, capsys):
    code = main(["--run", str(tmp_path / "nowhere"), "--images", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == 2
    assert "error: run folder" in capsys.readouterr().err


def test_a_supernodes_state_dir_gives_the_sites_model(segmenter, tmp_path):
    """A deployed site's state lives below its node-config state-dir, in the run's folder <run-name>-<run-uid>."""
    images, _ = site_test_split(segmenter, 1)
    write_images(tmp_path / "in", images[:3])
    uid = json.loads((last_round(segmenter) / "state.json").read_text())["run_uid"]
    shutil.copytree(segmenter / "client-state" / "partition-1", tmp_path / "state" / f"segmenter-{uid}" / "partition-1")
    shutil.copytree(segmenter / "client-state" / "partition-0", tmp_path / "state" / f"segmenter-{uid}" / "partition-0")

    report = predict(
        segmenter, tmp_path / "in", tmp_path / "out", site="partition-1", state_dir=tmp_path / "state", device="cpu"
    )

    expected = model_outputs(hand_model(segmenter, partition=1), images[:3]).numpy() > 0
    for i in range(3):
        mask = np.asarray(Image.open(tmp_path / "out" / "masks" / f"img{i:02d}.png"))
        np.testing.assert_array_equal(mask > 0, expected[i].any(axis=0))
    assert report["model"]["site"]["partition"] == 1
    with pytest.raises(RunError, match="several site state folder.*partition-0, partition-1"):
        predict(segmenter, tmp_path / "in", tmp_path / "out", state_dir=tmp_path / "state")
