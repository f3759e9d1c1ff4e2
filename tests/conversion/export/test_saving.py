"""Saving and loading a converted model: the record, its fields, and folders written by someone else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import normlab
from conftest import tiny_lm

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("head", ["ViTModel", "ViTForImageClassification"])
@pytest.mark.parametrize("target", ["dyt", "dyisru"])
def test_defect_4_a_converted_vit_saved_by_transformers_reloads_exactly(tmp_path, head, target):
    """transformers' save_pretrained writes ViT's legacy key names (encoder.layer.N); load_converted read the raw
    file into a fresh model and failed with 'weights do not match' for every ViT and every target."""
    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = getattr(transformers, head)(cfg).eval()
    rec = normlab.convert_norms(model, target, calibrate=[torch.randn(4, 3, 16, 16)])
    normlab.save_converted(model, rec, tmp_path / "out")
    loaded, rec2 = normlab.load_converted(tmp_path / "out")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        a, b = model(x), loaded(x)
    key = "logits" if head.endswith("Classification") else "last_hidden_state"
    torch.testing.assert_close(getattr(b, key), getattr(a, key), rtol=0, atol=0)
    assert rec2.target == target


def _saved_conversion(tmp_path, seed: int = 0) -> Path:
    model = tiny_lm(seed=seed)
    rec = normlab.convert_norms(model, "dyt")
    return normlab.save_converted(model, rec, tmp_path / "conv")


def test_fuzz_every_conversion_record_field(tmp_path):
    from normlab.conversion.export.saving import RECORD_FILE
    from normlab.record import _RECORD_FIELDS, _SITE_FIELDS

    folder = _saved_conversion(tmp_path)
    good = json.loads((folder / RECORD_FILE).read_text())
    normlab.load_converted(folder)
    cases = [({**good, k: w}, k) for k in _RECORD_FIELDS for w in ("junk", 5, {"a": 1})]  # "junk": no such norm
    site0 = good["sites"][0]
    cases += [
        ({**good, "sites": [{**site0, k: w}, *good["sites"][1:]]}, f"sites[0].{k}")
        for k in _SITE_FIELDS
        for w in ("junk", [1], {"a": 1})
        if not isinstance(w, _SITE_FIELDS[k][0])
    ]
    cases += [
        ({**good, "sites": [{k: v for k, v in site0.items() if k != "dim"}]}, "sites[0].dim"),
        ({**good, "sites": [{**site0, "extra": 1}]}, "sites[0].extra"),
    ]
    for d, field in cases:
        (folder / RECORD_FILE).write_text(json.dumps(d))
        with pytest.raises(ValueError) as e:
            normlab.load_converted(folder)
        msg = str(e.value)
        assert RECORD_FILE in msg and field in msg and "\n" not in msg, (field, msg)


def test_load_converted_refuses_edited_and_foreign_folders(tmp_path):
    from safetensors.torch import load_file, save_file

    from normlab.conversion.export.saving import RECORD_FILE

    folder = _saved_conversion(tmp_path)
    good = json.loads((folder / RECORD_FILE).read_text())
    weights = folder / "model.safetensors"
    state = load_file(weights)
    # another converted model of the same shape: its weights used to load silently
    other = _saved_conversion(tmp_path / "b", seed=1)
    (folder / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="is not the file normlab_conversion.json was saved with"):
        normlab.load_converted(folder)
    unchecked = {k: v for k, v in good.items() if k != "weights_sha256"}  # a record from before the field
    (folder / RECORD_FILE).write_text(json.dumps(unchecked))
    for edit, match in (
        (lambda s: {k: v for k, v in s.items() if not k.endswith("layers.0.input_layernorm.alpha")}, "missing"),
        (lambda s: {**s, "extra.weight": torch.zeros(1)}, "unexpected"),
        (lambda s: {**s, "model.norm.weight": torch.zeros(7)}, r"model\.norm\.weight has shape \(7,\)"),
    ):
        save_file(edit(state), str(weights))
        with pytest.raises(ValueError, match=match):
            normlab.load_converted(folder)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="damaged or truncated"):
        normlab.load_converted(folder)
    (folder / RECORD_FILE).write_text(json.dumps({**unchecked, "model_class": "NoSuchModel"}))
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="model_class 'NoSuchModel' is not a transformers model class"):
        normlab.load_converted(folder)


def test_an_edited_record_s_sites_are_named_with_the_fix(tmp_path):
    """issue 99: a record whose sites were edited gave "weights do not match the converted model" with the keys
    alone, or a raw TypeError from the norm. Each names the record, the site and the fix."""
    from normlab.conversion.export.saving import RECORD_FILE

    folder = _saved_conversion(tmp_path)
    good = json.loads((folder / RECORD_FILE).read_text())
    first, site0 = good["sites"][0]["name"], good["sites"][0]
    for sites, says in (
        (good["sites"][1:], f"the weights hold a converted norm at {first}, which the record does not list"),
        ([{**site0, "name": first.rsplit(".", 1)[0] + ".self_attn"}, *good["sites"][1:]], "its site"),
        ([{**site0, "kwargs": {"no_such_keyword": 1}}, *good["sites"][1:]], "a site of the record cannot be built"),
    ):
        (folder / RECORD_FILE).write_text(json.dumps({**good, "sites": sites}))
        with pytest.raises(ValueError) as e:
            normlab.load_converted(folder)
        msg = str(e.value)
        assert RECORD_FILE in msg and says in msg and "restore" in msg and "convert the model again" in msg, msg


def test_a_folder_whose_config_names_another_family_is_a_clear_error(tmp_path):
    """issue 50: load_converted on a folder whose config.json is another family's raised a raw AttributeError
    ('LlamaConfig' object has no attribute 'layer_types'), naming no folder."""
    from normlab.conversion.export.saving import RECORD_FILE

    folder = _saved_conversion(tmp_path)
    d = json.loads((folder / RECORD_FILE).read_text())
    (folder / RECORD_FILE).write_text(json.dumps({**d, "model_class": "Gemma3ForCausalLM"}))
    with pytest.raises(ValueError, match=r"names Gemma3ForCausalLM, but config.json is a LlamaConfig"):
        normlab.load_converted(folder)


def test_every_file_of_a_converted_folder_is_readable_by_others_under_umask_022(tmp_path):
    """transformers writes model.safetensors 0600 through a temporary file; the folder is for sharing, so every file
    gets what a plain write gives under umask 022: 0644."""
    import os
    import stat

    from conftest import id_batches, tiny_lm

    model = tiny_lm()
    rec = normlab.convert_norms(model, "dyisru", calibrate=id_batches(1), progress=False)
    old = os.umask(0o022)
    try:
        folder = normlab.save_converted(model, rec, tmp_path / "m")
    finally:
        os.umask(old)
    modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in folder.iterdir() if f.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


@pytest.mark.parametrize("family", ["Mixtral", "Qwen3Moe"])
def test_a_mixture_of_experts_folder_loads_back_into_normlab_and_transformers(family, tmp_path):
    """issue 100: transformers 5 saves a mixture of experts expert by expert and holds the experts stacked; normlab's
    loader put the file's keys straight into the model and refused its own folder ("weights do not match", missing
    mlp.experts.gate_up_proj). The stacked parameters are now gathered through transformers' own reverse conversion:
    both loaders give the converted model's logits."""
    import transformers

    from conftest import load_without_normlab

    torch.manual_seed(0)
    experts = {"Mixtral": {"num_local_experts": 4}, "Qwen3Moe": {"num_experts": 4, "moe_intermediate_size": 16}}
    cfg = getattr(transformers, f"{family}Config")(vocab_size=100, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   num_experts_per_tok=2, **experts[family])  # fmt: skip
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    record = normlab.convert_norms(model, "dyisru", progress=False)
    folder = normlab.save_converted(model, record, tmp_path / "moe")
    x = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    loaded, _ = normlab.load_converted(folder)
    with torch.no_grad():
        want = model(x).logits
        torch.testing.assert_close(loaded(x).logits, want, rtol=0, atol=0)
        torch.save({"x": x, "y": want}, folder / "case.pt")
    seen = load_without_normlab([(str(folder), "AutoModelForCausalLM", "logits")], tmp_path)
    assert seen[str(folder)]["class"] == f"Normlab{family}ForCausalLM" and seen[str(folder)]["diff"] <= 1e-5, seen
