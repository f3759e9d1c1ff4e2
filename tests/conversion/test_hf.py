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
    from normlab.conversion.hf import load_model, token_chunks

    model, tokenizer = load_model(tiny_hf(tmp_path / "m", family))
    assert tokenizer is None
    assert token_chunks(CALIB, tokenizer, 100, 16).shape[0] > 10


def test_random_bytes_as_calibration_text_warn():
    from normlab.conversion.hf import check_text

    with pytest.warns(UserWarning, match="are not text"):
        check_text(bytes(range(256)).decode("latin-1") * 50, "noise.bin")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_text(CALIB, "calib.txt")
