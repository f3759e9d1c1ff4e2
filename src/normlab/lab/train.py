"""The trainer: AdamW, warmup + cosine, clipping, evaluation, metrics, checkpoints, resume, DDP.

The run folder, its files and its rules (one live run, no silent restart, no rewritten results) are
``normlab.lab.runs``. SIGINT (Ctrl-C) and SIGTERM end a run cleanly: a checkpoint at the step reached,
``status: interrupted`` and the command that resumes it.

Scale-out: launched by ``torchrun --nproc_per_node N``, the model is wrapped in DDP
(gloo on CPU, NCCL on GPU); each rank draws its own batches; rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from normlab.errors import NormlabError, check_cpu_bf16
from normlab.kernels.inductor_cache import use_cache_of_this_cpu
from normlab.lab.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from normlab.lab.config import TrainConfig
from normlab.lab.data import get_batch, load_corpus
from normlab.lab.metrics import Probe, init_telemetry, norm_parameters, projection_ranks
from normlab.lab.model import GPT
from normlab.lab.optim import build_optimizer, lr_at
from normlab.lab.quant import outlier_stats, quant_gaps
from normlab.lab.runs import CONFIG, METRICS, SUMMARY, VERSION, RunFolder, escape_step, read_jsonl
from normlab.version import code_version

__all__ = ["train", "CheckpointError"]


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------
def _setup_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available; use device=cpu or auto")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if want_cuda else "gloo")
    if want_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig, device, autocast) -> float:
    model.eval()
    losses = []
    for i in range(cfg.eval_batches):
        x, y = get_batch(data, (cfg.batch_size, cfg.model.context), seed=cfg.seed, step=i, salt=1)
        with autocast():
            losses.append(float(model(x.to(device), y.to(device))[1]))
    model.train()
    return sum(losses) / len(losses)


class _Interrupt:
    """SIGINT / SIGTERM set a flag that the loop reads after each step; a second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user means it
        self.signum = signum
        tqdm.write(
            f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
            "(Ctrl-C again to stop at once)"
        )

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Log:
    """Rows of metrics.jsonl (rank 0 writes), mirrored to TensorBoard with ``tensorboard=true``."""

    def __init__(self, folder: RunFolder, tensorboard: bool, main: bool) -> None:
        self.folder, self.main, self.writer = folder, main, None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("tensorboard=true needs the tensorboard package: pip install tensorboard") from None
            self.writer = SummaryWriter(str(folder.path / "tb"))

    def __call__(self, record: dict) -> None:
        if not self.main:
            return
        self.folder.append_metrics(record)
        if self.writer:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.writer:
            self.writer.close()


@dataclass(frozen=True)
class _Place:
    """Where a run trains: its config, its folder, its data, and this process's rank among ``world`` on ``device``."""

    cfg: TrainConfig
    folder: RunFolder
    corpus: object
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's training batch for ``step``, on the device."""
        shape = (self.cfg.batch_size, self.cfg.model.context)
        x, y = get_batch(self.corpus.train, shape, seed=self.cfg.seed, step=step, rank=self.rank)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


@dataclass(frozen=True)
class _Net:
    """The model as the loop holds it: ``model`` (DDP-wrapped across ranks), ``fwd`` (compiled if asked), ``raw``
    (the bare model), its optimizer, and the autocast context."""

    model: torch.nn.Module
    fwd: object
    raw: torch.nn.Module
    opt: torch.optim.Optimizer
    autocast: object


