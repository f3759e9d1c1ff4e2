"""The big-vocabulary stand-in (`normlab.conversion.data.standin`) and the walk on it: a folder built from a config
whose tokenizer covers all 262,144 ids, converted by the README's command, whose KL reads one position in n."""

import json

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def small_standin(tmp_path_factory):
    """A small stand-in's folder (width 64, 2 blocks, 262,144 tokens: the output layer 60x its blocks)."""
    from normlab.conversion.data.standin import standin

    return standin(262_144, width=64, blocks=2, cache=tmp_path_factory.mktemp("cache"))


def test_the_standin_tokenizer_covers_its_vocabulary_and_reads_back_text(small_standin):
    """The folder's tokenizer, loaded as a user's: every id is a token, text round-trips, common words are one token
    of the triples (ids above the pairs); a vocabulary the construction cannot fill is refused with the range."""
    from transformers import AutoTokenizer

    from normlab.conversion.data.standin import standin_tokenizer

    tok = AutoTokenizer.from_pretrained(small_standin)
    assert len(tok) == 262_144 and len(tok.get_vocab()) == 262_144
    text = "The quick brown fox jumps over the lazy dog. Hello, world!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and max(ids) > 65_797
    small = standin_tokenizer(49_152)
    assert len(small) == 49_152 and small.decode(small(text)["input_ids"]) == text
    with pytest.raises(ValueError, match="a vocabulary of 261 to 271,176 ids"):
        standin_tokenizer(300_000)


def test_a_big_vocabulary_walks_on_one_position_in_n(small_standin):
    """The small stand-in loaded as a user's model: the budget walk's KL reads one position in n (`kl_every`) in
    the ranking and in the steps, its parts timed; ``step_every=1`` reads every position of the steps."""
    import copy

    import torch

    from normlab.conversion.config import BudgetConfig
    from normlab.conversion.data.models import load_model
    from normlab.conversion.data.standin import standin
    from normlab.conversion.frontier import frontier
    from normlab.conversion.measure.fidelity import kl_every

    assert standin(262_144, width=64, blocks=2, cache=small_standin.parent) == small_standin  # cached: built once
    model, tok = load_model(small_standin, progress=False)
    n = kl_every(model)
    assert n > 4 and len(tok) == model.config.vocab_size == 262_144
    g = torch.Generator().manual_seed(0)
    calib, held = ([torch.randint(0, 262_144, (4, 32), generator=g)] for _ in range(2))
    budget = BudgetConfig(nats=1.0, metric="kl", precision="float32")
    front, _ = frontier(copy.deepcopy(model), "dyisru", calib, held, budget=budget, progress=False)
    assert front.every == (n, n) and set(front.stage_seconds) == {"fits", "costs", "steps"}
    budget.step_every = 1
    assert frontier(model, "dyisru", calib, held, budget=budget, progress=False)[0].every == (n, 1)


def test_the_command_says_and_records_which_positions_its_kl_read(tmp_path, corpus, capsys):
    """``--set budget.rank_every=3 budget.step_every=2``: the printed walk says one position in 2, fidelity.json
    records both and the seconds of the walk's parts; a zero is refused before any work, naming the field."""
    from conftest import convert_argv, tiny_hf
    from normlab.cli import main

    model = tiny_hf(tmp_path / "m")
    argv = [*convert_argv(model, corpus, "--sequences", "8"), "--budget-nats", "0.3", "--set", "budget.metric=kl"]
    assert main([*argv, "budget.rank_every=3", "budget.step_every=2", "--out", str(tmp_path / "a")]) == 0
    walk = json.loads((tmp_path / "a" / "fidelity.json").read_text())["budget_walk"]
    assert walk["every"] == [3, 2] and set(walk["stage_seconds"]) == {"fits", "costs", "steps"}
    assert "on one position in 2;" in capsys.readouterr().out
    assert main([*argv, "budget.step_every=0", "--out", str(tmp_path / "b")]) == 2
    assert "budget.step_every must be an int >= 1" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
