"""Conversion studies as data: a grid of ``normlab convert`` settings in a TOML file, run into locked, resumable
cells, with the targets they must meet written as checks.

    normlab study budget_walk --root runs/            # a built-in study (normlab/experiments/convert/*.toml)
    normlab study my_study.toml --only walk-0.4       # a file of your own; one of its cells

A study file::

    title = "What the budget walk keeps on SmolLM2"
    claim = "The walk keeps at least 51 sites within +0.4 nats held out"
    [base]                       # ConvertConfig fields (dotted keys, as --set takes them) of every cell
    model = "smollm2"
    per = "channel"
    [[cells]]
    name = "walk-0.4"
    set = { "budget.nats" = 0.4 }  # this cell's fields, over the base
    [[checks]]
    cell = "walk-0.4"
    metric = "sites"               # one of METRICS
    at_least = 51                  # or at_most

Each cell runs in ``ROOT/<study>/<cell>/``: its resolved config (``config.json``), its heal checkpoint while it
heals (``heal.pt``: a killed heal resumes from it), and its result (``result.json``: the fidelity, the stages, the
commit and the machine). One process owns a cell at a time (a lock). A cell whose result matches its config is
skipped, so a killed study loses at most the cell in progress; a cell that fails is recorded and the study goes on.
Every cell's config is resolved and validated before the first one runs, so a typo fails in seconds, naming the
file and the cell. Each result is a row of ``ROOT/<study>/results.csv`` and, with ``bench=``, of
``<bench>/study_<study>.csv``, beside the commit and the machine that measured it; a table whose columns are not
a study's is refused before any cell runs.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import shlex
import sys
import traceback
from importlib import resources
from pathlib import Path

from normlab.conversion.config import ConvertConfig, check_known_keys, resolve_convert_config, table_keys
from normlab.owner import Locked, check_folder, hold, path_segment_error, replace_text
from normlab.typed import check_table
from normlab.version import code_version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Study", "load_study", "builtin_studies", "run_study", "METRICS", "cell_metrics", "check_results"]

RESULT, CONFIG = "result.json", "config.json"


class _StudyFile:
    """A study TOML's keys and their kinds (`normlab.typed.check_table`, as an experiment's)."""

    title: str
    claim: str
    base: dict
    cells: list[dict]
    checks: list[dict]


class _Cell:
    """A cell: its name and the config fields it sets: a named recipe's flags (``recipe``, one of
    `normlab.conversion.flags.RECIPE_FLAGS`), ``normlab convert``'s flags (``flags``), then ``set``, in that order."""

    name: str
    recipe: str
    flags: list
    set: dict


class _Check:
    """A check: a cell's metric and its bounds."""

    cell: str
    metric: str
    at_least: float
    at_most: float
    why: str


def _rise(part: dict | None) -> float | None:
    return None if not part or "ce_converted" not in part else part["ce_converted"] - part["ce_original"]


def _usage(f: dict, part: str) -> dict | None:
    """One text's judgement (`normlab.conversion.measure.usage`): 'held' (held-out), 'docs' (the second text) or
    'chat' (the chat answers), None where the judge did not read it."""
    texts = _judged(f, "texts")
    if part == "docs":
        return next((t for name, t in texts.items() if name not in ("held-out", "chat")), None)
    return texts.get({"held": "held-out"}.get(part, part))


def _stat(part: str, stat: str):
    """A reader of one judge statistic ('same_top1', 'kld.mean', 'gap.worst', ...) on one text."""

    def read(f: dict) -> float | None:
        value = _usage(f, part)
        for key in stat.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return read


def _judged(f: dict, part: str) -> dict:
    """A part of the judge's report ('long', 'stress', 'blowups', 'generation'), {} where it has none."""
    return (f.get("usage") or {}).get(part) or {}


