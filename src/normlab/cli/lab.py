"""The lab's subcommands: ``train``, ``predict``, ``sweep``, ``report``, ``reproduce``."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from normlab.cli.args import count
from normlab.table import format_table

__all__ = ["add_train", "add_predict", "add_sweep", "add_report", "add_reproduce"]


def _cmd_train(args: argparse.Namespace) -> int:
    from normlab.lab import resolve_config, train

    cfg = resolve_config(args.preset, args.set, norm=args.norm, out=args.out, data=args.data or None)
    if args.out is None and "out" not in {item.partition("=")[0] for item in args.set or []}:
        cfg.out = f"runs/{args.preset}-{cfg.model.norm}"  # the norm it trains, set by --norm or model.norm=
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        print(
            f"normlab train: preset {args.preset}, norm {cfg.model.norm}, {cfg.model.depth} x {cfg.model.width}, "
            f"{cfg.steps} steps -> {cfg.out}"
        )
        print(json.dumps(cfg.to_dict(), sort_keys=True))
    again = [a for a in args.argv if a != "--overwrite"]
    again = " ".join(shlex.quote(a) for a in ["normlab", *again, *([] if args.resume else ["--resume"])])
    summary = train(
        cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress, resume_command=again
    )
    if summary["status"] == "interrupted":
        if is_main:
            print(
                f"interrupted ({summary['signal']}) at step {summary['interrupted_at']}; the checkpoint is saved. "
                f"Resume with:\n  {again}",
                file=sys.stderr,
            )
        return 130 if summary["signal"] == "SIGINT" else 143  # the shell's convention: 128 + signal number
    if is_main:
        keys = ["status", "final_train_loss", "final_val_loss", "unigram_entropy", "gap_to_unigram_entropy",
                "escape_step", "tokens_per_s"]  # fmt: skip
        print(format_table(["field", "value"], [[k, summary.get(k)] for k in keys]))
    return 0 if summary["status"] in ("completed", "diverged") else 1


def _cmd_predict(args: argparse.Namespace) -> int:
    """Each config's prediction at init: the dissection's alpha * RMS, the logits' scale, and the predicted side."""
    from normlab.lab import resolve_config
    from normlab.lab.phase import ESCAPE_THRESHOLD, predict

    rows = []
    for norm in args.norm:
        cfg = resolve_config(args.preset, args.set, norm=norm)
        p = predict(cfg.model, seed=cfg.seed)
        cells = [f"{p[k]:.4g}" for k in ("rms_in", "alpha_rms", "rms_out", "logit_gain")]
        rows.append([norm, *cells, "escapes" if p["predicted_escape"] else "stays at the attractor"])
    print(
        format_table(
            ["norm", "RMS(block 0 input)", "alpha x RMS", "RMS(norm output)", "logit scale / RMSNorm's", "predicted"],
            rows,
        )
    )
    print(
        f"predicted boundary, for a short budget (the default profile's 250 steps): the logits' std at init at "
        f"least {ESCAPE_THRESHOLD:g} x RMSNorm's at GPT-2 init (0.02 sqrt(C)). A run below it sits on the attractor "
        "longer, not forever: see the phase experiment of `normlab reproduce` and docs/results.md"
    )
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from normlab.owner import check_folder
    from normlab.sweep import Workers, builtin_experiments, expand, load_experiment, parse_shard, run_sweep, write_index

    shard = parse_shard(args.shard)  # every argument checked before index.json is written
    check_folder(args.root, "--root")
    exps = [load_experiment(e) for e in (args.experiment or builtin_experiments(args.profile))]
    specs = [s for e in exps for s in expand(e, args.profile, args.root)]
    write_index(exps, args.profile, args.root)
    statuses = run_sweep(specs, workers=Workers(args.jobs, shard), progress=not args.no_progress)
    rows = [[k, list(statuses.values()).count(k)] for k in sorted(set(statuses.values()))]
    print(format_table(["status", "runs"], rows))
    print(f"results in {args.root}; write the report with: normlab report --root {args.root}")
    failed = sum(1 for v in statuses.values() if v == "failed")
    if failed:
        print(
            f"normlab sweep: {failed} run(s) failed (each run's summary.json holds its error); run the same "
            "command again to retry them",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from normlab.report import write_report

    print(f"wrote {write_report(args.root, compare=args.compare)}")
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from normlab.reproduce import reproduce
    from normlab.sweep import Workers, parse_shard

    profile = args.profile or (
        "gpu"
        if args.preset == "gpu"
        else "quick"
        if args.quick
        else "long"
        if args.long
        else "full"
        if args.full
        else "default"
    )
    root = args.root or f"runs/reproduce-{profile}"
    compare = args.compare
    if compare is None and profile == "long" and (Path(root).parent / "reproduce-default" / "index.json").exists():
        compare = Path(root).parent / "reproduce-default"  # the long budget is read against the default one
    reproduce(
        root,
        profile,
        experiments=args.experiment,
        workers=Workers(args.jobs, parse_shard(args.shard)),
        progress=not args.no_progress,
        compare=compare,
    )
    return 0


def add_train(sub) -> None:
    from normlab.lab.config import PRESETS

    t = sub.add_parser("train", help="train the lab's GPT with a registered norm (torchrun for several processes)")
    t.add_argument("--norm", help="norm at every site (default rms_norm); per-site: --set model.norm_attn=...")
    t.add_argument(
        "--preset",
        default="cpu",
        choices=list(PRESETS),
        help="tiny: seconds; small: 4 x 64, 250 steps (reproduce's default); cpu: 4 x 128, minutes; "
        "gpu: 24 x 1024; gpu-wide: 5 x 2048",
    )
    t.add_argument(
        "--set",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override config fields, e.g. lr=1e-3 model.width=256 model.norm_kwargs.alpha_init=1.0",
    )
    t.add_argument("--data", nargs="+", help="your own text files (default: the Shakespeare plays, fetched once)")
    t.add_argument("--out", help="run directory (default runs/<preset>-<norm>)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    t.add_argument("--overwrite", action="store_true", help="start over in an --out that already holds a run")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_cmd_train)


def add_predict(sub) -> None:
    from normlab.lab.config import PRESETS

    pr = sub.add_parser("predict", help="will a point-wise norm leave the unigram attractor? its signal scale at init")
    pr.add_argument(
        "--norm",
        nargs="+",
        default=["rms_norm", "dyt", "derf", "scaled_dyt", "dyisru"],
        help="registered norm names, each predicted in turn",
    )
    pr.add_argument("--preset", default="cpu", choices=list(PRESETS), help="the lab preset whose model is built")
    pr.add_argument(
        "--set",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="config fields, as for train, e.g. model.embed_scale=sqrt_d model.init_std=0.16",
    )
    pr.set_defaults(func=_cmd_predict)


def add_sweep(sub) -> None:
    from normlab.profiles import PROFILES
    from normlab.sweep import default_jobs

    sw = sub.add_parser("sweep", help="run experiments (TOML tables of runs); finished runs are skipped")
    sw.add_argument("experiment", nargs="*", help="built-in names or .toml paths (default: all built-in)")
    sw.add_argument("--profile", default="default", choices=list(PROFILES), help="scale of every run")
    sw.add_argument("--root", default="runs/sweep", help="folder for runs/, index.json and the report")
    sw.add_argument("--shard", help="i/n: run only every n-th run starting at i (job arrays, several GPUs)")
    sw.add_argument("--jobs", type=count, default=default_jobs(), help="runs at a time (default: CPU cores; 1 on GPU)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar")
    sw.set_defaults(func=_cmd_sweep)


def add_report(sub) -> None:
    rp = sub.add_parser("report", help="write REPORT.md with tables and figures from a sweep root")
    rp.add_argument("--root", default="runs/reproduce-default", help="the sweep root to report on")
    rp.add_argument("--compare", help="root of the same experiments at another budget: state each verdict at both")
    rp.set_defaults(func=_cmd_report)


def add_reproduce(sub) -> None:
    from normlab.profiles import PROFILES
    from normlab.sweep import default_jobs

    rr = sub.add_parser("reproduce", help="theory checks + every table of the dissection at CPU scale + REPORT.md")
    size = rr.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a tiny model, one seed: about 3 minutes")
    size.add_argument("--long", action="store_true", help="the default's shapes at 4x its tokens, three seeds")
    size.add_argument("--full", action="store_true", help="every run at the lab's cpu preset (hours on 2 cores)")
    size.add_argument("--preset", choices=["gpu"], help="the dissection's shapes on a GPU")
    size.add_argument(
        "--profile",
        choices=list(PROFILES),
        help="a profile by name; 'scaling': the scaling study "
        "alone (hours; scripts/scaling_study.py runs it resumably into bench/)",
    )
    rr.add_argument("--experiment", nargs="*", help="subset of experiments (default: all)")
    rr.add_argument("--root", help="output folder (default runs/reproduce-<profile>)")
    rr.add_argument("--compare", help="root of another budget's runs (--long: runs/reproduce-default if present)")
    rr.add_argument("--shard", help="i/n, as for sweep")
    rr.add_argument("--jobs", type=count, default=default_jobs(), help="runs at a time")
    rr.add_argument("--no-progress", action="store_true", help="no progress bar")
    rr.set_defaults(func=_cmd_reproduce)
