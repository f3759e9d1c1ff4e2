"""The theory subcommands: ``demo``, ``jacobian``, ``gain``, ``simulate``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from normlab.cli.args import count, finite, output_file, parse_init, positive, write_json
from normlab.table import format_table

__all__ = ["add_demo", "add_jacobian", "add_gain", "add_simulate"]


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


def _cmd_jacobian(args: argparse.Namespace) -> int:
    from normlab.registry import init_kwargs
    from normlab.theory.jacobian import jacobian_table

    init = parse_init(args.init) if args.init is not None else {"alpha_init": 1.0}  # the dissection's alpha = 1
    if args.init is None and not any("alpha_init" in init_kwargs(n) for n in args.norm):
        init = {}  # the default goes to the norms that take it; a user's key must be taken by one
    output_file(args.json, "--json")
    rows = jacobian_table(args.norm, args.width, std=args.std, init=init, tokens=args.tokens, seed=args.seed)
    print(f"Per-token Jacobian norms at input std {args.std}, gamma = 1, mean over {args.tokens} token(s)\n")
    table = [
        [
            r["width"],
            r["norm"],
            ", ".join(f"{k}={v}" for k, v in r["init"].items()) or "default",
            r["diag"],
            r["coupling"],
            r["total"],
            r["split"],
        ]
        for r in rows
    ]
    headers = ["width", "norm", "init", "|J_diag|_F", "|J_coupling|_F", "|J_total|_F", "split"]
    print(format_table(headers, table, markdown=args.markdown))
    write_json(rows, args.json)
    return 0


def _cmd_gain(args: argparse.Namespace) -> int:
    import numpy as np

    from normlab.theory.gain import gain_curves, rms_norm_gain
    from normlab.theory.plots import plot_gain

    init = parse_init(args.init) if args.init is not None else {"alpha_init": 1.0}  # the dissection's alpha = 1
    if args.sigma_min >= args.sigma_max:
        raise ValueError(f"--sigma-min {args.sigma_min} must be below --sigma-max {args.sigma_max}")
    limit = float(np.sqrt(np.finfo(np.float64).max / args.width)) / 1e3  # tokens of width d, a few sigmas out
    if not args.sigma_max < limit:
        raise ValueError(
            f"--sigma-max {args.sigma_max:g}: the norms' mean square of {args.width} channels at that std overflows "
            f"float64 (every G would read 0 or NaN); keep it below {limit:.2g}"
        )
    from normlab.registry import init_kwargs

    idle = sorted(set(init) - {k for n in args.norm for k in init_kwargs(n)}) if args.init is not None else []
    if idle:
        raise ValueError(f"--init {idle[0]}: none of {', '.join(args.norm)} takes it")
    output_file(args.out, "--out")
    output_file(args.json, "--json")
    sigmas = np.logspace(np.log10(args.sigma_min), np.log10(args.sigma_max), args.points)
    curves, limits = gain_curves(args.norm, sigmas, dim=args.width, init=init, samples=args.samples, seed=args.seed)
    rows = [
        {"norm": name, "sigma": float(s), "gain": float(g), "theorem1_limit": limits[name]}
        for name in curves
        for s, g in zip(sigmas, curves[name][0])
    ]
    from normlab.functional import EPS

    eps = init.get("eps", EPS)
    path = plot_gain(
        curves,
        sigmas,
        args.out,
        dim=args.width,
        limits=limits,
        rms_closed_form=rms_norm_gain(sigmas, eps) if "rms_norm" in args.norm else None,
    )
    picks = sorted({0, len(sigmas) // 2, len(sigmas) - 1})
    headers = ["norm", *(f"G({sigmas[i]:.3g})" for i in picks), "Thm 1 limit |f'(0)|"]
    table = [[n, *(float(curves[n][0][i]) for i in picks), "-" if limits[n] is None else limits[n]] for n in curves]
    if "rms_norm" in curves:
        table.append(["Thm 2: 1/sqrt(s^2+eps)", *(float(rms_norm_gain(sigmas[i], eps)) for i in picks), "-"])
    print(format_table(headers, table, markdown=args.markdown))
    print(f"wrote {path}")
    write_json(rows, args.json)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import numpy as np

    from normlab.theory.plots import plot_outlier_fit, plot_outlier_steps
    from normlab.theory.simulate import Sample, load_vector, simulate_many, simulate_outliers

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; simulate writes a folder (figures, sample.npy, simulate.json)")
    from normlab.owner import check_writable

    check_writable(args.out, "--out")
    x = load_vector(args.x) if args.x else None
    common = dict(step=args.step, steps=args.steps, norm=args.norm, scale=args.scale)
    drawn = Sample(args.C, args.sigma, args.mu, args.seed)
    sim = simulate_outliers(drawn if x is None else x, **common)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = f"sample from {args.x}" if x is not None else f"seed {args.seed}, sigma {args.sigma}, mu {args.mu}"
    print(
        f"Outlier simulation ({sim.norm}, C={sim.C}, {src}, step {sim.step}, S=1..{sim.steps}), "
        f"fitted amplitude sqrt({sim.scale})\n"
    )
    rows = []
    for f in (sim.dyt, sim.dyisru):
        status = "ok" if f.converged else f"FAILED: {f.message}"
        rows.append([f.kind, f.param_name, f.param.item(), f.mean_abs_residual, status])
    if sim.reference_beta is not None:
        rows.append(
            [
                "dyisru (Theorem 3)",
                "beta",
                sim.reference_beta,
                sim.reference_mean_abs_residual,
                "beta = ||x without outlier||^2",
            ]
        )
    print(format_table(["fit", "param", "value", "mean |residual|", "status"], rows, markdown=args.markdown))
    seed_doc = "the DyISRU paper, " + ("RMSNorm" if sim.norm == "rms_norm" else "its LayerNorm version")
    print(f"paper ({seed_doc}, one sample): alpha = 0.049, beta = 301.1, mean |residual| 0.33 (DyT), < 0.01 (DyISRU)")
    result = sim.to_dict()
    if args.seeds > 1 and x is None:
        many = simulate_many(range(args.seeds), drawn, **common)
        result["over_seeds"] = many
        print(f"\nover {args.seeds} seeds (mean +- std, [min, max]):")
        table = [[k, v["mean"], v["std"], v["min"], v["max"]] for k, v in many["stats"].items()]
        print(format_table(["quantity", "mean", "std", "min", "max"], table, markdown=args.markdown))
        if many["failed"]:
            print(f"fits failed for seeds {many['failed']}")
    np.save(out / "sample.npy", sim.x)
    for p in (plot_outlier_steps(sim, out / "outlier_steps.png"), plot_outlier_fit(sim, out / "outlier_fit.png")):
        print(f"wrote {p}")
    write_json(result, str(out / "simulate.json"))
    return 0


def add_demo(sub) -> None:
    d = sub.add_parser("demo", help="print the table of every registered norm on one input")
    d.add_argument("--dim", type=count, default=256, help="channels C of the token (default 256)")
    d.add_argument("--std", type=positive, default=0.02, help="input std; 0.02 is GPT-2 init's residual stream")
    d.add_argument("--seed", type=int, default=0, help="random seed of the input")
    d.add_argument("--markdown", action="store_true", help="print a Markdown table")
    d.set_defaults(func=_cmd_demo)


def add_jacobian(sub) -> None:
    j = sub.add_parser("jacobian", help="the dissection's table: Frobenius norms of the Jacobian's two parts")
    j.add_argument("--norm", nargs="+", default=["rms_norm", "dyt"], help="registered norm names")
    j.add_argument("--width", nargs="+", type=count, default=[1024, 2048], help="channel counts")
    j.add_argument("--std", type=positive, default=0.02, help="input std (0.02: GPT-2 init)")
    j.add_argument(
        "--init",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="init values, for each norm that takes them (default: alpha_init=1.0, as the dissection)",
    )
    j.add_argument("--tokens", type=count, default=4, help="tokens to average over")
    j.add_argument("--seed", type=int, default=0, help="random seed of the input")
    j.add_argument("--json", help="also write the rows to this JSON file")
    j.add_argument("--markdown", action="store_true", help="print a Markdown table")
    j.set_defaults(func=_cmd_jacobian)


def add_gain(sub) -> None:
    g = sub.add_parser("gain", help="the dissection's forward gain G(sigma), Monte Carlo, as a log-log plot")
    g.add_argument(
        "--norm",
        nargs="+",
        default=["rms_norm", "l1_norm", "dyt", "dyt_hardtanh", "dyisru", "sign_sqrt"],
        help="registered norm names",
    )
    g.add_argument("--width", type=count, default=1024, help="channels d")
    g.add_argument("--sigma-min", type=positive, default=1e-3, help="smallest input std of the curve")
    g.add_argument("--sigma-max", type=positive, default=10.0, help="largest input std of the curve")
    g.add_argument("--points", type=count, default=17, help="sigmas on the log grid")
    g.add_argument("--samples", type=count, default=64, help="Monte Carlo tokens per sigma")
    g.add_argument(
        "--init",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="init values, applied to each norm that takes them (default alpha_init=1.0)",
    )
    g.add_argument("--seed", type=int, default=0, help="random seed of the Monte Carlo samples")
    g.add_argument("--out", default="out/gain.png", help="PNG to write")
    g.add_argument("--json", help="also write the curves to this JSON file")
    g.add_argument("--markdown", action="store_true", help="print a Markdown table")
    g.set_defaults(func=_cmd_gain)


def add_simulate(sub) -> None:
    s = sub.add_parser("simulate", help="the DyISRU paper's outlier simulation, with DyT and DyISRU fits")
    s.add_argument(
        "--norm",
        choices=["rms_norm", "layer_norm"],
        default="rms_norm",
        help="normalization simulated: rms_norm (the DyISRU paper) or layer_norm (its LayerNorm version)",
    )
    s.add_argument("--C", type=int, default=100, help="channels (default 100, as in the papers)")
    s.add_argument("--sigma", type=positive, default=2.0, help="std of the sample (default 2)")
    s.add_argument("--mu", type=finite, default=0.0, help="mean of the sample (default 0)")
    s.add_argument("--step", type=positive, default=5.0, help="outlier step size (default 5)")
    s.add_argument("--steps", type=count, default=9, help="number of steps S (default 9)")
    s.add_argument(
        "--scale",
        choices=["C", "C-1"],
        help="fitted amplitude sqrt(C) or sqrt(C-1) (default: C for rms_norm, C-1 for layer_norm, as in the papers)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the sample")
    s.add_argument("--x", help="use this sample instead (.npy, .json or text: C numbers); overrides C/sigma/mu/seed")
    s.add_argument("--seeds", type=count, default=1, help="also report the spread of the fits over this many seeds")
    s.add_argument("--out", default="out/simulate", help="folder for figures, sample.npy and simulate.json")
    s.add_argument("--markdown", action="store_true", help="print a Markdown table")
    s.set_defaults(func=_cmd_simulate)