# The numbers a check can name and a results row holds, each read from a cell's fidelity
# (`normlab.conversion.workflow.convert_model`); the judge's as `normlab.conversion.measure.usage` reports them.
METRICS = {
    "sites": lambda f: len(f.get("sites", {})),  # sites converted
    "ce_rise": lambda f: _rise(f),  # held-out cross-entropy, converted minus original (nats/token)
    "ce_rise_docs": lambda f: _rise(f.get("second_text")),  # the same on the second text
    "minutes": lambda f: sum(f.get("stages", {}).values()) / 60,  # wall time of every stage
    "heal_tokens_per_s": lambda f: (f["heal"]["tokens"] / f["heal"]["seconds"]) if f.get("heal") else None,
    **{  # per text: same top-1, KL divergence (mean, p99), the sequence gap (median, worst)
        f"{part}_{name}": _stat(part, stat)
        for part in ("held", "docs", "chat")
        for name, stat in (
            ("same_top1", "same_top1"),
            ("kld_mean", "kld.mean"),
            ("kld_p99", "kld.p99"),
            ("gap_median", "gap.median"),
            ("gap_worst", "gap.worst"),
        )
    },
    "long_gap_512_1023": lambda f: _judged(f, "long").get("by_position", {}).get("512-1023"),  # a long text's end
    "stress_gap_worst": lambda f: max((t["gap"]["worst"] for t in _judged(f, "stress").values()), default=None),
    "blowups": lambda f: len(_judged(f, "blowups")["over"]) if _judged(f, "blowups") else None,
    "chat_score": lambda f: _judged(f, "generation").get("chat_score"),  # answers that start as the original's
    "system_echoes": lambda f: _judged(f, "generation").get("system_echoes"),
    "heal_kept": lambda f: (f.get("heal") or {}).get("guard", {}).get("kept"),
}


@dataclasses.dataclass
class Study:
    name: str
    title: str
    claim: str
    cells: dict[str, ConvertConfig]  # cell name -> its resolved, validated config
    checks: list[dict]
    path: str


def builtin_studies() -> dict[str, Path]:
    """The studies that ship with normlab, by name."""
    folder = resources.files("normlab.experiments") / "convert"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".toml")}


def load_study(source: str | Path) -> Study:
    """A study from a built-in name or a TOML file, every cell resolved and validated: a bad field, cell or check
    is a ValueError naming the file and where in it, before any work.

    Args:
        source: A built-in study's name (`builtin_studies`) or a TOML file.
    """
    from normlab.conversion.checks import check_files

    builtin = builtin_studies()
    path = builtin[str(source)] if str(source) in builtin else Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"study {source!r}: no such file, and not a built-in study ({', '.join(builtin)})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    check_table(data, _StudyFile, str(path))
    cells, base = {}, data.get("base", {})
    check_known_keys(table_keys(base), lambda key: f"{path}: [base]: {key}")  # named where it is written
    for i, cell in enumerate(data.get("cells") or []):
        where = f"{path}: cells[{i}]"
        name = cell.get("name") if isinstance(cell, dict) else None
        if (why := path_segment_error(name)) is not None:
            raise ValueError(f"{where}: name {why}")
        if name in cells:
            raise ValueError(f"{where}: a second cell named {name!r}")
        check_table(cell, _Cell, where)
        check_known_keys(table_keys(cell.get("set", {})), lambda key, w=f"{where} ({name})": f"{w}: set.{key}")
        try:
            cfg = resolve_convert_config({**base, **_cell_fields(cell), **cell.get("set", {})})
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where} ({name}): {e}") from None
        if cfg.out is not None or cfg.heal.checkpoint is not None:
            raise ValueError(f"{where} ({name}): out and heal.checkpoint are the cell's folder's; drop them")
        try:
            check_files(cfg)  # every cell's model and texts, before the first cell runs
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{where} ({name}): {e}") from None
        cells[name] = cfg
    if not cells:
        raise ValueError(f"{path}: no cells; give at least one [[cells]] with a name")
    checks = data.get("checks") or []
    for i, c in enumerate(checks):
        check_table(c, _Check, f"{path}: checks[{i}]")
        if c.get("cell") not in cells or c.get("metric") not in METRICS or not {"at_least", "at_most"} & set(c):
            raise ValueError(
                f"{path}: checks[{i}] needs a cell of this study ({', '.join(cells)}), a metric "
                f"({', '.join(METRICS)}) and a number at_least or at_most; got {checks[i]!r}"
            )
    return Study(path.stem, data.get("title", path.stem), data.get("claim", ""), cells, checks, str(path))


def _cell_fields(cell: dict) -> dict:
    """The fields a cell's ``recipe`` and ``flags`` set (`normlab.conversion.flags.flag_fields`)."""
    from normlab.conversion.flags import RECIPE_FLAGS, flag_fields

    recipe = cell.get("recipe")
    if recipe is not None and recipe not in RECIPE_FLAGS:
        raise ValueError(f"recipe {recipe!r} is not one of {', '.join(RECIPE_FLAGS)}")
    return flag_fields([*RECIPE_FLAGS.get(recipe, ()), *cell.get("flags", [])])


