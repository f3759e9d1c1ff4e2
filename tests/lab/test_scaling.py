"""The scaling study's parts: the llama block (RoPE, SwiGLU, untied head), Muon, learning-rate sweeps as data and
their report (best rate, edge flag, gap words), and the new config fields validated before any folder exists."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from normlab.lab import GPT, GPTConfig, resolve_config, train
from normlab.lab.model import apply_rope, rope_tables
from normlab.lab.optim import Optimizers, build_optimizer, muon_parameters
from normlab.lab.runs import RunFolder


def _llama(**kw) -> GPTConfig:
    return GPTConfig(**{"width": 32, "depth": 2, "heads": 2, "context": 16, "block": "llama", **kw})


# ------------------------------------------------------------------ the llama block
def test_llama_block_shapes_and_parameters():
    model = GPT(_llama(width=576, heads=9, depth=1))
    assert model.cfg.mlp_hidden() == 1536  # SmolLM2's intermediate size at its width 576
    assert model.wpe is None and model.head.weight is not model.wte.weight  # RoPE, untied head
    mlp = model.blocks[0].mlp
    assert (mlp.gate.weight.shape, mlp.up.weight.shape, mlp.proj.weight.shape) == (
        (1536, 576),
        (1536, 576),
        (576, 1536),
    )
    assert all(not n.endswith(".bias") for n, _ in model.named_parameters() if "norm" not in n)  # no biases
    logits, loss = GPT(_llama())(torch.randint(256, (3, 16)), torch.randint(256, (3, 16)))
    assert logits.shape == (3, 16, 256) and loss.ndim == 0
    assert GPT(_llama(tied_embeddings=True)).head.weight is not None
    tied = GPT(_llama(tied_embeddings=True))
    assert tied.head.weight is tied.wte.weight
    assert GPT(GPTConfig(width=32, depth=1, heads=2, context=16)).head.weight is not None  # gpt2: tied by default
    assert GPTConfig().tied() and not _llama().tied()


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_causal_mask_a_future_token_leaves_earlier_logits_unchanged(block):
    torch.manual_seed(0)
    model = GPT(_llama(block=block)).eval()
    idx = torch.randint(256, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_rope_against_a_direct_rotation():
    """RoPE rotates the pair (x_i, x_{i + hs/2}) at position t by t * theta^(-2i / hs): written out here as a
    2 x 2 rotation per pair, in float64."""
    hs, t_max, theta = 8, 12, 10000.0
    x = torch.randn(2, 3, t_max, hs, dtype=torch.float64)
    cos, sin = rope_tables(t_max, hs, theta)
    got = apply_rope(x, cos.double(), sin.double())
    want = torch.empty_like(x)
    for t in range(t_max):
        for i in range(hs // 2):
            a = t * theta ** (-2 * i / hs)
            u, v = x[..., t, i], x[..., t, i + hs // 2]
            want[..., t, i] = u * math.cos(a) - v * math.sin(a)
            want[..., t, i + hs // 2] = u * math.sin(a) + v * math.cos(a)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the tables are float32
    # relative positions: q_t . k_s depends on t - s only
    q, k = torch.randn(hs, dtype=torch.float64), torch.randn(hs, dtype=torch.float64)
    rq = apply_rope(q.expand(t_max, hs), cos.double(), sin.double())
    rk = apply_rope(k.expand(t_max, hs), cos.double(), sin.double())
    assert float(rq[5] @ rk[2]) == pytest.approx(float(rq[9] @ rk[6]), rel=1e-5)


def test_match_rms_and_telemetry_work_for_the_llama_block():
    from normlab.lab.metrics import init_telemetry
    from normlab.lab.phase import predict

    torch.manual_seed(0)
    model = GPT(_llama(norm="dyt", norm_init="match_rms"))
    idx = torch.randint(256, (4, 16))
    factors = model.match_rms_(idx)
    assert set(factors) == set(model.norm_modules())
    tele = init_telemetry(model, idx)
    for site in model.norm_modules():
        assert tele[f"rms_out/{site}"] == pytest.approx(1.0, rel=1e-3)
        assert f"gain/{site}" in tele
    assert 0.0 < tele["attn_entropy/0"] <= 1.0 and tele["logit_std"] > 0
    assert predict(_llama(norm="dyt", norm_init="match_rms"))["logit_gain"] > 0.5


# ------------------------------------------------------------------ Muon
def test_muon_groups_every_parameter_once_and_only_matrices_in_muon():
    for block in ("gpt2", "llama"):
        model = GPT(_llama(block=block, norm="dyt", embed_scale="sqrt_d"))
        cfg = resolve_config("tiny", {"optimizer": "muon"})
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        assert isinstance(opt, Optimizers)
        muon, adamw = opt.optimizers
        assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
        seen = [id(p) for g in opt.param_groups for p in g["params"]]
        assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each exactly once
        in_muon = [p for g in muon.param_groups for p in g["params"]]
        assert in_muon and all(p.dim() == 2 for p in in_muon)
        assert not any(p is model.wte.weight or p is model.head.weight for p in in_muon)  # embedding, head: AdamW
        assert {id(p) for p in in_muon} == {id(p) for p in muon_parameters(model)}
        assert all(g["lr"] == cfg.muon_lr for g in muon.param_groups)
        assert all(g["lr"] == cfg.lr for g in adamw.param_groups)


def test_muon_checkpoint_and_resume_are_bit_identical(corpus_file, tmp_path, monkeypatch):
    """A run stopped by SIGINT midway (its checkpoint written at the step reached) and resumed gives the same
    losses, bit for bit, as a run never stopped: Muon's momentum and AdamW's moments both come back."""
    import signal

    train_mod = importlib.import_module("normlab.lab.train")
    cfg = lambda out: resolve_config(
        "tiny",
        {
            "optimizer": "muon",
            "steps": 20,
            "log_every": 1,  # noqa: E731
            "checkpoint_every": 50,
            "model.block": "llama",
        },
        data=[corpus_file],
        out=str(out),
    )
    train(cfg(tmp_path / "ref"), progress=False)
    real_step = train_mod._step

    def step_then_interrupt(*args, **kw):
        out = real_step(*args, **kw)
        if args[2] == 9:  # the 10th step (_step(place, net, step, probing)): Ctrl-C, as a user would
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(train_mod, "_step", step_then_interrupt)
    assert train(cfg(tmp_path / "cut"), progress=False)["status"] == "interrupted"
    monkeypatch.setattr(train_mod, "_step", real_step)
    assert train(cfg(tmp_path / "cut"), resume=True, progress=False)["status"] == "completed"
    ref = {r["step"]: r["train_loss"] for r in RunFolder(tmp_path / "ref").metrics() if "train_loss" in r}
    cut = {r["step"]: r["train_loss"] for r in RunFolder(tmp_path / "cut").metrics() if "train_loss" in r}
    assert ref == cut and len(ref) == 20
    state = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)
    assert len(state["optimizer"]["optimizers"]) == 2  # Muon's state and AdamW's


def test_muon_learning_rate_follows_the_schedule(corpus_file, tmp_path):
    from normlab.lab.optim import lr_at

    cfg = resolve_config(
        "tiny",
        {"optimizer": "muon", "steps": 3, "muon_lr": 0.05, "lr": 1e-3, "warmup": 2},
        data=[corpus_file],
        out=str(tmp_path / "r"),
    )
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    train_mod = importlib.import_module("normlab.lab.train")
    corpus = train_mod.load_corpus([corpus_file], cfg.val_fraction)
    place = train_mod._Place(cfg, None, corpus, 0, 1, torch.device("cpu"))
    train_mod._step(place, train_mod._Net(model, model, model, opt, train_mod.contextlib.nullcontext), 0, False)
    muon, adamw = opt.optimizers
    assert adamw.param_groups[0]["lr"] == lr_at(0, cfg)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.05 * lr_at(0, cfg) / 1e-3)


# ------------------------------------------------------------------ new fields validated first
@pytest.mark.parametrize(
    "setting,match",
    [
        ("model.block=mamba", r"model.block must be 'gpt2' or 'llama', got 'mamba'"),
        ("optimizer=sgd", r"optimizer must be 'adamw' or 'muon', got 'sgd'"),
        ("muon_lr=-1", r"muon_lr must be a finite number >= 0"),
        ("muon_momentum=1.5", r"muon_momentum must be in \[0, 1\)"),
        ("model.rope_theta=0.5", r"model.rope_theta must be a finite number > 1"),
        ("model.tied_embeddings=maybe", r"model.tied_embeddings must be true or false or null"),
        # issue 50: a knob the chosen optimizer or block ignores is refused, not silently dropped
        ("muon_lr=0.05", r"muon_lr = 0.05 sets Muon, but optimizer = 'adamw' does not use it"),
        ("model.rope_theta=500000", r"model.rope_theta = 500000 sets RoPE, which only model.block = 'llama' has"),
    ],
)
def test_new_fields_are_refused_before_any_folder_exists(corpus_file, tmp_path, capsys, setting, match):
    from normlab.cli import main

    out = tmp_path / "r"
    code = main(["train", "--preset", "tiny", "--data", corpus_file, "--out", str(out), "--set", setting])
    assert code == 2
    assert __import__("re").search(match, capsys.readouterr().err)
    assert not out.exists()


def test_llama_block_needs_an_even_head_size():
    with pytest.raises(ValueError, match="head size width / heads = 5 must be even"):
        GPTConfig(width=20, heads=4, block="llama").validate()


# ------------------------------------------------------------------ learning-rate sweeps as data
_SWEEP = """
name = "lr_demo"
seeds = [0, 1]
baseline = "a"
guard = false
[[checks]]
kind = "lr_sweeps"
[[checks]]
kind = "gap"
what = "b minus a"
pairs = [["b", "a"]]
names = ["here"]
[[runs]]
name = "a"
set = { "model.norm" = "rms_norm" }
lrs = [1e-3, 2e-3, 4e-3]
[[runs]]
name = "b"
set = { "model.norm" = "dyt" }
lrs = [1e-3, 3e-3]
"""


def _fake_root(tmp_path, losses: dict[tuple[str, float], list[float]]):
    """A sweep root whose runs have the given final validation losses per (run, lr) and seed."""
    from normlab.sweep import expand, load_experiment, write_index

    toml = tmp_path / "lr_demo.toml"
    toml.write_text(_SWEEP)
    exp = load_experiment(str(toml))
    root = tmp_path / "root"
    specs = expand(exp, "default", root)
    write_index([exp], "default", root)
    for s in specs:
        d = Path(s.config.out)
        d.mkdir(parents=True)
        v = losses[(s.meta["sweep"], s.meta["lr"])][s.seed]
        (d / "summary.json").write_text(
            json.dumps({"status": "completed", "final_val_loss": v, "unigram_entropy": 3.33})
        )
        (d / "config.json").write_text(json.dumps(s.config.to_dict()))
    return exp, root, specs


def test_lr_sweep_expands_one_run_per_rate_and_seed(tmp_path):
    losses = {(n, lr): [2.0, 2.0] for n, lrs in (("a", (1e-3, 2e-3, 4e-3)), ("b", (1e-3, 3e-3))) for lr in lrs}
    _, _, specs = _fake_root(tmp_path, losses)
    assert len(specs) == (3 + 2) * 2
    assert {(s.name, s.config.lr) for s in specs} >= {("a@lr=0.002", 2e-3), ("b@lr=0.003", 3e-3)}
    assert len({s.run_id for s in specs}) == len(specs)


def test_lr_sweep_report_picks_the_best_and_flags_an_edge(tmp_path):
    from normlab.report import Results, claims, read_index  # noqa: F401
    from normlab.report import read_index as _read

    losses = {("a", 1e-3): [2.5, 2.6], ("a", 2e-3): [2.3, 2.32], ("a", 4e-3): [2.4, 2.45],  # best inside the grid
              ("b", 1e-3): [2.2, 2.4], ("b", 3e-3): [2.0, 2.02]}  # best at the edge  # fmt: skip
    _, root, _ = _fake_root(tmp_path, losses)
    res = Results(_read(root / "index.json")["experiments"][0], root, "default")
    assert res.best("a") == "a@lr=0.002" and not res.at_edge("a")
    assert res.best("b") == "b@lr=0.003" and res.at_edge("b")
    assert res.mean("a") == pytest.approx(2.31) and res.mean("b") == pytest.approx(2.01)
    lines = claims(res)
    sweep_a, sweep_b, gap = lines
    assert "best lr 0.002" in sweep_a.text and sweep_a.numbers["edge"] is False
    assert "at the edge of the grid" in sweep_b.text and sweep_b.numbers["edge"] is True
    assert gap.numbers["word"] == "lower" and gap.numbers["gap"] == pytest.approx(2.01 - 2.31)
    assert "grid's edge for b" in gap.text


def test_gap_within_the_spread_over_seeds_is_same(tmp_path):
    from normlab.report import Results, read_index
    from normlab.report.scaling import gap

    losses = {("a", 1e-3): [2.5, 2.7], ("a", 2e-3): [2.3, 2.5], ("a", 4e-3): [2.6, 2.7],
              ("b", 1e-3): [2.35, 2.5], ("b", 3e-3): [2.6, 2.7]}  # fmt: skip
    _, root, _ = _fake_root(tmp_path, losses)
    res = Results(read_index(root / "index.json")["experiments"][0], root, "default")
    d = gap(res, "b", "a")
    assert d["word"] == "same" and abs(d["gap"]) <= d["spread"]


def test_scaling_study_runs_only_at_its_profile():
    from normlab.sweep import builtin_experiments, expand, load_experiment

    assert "scaling" not in builtin_experiments("default")  # not in make demo
    assert "scaling" in builtin_experiments("scaling")
    exp = load_experiment("scaling")
    with pytest.raises(ValueError, match="runs only at profile scaling"):
        expand(exp, "default", "/tmp/nowhere")
    specs = expand(exp, "scaling", "/tmp/nowhere")
    assert {s.seed for s in specs} == {0, 1}
    assert all(s.meta.get("sweep") for s in specs)  # every cell at its best of a grid
    assert {s.config.model.block for s in specs} == {"gpt2", "llama"}
    assert {s.config.optimizer for s in specs} == {"adamw", "muon"}


# ------------------------------------------------------------------ the GPU preset and script, on the CPU
def test_gpt2_small_preset_builds_both_blocks():
    for block in ("gpt2", "llama"):
        cfg = resolve_config("gpt2-small", {"model.block": block, "model.norm_init": "match_rms"}, norm="dyt")
        assert (cfg.model.width, cfg.model.depth, cfg.model.context) == (768, 12, 1024)
        assert cfg.compile and cfg.amp == "bf16"
        with torch.device("meta"):
            n = sum(p.numel() for p in GPT(cfg.model).parameters())
        assert 80e6 < n < 130e6, n  # GPT-2 small's blocks (the byte vocabulary makes the embedding small)


@pytest.mark.slow
def test_gpu_study_script_runs_on_the_cpu_at_tiny_shapes(corpus_file, tmp_path):
    """scripts/gpu_study.sh end to end: its four runs (two blocks x RMSNorm / matched DyT) under bf16 autocast
    (the GPU preset's), at tiny shapes and without torch.compile, and its table."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DATA": corpus_file, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
           "NORMLAB": str(Path(sys.executable).parent / "normlab"), "PYTHON": sys.executable,
           "SET": "model.width=32 model.depth=1 model.heads=2 model.context=32 steps=4 batch_size=2 eval_batches=1 "
                  "eval_every=2 compile=false warmup=1 metrics_every=2 checkpoint_every=2"}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_study.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for run in ("gpt2-rms_norm", "gpt2-dyt", "llama-rms_norm", "llama-dyt"):
        s = json.loads((tmp_path / "out" / run / "summary.json").read_text())
        c = json.loads((tmp_path / "out" / run / "config.json").read_text())
        assert s["status"] == "completed" and c["amp"] == "bf16" and c["model"]["block"] == run.split("-")[0]
    table = [line.split() for line in proc.stdout.strip().splitlines()[-4:]]
    assert [r[:2] for r in table] == [["gpt2", "rms_norm"], ["gpt2", "dyt"], ["llama", "rms_norm"], ["llama", "dyt"]]
    assert all(len(r) == 7 and r[3] != "nan" and r[5] != "nan" for r in table)  # the quantization columns filled


def test_the_issue_command_runs_from_the_command_line(corpus_file, tmp_path):
    """`normlab train --preset small --set model.block=llama optimizer=muon --norm dyt --set
    model.norm_init=match_rms`, at the tiny preset's size: both --set flags apply."""
    from normlab.cli import main

    out = tmp_path / "r"
    code = main(
        [
            "train",
            "--preset",
            "tiny",
            "--set",
            "model.block=llama",
            "optimizer=muon",
            "--norm",
            "dyt",
            "--set",
            "model.norm_init=match_rms",
            "steps=6",
            "--data",
            corpus_file,
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model"]["block"], cfg["optimizer"], cfg["model"]["norm"], cfg["model"]["norm_init"]) == (
        "llama",
        "muon",
        "dyt",
        "match_rms",
    )
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
