"""Where `normlab.conversion.data.models` lived until 0.6, kept so that code written against it
(``normlab.conversion.hf.smollm2()``) runs unchanged. New code imports ``normlab.conversion.data.models``."""

from normlab.conversion.data.models import (
    QWEN_CODER,
    SMOLLM2,
    TextCut,
    TextSplits,
    TokenStream,
    fixture_path,
    leading_bos,
    load_model,
    quiet,
    qwen_coder,
    smollm2,
    text_batches,
    text_splits,
    token_chunks,
    usable_tokenizer,
)

__all__ = ["SMOLLM2", "QWEN_CODER", "quiet", "smollm2", "qwen_coder", "fixture_path", "load_model", "leading_bos",
           "usable_tokenizer", "token_chunks", "text_batches", "text_splits", "TextCut", "TextSplits",
           "TokenStream"]  # fmt: skip