def _step(place: _Place, net: _Net, step: int, probing: bool):
    """One optimizer step at ``step`` on that step's batch; returns the loss and, when probing, the Probe that
    measured it."""
    cfg, opt = place.cfg, net.opt
    lr = lr_at(step, cfg)
    for group in opt.param_groups:  # AdamW's groups take lr_at itself; Muon's the same fraction of its peak
        peak = group.get("peak_lr", cfg.lr)
        group["lr"] = lr if peak == cfg.lr else peak * lr / cfg.lr
    x, y = place.batch(step)
    probe = Probe(net.raw, cfg.jacobian_site) if probing else None
    with probe or contextlib.nullcontext():
        with net.autocast():
            _, loss = net.fwd(x, y)
        loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(net.model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, probe


def _held_out_batch(place: _Place) -> torch.Tensor:
    """The first validation batch's inputs (the evaluation's), on the device: what the outlier statistics read."""
    x, _ = get_batch(
        place.corpus.val, (place.cfg.batch_size, place.cfg.model.context), seed=place.cfg.seed, step=0, salt=1
    )
    return x.to(place.device)


def _outliers(place: _Place, net: _Net) -> dict[str, float]:
    """Outlier statistics of the residual stream and the linear layers' inputs on the held-out batch
    (`normlab.lab.quant.outlier_stats`), logged at each evaluation."""
    with net.autocast():
        return outlier_stats(net.raw, _held_out_batch(place))


def _quantized(place: _Place, net: _Net) -> dict[str, float]:
    """At the end of a completed run: the last outlier statistics' means, and the held-out loss gap under each
    fake-quantization scheme (`normlab.lab.quant.quant_gaps`; three more evaluations), for the summary."""
    cfg, raw = place.cfg, net.raw
    stats = {k: v for k, v in _outliers(place, net).items() if "/" not in k}
    calib, _ = get_batch(place.corpus.train, (cfg.batch_size, cfg.model.context), seed=cfg.seed, step=0, salt=2)
    with net.autocast():
        gaps = quant_gaps(
            raw, lambda: evaluate(raw, place.corpus.val, cfg, place.device, net.autocast), calib.to(place.device)
        )
    return {**stats, **gaps}


def _model_and_optimizer(cfg: TrainConfig, folder: RunFolder, device, resume: bool, main: bool):
    """The model and its AdamW, fresh or from the run's checkpoint (with the RNG state and the metrics cut back to
    the checkpoint's step); returns them and the step to start from."""
    from normlab.kernels import auto_choice, cpu

    if device.type == "cpu" and cfg.model.norm_kwargs.get("kernel", auto_choice()) != "reference":
        cpu.ready(wait=True)  # one path from the first step: the one-time build (if any) happens now
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    opt = build_optimizer(model, cfg, device)
    if not (resume and folder.checkpoint.exists()):
        return model, opt, 0
    state = load_checkpoint(folder.checkpoint, cfg)
    if state["step"] > cfg.steps:
        raise ValueError(
            f"--resume: the checkpoint in {folder.path} is at step {state['step']}, beyond steps = "
            f"{cfg.steps} (the run was started for {state['config'].get('steps')}); resume with "
            f"--set steps=N for N >= {state['step']}"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    if main:
        folder.truncate_metrics(state["step"])
    return model, opt, state["step"]


def _begin_fresh_run(place: _Place, model, log) -> None:
    """A run from step 0: the data-dependent init (``model.norm_init``), then the mechanism's numbers at init,
    logged as the row of step 0 (``normlab.lab.metrics.init_telemetry``)."""
    x0, _ = place.batch(0)
    if place.cfg.model.norm_init == "match_rms":
        model.match_rms_(x0)
        if place.world > 1:  # every rank starts from rank 0's gammas
            for p in model.parameters():
                dist.broadcast(p.data, 0)
    if place.rank == 0:
        log({"step": 0, **init_telemetry(model, x0)})


def _summarize(summary: dict, folder: RunFolder, entropy: float) -> None:
    """The summary's fields read from the metrics on disk: the last train loss (a diverged run's stays NaN),
    the median tokens/s, the last effective ranks, and the escape step."""
    if not folder.file(METRICS).exists():
        return
    rows = read_jsonl(folder.file(METRICS))
    train_rows = [r for r in rows if r.get("train_loss") is not None]
    if train_rows and summary["status"] != "diverged":
        summary["final_train_loss"] = train_rows[-1]["train_loss"]
    speeds = [r["tokens_per_s"] for r in train_rows if "tokens_per_s" in r]
    summary["tokens_per_s"] = sorted(speeds)[len(speeds) // 2] if speeds else None
    summary.update({k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("erank")})
    summary["escape_step"] = escape_step(rows, entropy)


def _check_buildable(cfg: TrainConfig, corpus) -> None:
    """What only building the model or reading the data can tell, checked before any folder is touched: the
    norms' init values, the vocabulary against the corpus's bytes, and the optional packages the config asks for."""
    top = max(int(corpus.train.max()), int(corpus.val.max()))
    if top >= cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size = {cfg.model.vocab_size} is below the corpus's byte range: {corpus.name} "
            f"holds byte {top}; use model.vocab_size >= {top + 1} (256 covers every byte)"
        )
    try:
        with torch.device("meta"):  # no memory, no time: the constructors' own checks
            n = sum(p.numel() for p in GPT(cfg.model).parameters())
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"model: the config does not build a model ({type(e).__name__}: {e})") from None
    from normlab.errors import check_memory

    tokens = cfg.batch_size * cfg.model.context  # weights, gradients, two moments; the activations of a step
    check_memory(
        16 * n + 4 * tokens * (cfg.model.vocab_size + 24 * cfg.model.width * cfg.model.depth),
        f"training {n / 1e6:.0f}M parameters at batch_size={cfg.batch_size} x context={cfg.model.context}",
        "use a smaller model.width, model.depth, batch_size or model.context",
    )
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError("tensorboard=true needs the tensorboard package: pip install tensorboard") from None


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    resume_command: str | None = None,
) -> dict:
    """Train one run; returns its summary.

    A diverged run returns status 'diverged', it does not raise. SIGINT / SIGTERM return status
    'interrupted' after a checkpoint; ``resume_command`` is the command recorded to continue it.
    Everything that can be checked (config, device, data splits, the run folder's rules) is checked
    before the first step; a config that fails creates no folder.

    Args:
        cfg: The run's config.
        resume: Continue the run in ``cfg.out`` from its checkpoint.
        overwrite: Start over in a folder that holds a run.
        progress: Show a progress bar.
        resume_command: The command recorded to continue an interrupted run.
    """
    cfg.validate()
    for d in cfg.data:  # inputs are never outputs: a text that a fresh start (--overwrite) would clear is refused
        hit = RunFolder(cfg.out).clears(d)
        if hit is not None:
            raise ValueError(
                f"data: {d} is the run's own {hit} in out = {cfg.out}, which a fresh start clears; "
                "move the text out of the run folder, or choose another out"
            )
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    for split, data in (("train", corpus.train), ("validation", corpus.val)):
        if len(data) <= cfg.model.context + 1:
            raise ValueError(
                f"data: the {split} split of {corpus.name} has {len(data)} bytes, not more than "
                f"model.context + 1 = {cfg.model.context + 1}; use more text, a smaller context, "
                "or another val_fraction"
            )
    _check_buildable(cfg, corpus)
    rank, world, device = _setup_distributed(cfg)
    if device.type == "cpu" and cfg.amp == "bf16":
        check_cpu_bf16()
    main = rank == 0
    folder = RunFolder(cfg.out)
    place = _Place(cfg, folder, corpus, rank, world, device)
    if not main:
        return _train(place, resume, progress, resume_command)
    folder.create()
    with folder:  # the lock: one live run per folder
        resume = folder.begin(resume=resume, overwrite=overwrite, steps=cfg.steps)
        try:
            return _train(place, resume, progress, resume_command)
        except OSError as e:  # a write failed (a full disk, a quota): say so in the summary, if it can be written
            again = resume_command or f"train(cfg, resume=True) with cfg.out = {str(folder.path)!r}"
            try:
                folder.write_json(
                    SUMMARY, {**(folder.summary() or {}), "status": "failed", "error": str(e), "resume": again}
                )
            except OSError:
                pass
            raise NormlabError(f"{e}. Free space, then resume with: {again}") from None


