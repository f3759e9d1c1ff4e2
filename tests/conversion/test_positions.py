"""A model with few positions, judged as used (issue 99, the red team's CX1): `normlab convert` of a GPT-2 whose
``n_positions`` is 128 converted, then raised a raw IndexError inside ``generate`` in the judge (the chat prompts plus
the answers passed the position table) and saved no folder. The judge now stays within the model's positions, and a
failure inside it never loses the conversion: the folder is saved without the judgement, which says why."""

from __future__ import annotations

import json

import pytest
import torch

import normlab
from conftest import CALIB, tiny_tokenizer
from normlab.cli import main
from normlab.conversion.measure.fidelity import check_result

pytest.importorskip("transformers")


def _gpt2_folder(tmp_path, positions: int = 128, tokenizer=None):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=positions,
                                  bos_token_id=0, eos_token_id=1)  # fmt: skip
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(tmp_path / "m")
    (tokenizer or tiny_tokenizer()).save_pretrained(tmp_path / "m")
    (tmp_path / "calib.txt").write_text(CALIB)
    return ["convert", "--model", str(tmp_path / "m"), "--calibrate", str(tmp_path / "calib.txt"), "--to", "dyt",
            "--no-progress", "--out", str(tmp_path / "o")]  # fmt: skip


def test_a_gpt2_of_128_positions_is_judged_within_them(tmp_path, capsys):
    assert main(_gpt2_folder(tmp_path)) == 0, capsys.readouterr().err
    fid = json.loads((tmp_path / "o" / "fidelity.json").read_text())
    check_result(fid)  # the declared shape of a conversion's result (ConversionResult), judged
    with pytest.raises(ValueError, match="fidelity.json: unknown key 'same_top1'; it takes output_cosine"):
        check_result({**fid, "same_top1": 0.9})
    usage = fid["usage"]
    gen = usage["generation"]
    assert 1 <= gen["new_tokens"] < usage["config"]["new_tokens"]  # the answers shortened to fit 128 positions
    assert usage["texts"]["chat"]["tokens"] > 0 and "consistency" in usage
    assert all(k in usage["stress"] for k in ("leading newlines", "128 tokens"))
    normlab.load_converted(tmp_path / "o")


def test_a_pad_id_outside_the_vocabulary_is_no_token_of_the_model(tmp_path, capsys):
    """issue 100: a tokenizer saved with a pad token the model has no row for (id 100 of a 100-token model) crashed
    the judge's left-padding check with a raw IndexError; the check pads with a token of the model."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"pad_token": "<pad>"})
    assert tok.pad_token_id == 100
    assert main(_gpt2_folder(tmp_path, positions=256, tokenizer=tok)) == 0, capsys.readouterr().err
    fid = json.loads((tmp_path / "o" / "fidelity.json").read_text())
    assert "usage_error" not in fid and "consistency" in fid["usage"], fid.get("usage_error")


def test_a_failure_inside_the_judge_saves_the_conversion_and_says_so(tmp_path, capsys, monkeypatch):
    import normlab.conversion.workflow as wf

    def broken(*args, **kwargs):
        raise IndexError("index out of range in self")

    monkeypatch.setattr(wf, "usage_report", broken)
    assert main(_gpt2_folder(tmp_path, positions=256)) == 0
    err = capsys.readouterr().err
    assert "the judgement failed (IndexError: index out of range in self); the conversion is saved" in err, err
    fid = json.loads((tmp_path / "o" / "fidelity.json").read_text())
    assert fid["usage_error"] == "IndexError: index out of range in self" and "usage" not in fid
    normlab.load_converted(tmp_path / "o")


def test_the_answers_fit_the_positions_left_after_the_longest_prompt():
    from normlab.conversion.measure.usage import answer_tokens

    prompts = [torch.zeros(40, dtype=torch.long), torch.zeros(119, dtype=torch.long)]
    assert answer_tokens(prompts, 64, 128) == 9 and answer_tokens(prompts, 64, None) == 64
    assert answer_tokens(prompts, 64, 119) == 0 and answer_tokens(prompts, 4, 4096) == 4


def test_the_left_padded_check_counts_positions_from_the_first_token(tmp_path):
    """issue 99 (EV12): the judge's left-padded check fed GPT-2 (absolute positions) the padded row's positions
    from 0, so its tokens sat 5 places later than alone and even the original read 0.69 of the logits' scale.
    Counted from the first real token, as generate does, an unconverted GPT-2 and a Llama agree to rounding."""
    import transformers

    from conftest import tiny_hf
    from normlab.conversion.measure.usage import _consistency

    ids = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(0))
    _gpt2_folder(tmp_path)
    gpt2 = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m").eval()
    llama = transformers.LlamaForCausalLM.from_pretrained(tiny_hf(tmp_path / "llama")).eval()
    for model in (gpt2, llama):
        c = _consistency(model, ids, pad=0)
        assert c["padded"] < 1e-5 and c["kv_chunks"] < 1e-5, (type(model).__name__, c)
