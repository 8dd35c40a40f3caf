"""python -m medflower.export: each format read back gives the run's model's outputs on a site's images; the card
says what the model is; a format a model cannot take is refused with the reason."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from trained_runs import hand_model, model_outputs, site_test_split, trained_run

from medflower.export import (
    ExportError,
    export,
    fold_adapters,
    load_safetensors,
    load_torchscript,
    main,
    onnx_outputs,
    write_safetensors,
    write_torchscript,
)
from medflower.modelcard import file_sha256
from medflower.models import ModelSpec, build_model
from medflower.trained import RunError

FORMATS = ["safetensors", "torchscript", "onnx"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {kind: trained_run(tmp_path_factory, kind) for kind in ("classifier", "segmenter")}


def read_back(fmt, path, images):
    from medflower.data.transforms import images_to_tensor

    x = images_to_tensor(images, 16)
    if fmt == "onnx":
        return onnx_outputs(path, x)
    model = load_safetensors(path) if fmt == "safetensors" else load_torchscript(path)
    with torch.no_grad():
        return model(x).float()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind, site, partition", [("classifier", None, None), ("segmenter", "site-1", 1)])
def test_an_export_read_back_gives_the_run_models_outputs(runs, tmp_path, fmt, kind, site, partition):
    if fmt == "onnx":
        pytest.importorskip("onnx", reason="format onnx needs the export extra (pip install 'medflower[export]')")
        pytest.importorskip("onnxruntime", reason="reading an ONNX file back needs onnxruntime (the export extra)")
    out = tmp_path / f"model.{fmt}"
    card = export(runs[kind], fmt, out, site=site)

    images, _ = site_test_split(runs[kind], partition or 0)
    expected = model_outputs(hand_model(runs[kind], partition), images[:4])
    moved = tmp_path / "elsewhere" / out.name  # the file alone, away from the run folder
    moved.parent.mkdir()
    shutil.copy(out, moved)
    got = read_back(fmt, moved, images[:4])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert card["check"]["verified"] is True and card["check"]["max_abs_difference"] <= 1e-4
    assert json.loads((tmp_path / f"model.{fmt}.json").read_text()) == card
    assert card["sha256"] == file_sha256(out)


def test_lora_is_folded_into_the_weights(runs, tmp_path):
    card = export(runs["segmenter"], "safetensors", tmp_path / "site.safetensors", site="site-1")
    adapted = [n for n, m in hand_model(runs["segmenter"], 1).named_modules() if hasattr(m, "lora_A")]
    assert card["adapters"] == {"folded": {"lora": len(adapted)}, "kept_as_modules": {}}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "site.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    assert not [n for n in names if "lora" in n]
    assert f"{adapted[0]}.weight" in names  # the adapted layer itself, holding W + BA


def test_the_card_says_what_the_model_is(runs, tmp_path):
    run = runs["segmenter"]
    card = export(run, "torchscript", tmp_path / "site.pt", site="site-1")
    config = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert card["strategy"] == "fedsa" and card["task"] == "segmentation"
    assert card["model"] == "site site-1" and card["round"] == summary["rounds"] == config["num-rounds"]
    assert card["backbone"]["name"] == config["backbone"]
    assert card["backbone"]["weights"]["source"] == config["resolved"]["weights-source"]
    assert card["input"]["size"] == [config["img-size"]] * 2
    assert card["input"]["normalisation"]["inside_model"] == config["resolved"]["input-norm"]
    assert card["structures"] == ["ellipse", "rectangle"]
    assert card["metrics"]["mean_over_sites"] == summary["final"]
    assert card["metrics"]["site"] == summary["per_client"]["site-1"]
    assert card["privacy"] == {"differential_privacy": "none"}
    assert card["checkpoint"]["arrays_sha256"] == file_sha256(run / "checkpoint/round-000002/arrays.safetensors")


def small_model(adapter: str) -> torch.nn.Module:
    spec = ModelSpec(backbone="test_vit", adapter=adapter, img_size=16, patch_size=8, weights="none")
    model = build_model(spec, 3).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters away from their (identity) start
        for parameter in model.trainable_parameters().values():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize("adapter, folded, kept", [("ia3", "ia3", None), ("bottleneck", None, "bottleneck adapter")])
def test_folding_keeps_the_outputs_and_says_what_stays(adapter, folded, kept):
    model = small_model(adapter)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(x)
        notes = fold_adapters(model)
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)
    assert (folded in notes["folded"]) if folded else notes["folded"] == {}
    assert any(k.startswith(kept) for k in notes["kept_as_modules"]) if kept else notes["kept_as_modules"] == {}


def test_safetensors_refuses_a_model_that_computes_through_a_hook(tmp_path):
    class SiteBias:  # a method's per-site addition that lives outside the modules (FedDBE's bias, say)
        def __init__(self):
            self.bias = torch.full((1,), 0.5)

        def hook(self, module, args):
            return (args[0] + self.bias,)

    model = small_model("lora")
    model.head.register_forward_pre_hook(SiteBias().hook)
    with pytest.raises(ExportError, match=r"safetensors holds weights only.*SiteBias on head.*torchscript or onnx"):
        write_safetensors(model, tmp_path / "m.safetensors", {})
    x = torch.randn(2, 3, 16, 16)
    write_torchscript(model, tmp_path / "m.pt", x)
    with torch.no_grad():
        torch.testing.assert_close(load_torchscript(tmp_path / "m.pt")(x), model(x))


def test_safetensors_refuses_a_model_its_description_does_not_rebuild(tmp_path):
    """A site's sub-network (the sub-model strategies cut FFN neurons per site) does not fit the run's spec."""
    model = small_model("lora")
    fold_adapters(model)
    spec = {**dataclasses.asdict(model.spec), "weights": "none"}
    write_safetensors(model, tmp_path / "fits.safetensors", {"spec": spec, "classes": 3})
    with pytest.raises(ExportError, match=r"does not fit \(2 weights differ .*head.weight.*torchscript or onnx"):
        write_safetensors(model, tmp_path / "wider.safetensors", {"spec": spec, "classes": 5})
    assert not (tmp_path / "wider.safetensors").exists()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(load_safetensors(tmp_path / "fits.safetensors")(x), model(x))


def test_bad_requests_are_refused(runs, tmp_path, capsys):
    with pytest.raises(ExportError, match="format 'pickle': one of safetensors, torchscript, onnx"):
        export(runs["classifier"], "pickle", tmp_path / "m.pkl")
    with pytest.raises(RunError, match="does not exist"):
        export(tmp_path / "nowhere", "onnx", tmp_path / "m.onnx")
    with pytest.raises(RunError, match="pass --site"):
        export(runs["segmenter"], "torchscript", tmp_path / "m.pt")
    code = main(["--run", str(runs["segmenter"]), "--site", "site-5", "--format", "onnx", "--out", str(tmp_path / "x")])
    assert code == 2 and "'site-5' is not a site of the run" in capsys.readouterr().err
    assert not list(tmp_path.glob("m.*")) and not (tmp_path / "x").exists()


def test_load_safetensors_refuses_a_file_that_is_not_an_export(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(2, dtype=np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ExportError, match="not a medflower export"):
        load_safetensors(tmp_path / "other.safetensors")