def _wrap(model, cfg: TrainConfig, device, world: int):
    """The model as the loop runs it: DDP across ranks, compiled if asked; and the autocast context (bf16 when
    asked, or on CUDA by default)."""
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if cfg.compile:
        use_cache_of_this_cpu()
    fwd = torch.compile(model) if cfg.compile else model
    use_bf16 = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    return model, fwd, autocast


def _logged_val_loss(folder: RunFolder, step: int) -> float | None:
    """The validation loss the metrics log holds for ``step``, if any."""
    found = (
        r["val_loss"] for r in reversed(folder.metrics()) if r.get("step") == step and r.get("val_loss") is not None
    )
    return next(found, None)


def _open_run(folder: RunFolder, cfg: TrainConfig, corpus, world: int, device, main: bool) -> dict:
    """The run's first files (its identity, config and a running summary, on rank 0); returns the summary."""
    summary = {"status": "running", "name": folder.path.name, "norm": cfg.model.norm,
               "unigram_entropy": corpus.unigram_entropy, "corpus": corpus.name, "train_bytes": len(corpus.train),
               "world_size": world, "device": str(device), "steps": cfg.steps}  # fmt: skip
    if main:
        folder.write_json(VERSION, code_version())  # first: the identity that marks the folder as a run
        folder.write_json(CONFIG, cfg.to_dict())
        folder.write_json(SUMMARY, summary)
    return summary