def _fingerprint(cfg: ConvertConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def machine() -> str:
    import torch

    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def cell_metrics(fid: dict) -> dict:
    """Every metric of `METRICS` that a cell's fidelity holds (None where it has none: no heal, no second text).

    Args:
        fid: A cell's fidelity (its result's ``fidelity``).
    """
    return {name: read(fid) for name, read in METRICS.items()}


def _run_cell(name: str, cfg: ConvertConfig, folder: Path, progress: bool) -> dict:
    """One cell: its config written first, the conversion (a heal checkpointed in the cell, resumed after a kill),
    then its result; returns the result."""
    from normlab.conversion.workflow import convert_model

    folder.mkdir(parents=True, exist_ok=True)
    cfg = _as_run(cfg, folder)
    replace_text(folder / CONFIG, json.dumps(cfg.to_dict(), indent=2) + "\n")
    resume = cfg.heal.budgeted and (folder / "heal.pt").exists()  # a heal killed part-way goes on from there
    version = code_version()  # the code as the cell starts: a commit made while it runs is not the code that ran
    fid = convert_model(dataclasses.replace(cfg, heal=dataclasses.replace(cfg.heal, resume=resume)), progress=progress)
    result = {"cell": name, "config_sha": _fingerprint(cfg), "status": "done", "metrics": cell_metrics(fid),
              "fidelity": fid, "machine": machine(), **version}  # fmt: skip
    replace_text(folder / RESULT, json.dumps(result, indent=2) + "\n")  # a kill mid-write leaves no half result
    (folder / "heal.pt").unlink(missing_ok=True)  # served its purpose
    return result


ROW = ["study", "cell", "model", "to", *METRICS, "commit", "dirty", "machine", "command", "date"]  # a table's columns


def _check_table(table: Path | None) -> None:
    """A table the rows will go to: absent, empty, or with a study's columns (not another table of the same name)."""
    if table is None or not table.is_file() or table.stat().st_size == 0:
        return
    with table.open(newline="") as f:
        header = next(csv.reader(f), [])
    if header and len(header) < len(ROW) and header == ROW[: len(header)]:
        missing = ", ".join(ROW[len(header) :])
        raise ValueError(f"{table} was written by an older normlab (without the {missing} columns); move it aside")
    if header != ROW:
        raise ValueError(f"{table} holds another table (columns {', '.join(header[:4])}, ...); give another --bench")


def _append_row(table: Path, study: str, result: dict, cfg: ConvertConfig) -> None:
    """One row per finished cell: the study, the cell, its model and target, its metrics, the commit and the
    machine."""
    command = shlex.join(["normlab", *sys.argv[1:]]) if sys.argv[1:2] == ["study"] else f"run_study({study!r})"
    row = {"study": study, "cell": result["cell"], "model": cfg.model, "to": cfg.to, **result["metrics"],
           "commit": result.get("git_commit", "")[:12], "dirty": result.get("git_dirty", ""),
           "machine": result["machine"], "command": command, "date": datetime.date.today().isoformat()}  # fmt: skip
    assert list(row) == ROW
    table.parent.mkdir(parents=True, exist_ok=True)
    with hold(table, "the study table", wait=True):
        new = not table.exists() or table.stat().st_size == 0
        with table.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if new:
                w.writeheader()
            w.writerow(row)


def run_study(
    source: str | Path,
    root: str | Path,
    *,
    only: list[str] | None = None,
    bench: str | Path | None = None,
    progress: bool = True,
) -> dict[str, dict]:
    """Run every cell of a study (or those in ``only``) that has no result yet; returns each cell's result (or
    its failure), by name. See the module docstring for the folders, the locks and the tables.

    Args:
        source: A built-in study's name or a TOML file.
        root: The folder of the study's cells.
        only: The cells to run; None runs every one.
        bench: Also append each cell's row to ``<bench>/study_<name>.csv``.
        progress: Show progress bars.
    """
    study = load_study(source)
    missing = sorted(set(only or []) - set(study.cells))
    if missing:
        raise ValueError(f"--only {missing[0]!r}: {study.path} has the cells {', '.join(study.cells)}")
    home = Path(root) / study.name
    check_folder(home, "--root")
    if bench is not None:
        check_folder(bench, "--bench")  # a file given for the folder: refused before the first cell runs
    _claim(home, study)
    for table in (home / "results.csv", Path(bench) / f"study_{study.name}.csv" if bench else None):
        _check_table(table)
    results = {}
    for name, cfg in study.cells.items():
        if only and name not in only:
            continue
        results[name], ran = _cell(study.name, name, cfg, home / name, progress)
        for table in (home / "results.csv", Path(bench) / f"study_{study.name}.csv" if bench else None):
            if ran and table is not None:
                _append_row(table, study.name, results[name], cfg)
    verdicts = check_results(study, results)
    replace_text(home / "checks.json", json.dumps(verdicts, indent=2) + "\n")
    for v in verdicts:
        print(f"{'PASS' if v['passed'] else 'FAIL' if v['passed'] is False else 'n/a '}  {v['text']}")
    return results


def _source(study: Study) -> str:
    """Which study this is, beyond its name: ``builtin:NAME`` for one normlab ships, else its file's full path."""
    if builtin_studies().get(study.name) == Path(study.path):
        return f"builtin:{study.name}"
    return str(Path(study.path).resolve())


def _claim(home: Path, study: Study) -> None:
    """The study's folder names the study it holds (``study.json``): a second study of the same file name under the
    same ``--root`` is refused before it runs a cell, rather than running over the first's results (issue 65, G5)."""
    mark, source = home / "study.json", _source(study)
    # where the file lies from the folder: a study moved or copied with its folder is still the same study
    near = os.path.relpath(source, home.resolve()) if not source.startswith("builtin:") else source
    with hold(mark, "the study's mark", wait=True):  # two processes may share a study: one writes its mark
        if mark.is_file():
            held, held_near = (json.loads(mark.read_text()).get(k) for k in ("source", "from_folder"))
            if held != source and held_near != near:
                raise ValueError(
                    f"{home} holds the study {held}, not {source}: two studies named {study.name!r} cannot share "
                    "a --root; give this one another --root (or rename its file)"
                )
            return
        home.mkdir(parents=True, exist_ok=True)
        mark.write_text(json.dumps({"source": source, "from_folder": near}) + "\n")


def _cell(study: str, name: str, cfg: ConvertConfig, folder: Path, progress: bool) -> tuple[dict, bool]:
    """One cell, owned by this process for its run: (its result, whether it ran now). A cell another process holds
    is left to it ("busy"); one with a result for its config is read back; one that fails is recorded."""
    with contextlib.ExitStack() as owned:
        try:
            owned.enter_context(hold(folder, "study cell"))
        except Locked as e:  # another process runs this cell: two processes can share a study so
            print(f"{study}/{name}: {e}; skipped here", file=sys.stderr)
            return {"cell": name, "status": "busy", "error": str(e)}, False
        done = json.loads((folder / RESULT).read_text()) if (folder / RESULT).is_file() else None
        if done is not None and done.get("config_sha") == _fingerprint(_as_run(cfg, folder)):
            print(f"{study}/{name}: done before, skipped")
            return done, False
        print(f"\n=== {study}/{name} ===", flush=True)
        try:
            return _run_cell(name, cfg, folder, progress), True
        except KeyboardInterrupt:
            print(f"\n{study}/{name}: interrupted; run the study again to continue", file=sys.stderr)
            raise
        except Exception as e:  # noqa: BLE001  (recorded; the next cell still runs)
            (folder / "failed.txt").write_text(traceback.format_exc())
            print(f"{study}/{name}: failed: {e}", file=sys.stderr)
            return {"cell": name, "status": "failed", "error": f"{type(e).__name__}: {e}"}, False


def _as_run(cfg: ConvertConfig, folder: Path) -> ConvertConfig:
    """The config a cell runs with (its heal checkpoint in its folder), as its result records it."""
    if not cfg.heal.budgeted:
        return cfg
    ckpt = folder / "heal.pt"
    return dataclasses.replace(cfg, heal=dataclasses.replace(cfg.heal, checkpoint=str(ckpt), resume=False))


def check_results(study: Study, results: dict[str, dict]) -> list[dict]:
    """Each check of the study against the results: passed True / False, or None when its cell has no result.

    Args:
        study: The study.
        results: Cell name -> its result.
    """
    out = []
    for c in study.checks:
        value = (results.get(c["cell"]) or {}).get("metrics", {}).get(c["metric"])
        bound = [f">= {c['at_least']}" if "at_least" in c else "", f"<= {c['at_most']}" if "at_most" in c else ""]
        ok = None
        if value is not None:
            ok = value >= c.get("at_least", -float("inf")) and value <= c.get("at_most", float("inf"))
        shown = "no result" if value is None else f"{value:.4g}"
        text = f"{c['cell']}: {c['metric']} {' and '.join(b for b in bound if b)} (got {shown})"
        out.append({**c, "value": value, "passed": ok, "text": text + (f": {c['why']}" if "why" in c else "")})
    return out
