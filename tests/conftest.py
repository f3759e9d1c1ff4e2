"""Shared test helpers and fixtures.

* Independently written NumPy formulas for every registered norm. They are written from the papers, not from
  normlab.functional, so a mistake in either shows up as a mismatch.
* Small real inputs: a text corpus (``corpus``, ``corpus_file``), tiny Hugging Face models saved to disk
  (``tiny_hf``, ``models``), an experiment TOML (``write_experiment``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import normlab
from normlab.kernels.inductor_cache import use_cache_of_this_cpu

# Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors. The flag is read when a
# kernel is defined, so it must be set before normlab.kernels.* is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile's cache is keyed without the CPU's vector instruction set: a /tmp copied from an AVX-512 machine to
# an AVX2 one crashed every compiled test (normlab.kernels.inductor_cache). The tests and the processes they start
# compile into a folder of this CPU's own.
use_cache_of_this_cpu()

# `make test` runs one pytest-xdist worker per core, so each worker computes on one thread, as do the processes its
# tests start: two workers of two OpenMP threads each on two cores ran the SmolLM2 tests 4-5x slower than alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the tests marked slow go first (in their order; each worker collects the same list), so
    that the long ones start while the other worker can still fill the time beside them with short ones."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 300


CALIB = "The quick brown fox jumps over the lazy dog. " * 200


@pytest.fixture()
def corpus_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return str(p)


@pytest.fixture()
def corpus(tmp_path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def tiny_lm(family: str = "Llama", seed: int = 0, layers: int = 2, **config):
    """A tiny random Hugging Face causal LM of ``family`` (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma3) in eval mode:
    vocabulary 100, width 32, 4 heads (2 key-value heads; head_dim 8 for Qwen3 and Gemma), ``layers`` blocks, its
    weights drawn after ``torch.manual_seed(seed)``;
    ``config`` overrides any field (``initializer_range=0.5`` for peaked next-token distributions,
    ``tie_word_embeddings=True``)."""
    pytest.importorskip("transformers")
    from normlab.features import tiny_causal_lm

    torch.manual_seed(seed)
    return tiny_causal_lm(family, layers, **config)


def peaked_lm(seed: int):
    """A tiny Llama with a large init: peaked next-token distributions, each seed its own preferences."""
    return tiny_lm(seed=seed, initializer_range=0.5)


def token_stream(n: int = 64, seed: int = 5, t: int = 16):
    """A heal's training stream of ``n`` random sequences of ``t`` token ids below 100."""
    from normlab.conversion.data.texts import TokenStream

    return TokenStream(torch.randint(0, 100, (n, t), generator=torch.Generator().manual_seed(seed)))