def _train(place: _Place, resume: bool, progress: bool, resume_command: str | None) -> dict:
    cfg, folder, corpus, main = place.cfg, place.folder, place.corpus, place.main
    world, device = place.world, place.device
    out = folder.path
    entropy = corpus.unigram_entropy
    raw_model, opt, start = _model_and_optimizer(cfg, folder, device, resume, main)
    model, fwd, autocast = _wrap(raw_model, cfg, device, world)
    net = _Net(model, fwd, raw_model, opt, autocast)

    summary = _open_run(folder, cfg, corpus, world, device, main)
    log = _Log(folder, cfg.tensorboard and main, main)

    tokens_per_step = cfg.batch_size * cfg.model.context * world
    bar = tqdm(
        total=cfg.steps, initial=start, disable=not (main and progress), desc=out.name, unit="step", dynamic_ncols=True
    )
    if start == 0:
        _begin_fresh_run(place, raw_model, log)
    train_time, loss_sum, n_loss, last_val, step = 0.0, 0.0, 0, None, start
    model.train()
    with _Interrupt() as interrupt:
        while step < cfg.steps:
            t0 = time.perf_counter()
            probing = main and (step + 1) % cfg.metrics_every == 0
            loss, probe = _step(place, net, step, probing)
            step += 1
            loss_sum += float(loss.detach())  # the one sync per step; the divergence check needs it
            n_loss += 1
            train_time += time.perf_counter() - t0  # tokens/s counts training work, not evaluation or checkpoints
            if not math.isfinite(loss_sum):
                summary.update(status="diverged", diverged_at=step, final_train_loss=float("nan"))
                log({"step": step, "train_loss": None, "diverged": True})
                if main:
                    tqdm.write(f"{out.name}: loss is not finite at step {step}; run marked 'diverged'")
                break
            record = {}
            if step % cfg.log_every == 0 or step == cfg.steps:
                tok_s = tokens_per_step * n_loss / train_time
                record.update(train_loss=loss_sum / n_loss, lr=lr_at(step - 1, cfg), tokens_per_s=tok_s)
                bar.set_postfix(loss=f"{loss_sum / n_loss:.3f}", tok_s=f"{tok_s:.0f}")
                loss_sum, n_loss, train_time = 0.0, 0, 0.0
            if probing:
                record.update(probe.results(), **projection_ranks(raw_model), **norm_parameters(raw_model))
            if step % cfg.eval_every == 0 or step == cfg.steps:
                last_val = evaluate(fwd, corpus.val, cfg, device, autocast)
                record.update(val_loss=last_val, **(_outliers(place, net) if main else {}))
            if record:
                log({"step": step, **record})
            stopping = interrupt.signum is not None
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
                if main:
                    save_checkpoint(folder.checkpoint, raw_model, opt, step, cfg)
                if world > 1:
                    dist.barrier()
            bar.update(1)
            if stopping and step < cfg.steps:
                summary.update(
                    status="interrupted",
                    interrupted_at=step,
                    signal=signal.Signals(interrupt.signum).name,
                    resume=resume_command or f"train(cfg, resume=True) with cfg.out = {str(out)!r}",
                )
                break
    bar.close()

    if summary["status"] == "running":
        if last_val is None and main:  # resumed at the final checkpoint: its evaluation is on disk (else made now)
            last_val = _logged_val_loss(folder, step)
            if last_val is None:
                last_val = evaluate(fwd, corpus.val, cfg, device, autocast)
        summary.update(status="completed", final_val_loss=last_val, steps_done=step)
    summary["gap_to_unigram_entropy"] = (last_val - entropy) if last_val is not None else None
    if main:
        summary.update(_quantized(place, net) if summary["status"] == "completed" else {})
        _summarize(summary, folder, entropy)
        folder.write_json(SUMMARY, summary)
    log.close()
    if world > 1:
        dist.barrier()
    return summary