def id_batches(n: int, seed: int = 1, t: int = 16, batch: int = 4, vocab: int = 100) -> list[torch.Tensor]:
    """``n`` batches of random token ids (batch, t) below ``vocab``, from their own generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, t), generator=g) for _ in range(n)]


def heal_each_precision(precisions, batches: int, tokens: int, eval_every: int) -> dict:
    """A tiny LM converted to DyT and healed once per ``heal.precision`` from the same start on the same ``batches``
    batches, for ``tokens``: precision -> (its HealReport, the healed model)."""
    import copy

    import normlab

    out = {}
    for precision in precisions:
        original = tiny_lm(initializer_range=0.5)
        model = copy.deepcopy(original)
        rec = normlab.convert_norms(model, "dyt")
        rep = normlab.heal(original, model, id_batches(batches, seed=3), rec, tokens=tokens,
                           val=id_batches(2, seed=9), precision=precision, eval_every=eval_every,
                           progress=False)  # fmt: skip
        out[precision] = (rep, model)
    return out


def with_sinks(model, value: float = 8.0):
    """Tokens 0 and 1 become massive tokens wherever they occur, as real LLMs' BOS and early delimiters are: their
    embeddings get ``value`` in channels 0-1 (token 0) and 2-3 (token 1), which the residual stream carries to
    every site (an RMS hundreds of times the median token's). Returns the model, changed in place."""
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[0, :2] = value
        emb[1, 2:4] = -value
    return model


def sink_batches(n: int, seed: int = 1, t: int = 16, batch: int = 4) -> list[torch.Tensor]:
    """`id_batches` that start with the sink token 0 and hold the sink token 1 at position 5."""
    out = id_batches(n, seed=seed, t=t, batch=batch)
    for b in out:
        b[:, 0], b[:, 5] = 0, 1
    return out


def file_sha256(path: Path) -> str:
    """A file's SHA-256, hex (written here, not taken from normlab, so a test of normlab's hashes is independent)."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def convert_argv(model, text, *extra) -> list[str]:
    """The argv of a quick ``normlab convert`` of ``model`` calibrated on ``text`` (4 sequences of 16 tokens)."""
    return ["convert", "--model", str(model), "--calibrate", str(text), "--seq-len", "16", "--sequences", "4",
            "--no-progress", *map(str, extra)]  # fmt: skip


TINY_TOKENIZER = Path(__file__).parent / "data" / "tiny_tokenizer.json"


def _train_tiny_tokenizer(path: Path) -> None:
    """Train `tiny_tokenizer`'s BPE on this file's texts and write it to ``path``. The trainer breaks ties between
    equally frequent pairs in hash order, so two trainings differ (chat openings of 52 to 59 tokens, 100 or 102
    ids): the tests read one training, kept in tests/data; delete the file to train it again."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60])  # fmt: skip
    tok.train_from_iterator([TEXT, CALIB, "What is the capital? Write a poem. 0123456789 def f(x): return x"], trainer)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


def tiny_tokenizer():
    """A byte-level BPE tokenizer of 100 ids trained on this file's texts (`_train_tiny_tokenizer`), with a BOS
    ``<s>`` (id 0) and an EOS ``</s>`` (id 1), the sink tokens of `with_sinks`, and a chat template with a default
    system prompt, as SmolLM2's has."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if not TINY_TOKENIZER.exists():
        _train_tiny_tokenizer(TINY_TOKENIZER)
    tok = Tokenizer.from_file(str(TINY_TOKENIZER))
    template = (
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<s>system\nYou are a tiny test model "
        "made for the tests</s>\n{% endif %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=template)


def tiny_hf(path: Path, family: str = "Llama", seed: int = 0) -> Path:
    """`tiny_lm` saved to ``path``."""
    tiny_lm(family, seed).save_pretrained(path)
    return path


@pytest.fixture()
def tmpfs(tmp_path):
    """``mount(size, read_only=False)``: a real tmpfs folder under ``tmp_path`` (a disk of a few hundred kB is a full
    disk), unmounted at the end; the test is skipped where this machine does not let it mount one."""
    import subprocess

    mounted = []

    def mount(size: str = "300k", read_only: bool = False) -> Path:
        path = tmp_path / f"tmpfs{len(mounted)}"
        path.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()})")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


@pytest.fixture()
def models(tmp_path) -> dict:
    """Two tiny Llama models (seeds 0 and 1) and two texts, on disk."""
    text = tmp_path / "calib.txt"
    text.write_text(CALIB)
    other = tmp_path / "other.txt"
    other.write_text("Another text entirely, with other words in it. " * 200)
    return {"m": tiny_hf(tmp_path / "m", seed=0), "m2": tiny_hf(tmp_path / "m2", seed=1), "text": text, "other": other}


def write_experiment(tmp_path: Path, corpus: Path, steps: int, runs=("rms_norm", "dyt")) -> Path:
    """An experiment TOML in ``tmp_path`` training ``runs`` (one per norm) on ``corpus`` for ``steps``."""
    body = f'name = "own"\ntitle = "t"\nclaim = "c"\n[base]\nset = {{ data = ["{corpus}"], steps = {steps} }}\n'
    for r in runs:
        body += f'[[runs]]\nname = "{r}"\nset = {{ "model.norm" = "{r}" }}\n'
    path = tmp_path / "own.toml"
    path.write_text(body)
    return path


def _rms(x, eps):
    return np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def _np(t):
    return None if t is None else t.detach().double().cpu().numpy()


def numpy_reference(name: str, module, x: np.ndarray) -> np.ndarray:
    """The output of ``module`` (a registered norm) on x, computed in float64 NumPy."""
    w = _np(getattr(module, "weight", None))
    b = _np(getattr(module, "bias", None))
    w = 1.0 if w is None else w
    b = 0.0 if b is None else b
    c = x.shape[-1]
    if name == "layer_norm":
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(v + module.eps) * w + b
    if name in ("rms_norm", "rms_detached", "rms_partial_coupling"):
        return x / _rms(x, module.eps) * w
    if name == "rms_ema":
        return x / np.sqrt(float(module.running_ms) + module.eps) * w
    if name == "l1_norm":
        return x / (np.abs(x).mean(-1, keepdims=True) + module.eps) * w
    if name == "lmax_norm":
        return x / (np.abs(x).max(-1, keepdims=True) + module.eps) * w
    if name == "group_rms":
        out = np.empty_like(x)
        g = module.group_size
        for start in range(0, c, g):
            sl = slice(start, min(start + g, c))
            out[..., sl] = x[..., sl] / _rms(x[..., sl], module.eps)
        return out * w
    a = _np(getattr(module, "alpha", None))
    if name == "dyt":
        return w * np.tanh(a * x) + b
    if name == "derf":
        s = _np(module.shift)
        return w * np.vectorize(math.erf)(a * x + s) + b
    if name == "dyt_hardtanh":
        return w * np.clip(a * x, -1.0, 1.0) + b
    if name == "dyt_sigmoid":
        return w * (2.0 / (1.0 + np.exp(-a * x)) - 1.0) + b
    if name == "dyt_rms_denominator":
        return w * np.tanh(a * x / _rms(x, module.eps)) + b
    if name == "scaled_dyt":
        s = math.sqrt(c) if module.scale == "C" else math.sqrt(c - 1)
        return s * np.tanh(a * x) * w + b
    if name == "tanh_fixed":
        return w * np.tanh(x)
    if name == "layer_scale":
        return w * x + b
    if name == "fixed_scale":
        return w * (a * x) + b
    if name == "sign_sqrt":
        return w * np.sign(x) * np.sqrt(np.abs(x) + module.eps) + b
    if name == "dyisru":
        beta = _np(module.beta)
        return math.sqrt(c) * x / np.sqrt(beta + x**2) * w + b
    if name == "eln":
        beta = _np(module.beta)
        xc = x - x.mean(-1, keepdims=True)
        return math.sqrt(c - 1) * xc / np.sqrt(beta + xc**2) * w + b
    raise KeyError(f"no NumPy reference for {name!r}: add one when registering a new norm")


def make_norm(name: str, dim: int, *, dtype=torch.float64, randomize: bool = True, seed: int = 0, **kwargs):
    """A registered norm with non-trivial parameters (so the affine is exercised), in eval mode."""
    torch.manual_seed(seed)
    m = normlab.create_norm(name, dim, **kwargs).to(dtype)
    if randomize:
        with torch.no_grad():
            for pname, p in m.named_parameters():
                if pname == "weight":
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                elif pname == "bias":
                    p.copy_(0.1 * torch.randn_like(p))
                elif pname == "alpha":
                    p.copy_(0.3 + 0.5 * torch.rand_like(p))
                elif pname == "shift":
                    p.copy_(0.2 * torch.randn_like(p))
                elif pname == "log_beta":
                    p.copy_(torch.log(0.5 + 3.0 * torch.rand_like(p)))
        if name == "rms_ema":
            m.running_ms.fill_(0.7)
            m.initialized.fill_(True)
    return m.eval()


ALL_NORMS = normlab.list_norms()


@pytest.fixture(params=ALL_NORMS)
def norm_name(request):
    return request.param


# Runs under `python -I`: no normlab on the import path, and an import of it fails loudly.
LOADER = """
import json, sys, torch, transformers

class NoNormlab:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "normlab":
            raise ImportError("the folder imported normlab")

sys.meta_path.insert(0, NoNormlab())
out = {}
for folder, auto, key in json.loads(sys.argv[1]):
    model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
    case = torch.load(folder + "/case.pt")
    with torch.no_grad():
        got = getattr(model(case["x"]), key)
    out[folder] = {"diff": (got - case["y"]).abs().max().item(), "scale": case["y"].abs().max().item(),
                   "class": type(model).__name__}
    if key == "logits" and auto == "AutoModelForCausalLM":
        out[folder]["generated"] = model.generate(case["x"][:1, :4], max_new_tokens=6, do_sample=False).tolist()
out["normlab_imported"] = any(m.split(".")[0] == "normlab" for m in sys.modules)
print(json.dumps(out))
"""


def load_without_normlab(cases: list, tmp_path) -> dict:
    """Load converted folders with transformers alone, in a `python -I` process that fails on importing normlab.
    ``cases``: (folder, Auto class name, output key) each, with ``case.pt`` ({"x": input, "y": expected output})
    in the folder; returns per folder the largest difference, the class built and, for a causal LM, 6 greedy
    tokens after the first 4 of x's first row; and whether normlab was imported."""
    env = {"HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    # this process's thread count and kernels: a matmul split over other threads, or vectorized otherwise, sums in
    # another order (a CI run on AVX2 cores, its loader on two threads against the worker's one, was 1e-4 apart)
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    isa = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    env.update({k: os.environ[k] for k in isa if k in os.environ})
    proc = subprocess.run(
        [sys.executable, "-I", "-c", LOADER, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def second_venv(needs: str) -> Path:
    """The torch 2.14.1 venv ``make titan`` builds (torchtitan, timm; ``NORMLAB_TITAN_VENV`` names another): its
    folder, or the calling test module skipped where it is missing, and an error under CI, which must run it."""
    venv = Path(os.environ.get("NORMLAB_TITAN_VENV") or Path(__file__).resolve().parents[1] / ".venv-titan")
    if (venv / "bin" / "python").exists():
        return venv
    if os.environ.get("CI"):
        raise RuntimeError(f"{venv} has no python: `make titan` builds the venv with {needs}, which `make test` needs")
    pytest.skip(f"no {needs} venv at {venv} (make titan)", allow_module_level=True)
