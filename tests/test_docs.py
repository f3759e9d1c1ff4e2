"""The documents users read: the papers cited by title, never by a folder they lack."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def test_no_source_document_numbers_are_left():
    """A user who clones normlab has no `shared/seeds` folder: the papers are cited by name (README, References),
    never as "seed 000".."seed 004" or by that folder, in the README, docs, sources, scripts or experiment TOMLs."""
    import re

    repo = Path(__file__).resolve().parents[1]
    files = [repo / "README.md", *(repo / "docs").rglob("*.md"), *(repo / "docs").rglob("*.toml"),
             *(repo / "src").rglob("*.py"), *(repo / "src").rglob("*.toml"),
             *(repo / "scripts").rglob("*.py")]  # fmt: skip
    pattern = re.compile(r"\bseeds? 00[0-4]\b|shared/seeds", re.IGNORECASE)
    hits = [
        f"{f.relative_to(repo)}:{i}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits[:10]
    refs = (repo / "docs" / "references.md").read_text()
    for arxiv in ("2503.10622", "2503.21708", "2512.10938", "2604.01563", "2604.23434"):
        assert refs.count(arxiv) >= 1, arxiv  # every paper is in the one references section
    rows = [line.split("|")[1].strip() for line in refs.splitlines() if line.startswith("| the ")]
    assert len(rows) == len(set(rows)) >= 6, rows  # each work once


# ---------------------------------------------------------------------------------------------------------------
# The docs cannot rot: every Python block runs, every command's flags exist, every relative link resolves.

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MARK = "<!-- docs-test:"  # before a block: "skip: why" (illustrative only) or "replace OLD => NEW; ..." (tiny sizes)
OUTPUT = f"{MARK} output"  # before a text block: what the python block above prints, its numbers within "rtol=X"


def _blocks(path: Path):
    """(language, first line number, code, the docs-test mark before it or "") of every fenced block of ``path``."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            mark = lines[i - 1].strip() if i and lines[i - 1].strip().startswith(MARK) else ""
            out.append((lang, start + 1, "\n".join(lines[i + 1 : j]), mark))
            i = j
        i += 1
    return out


def _python_blocks():
    """Every python block, with the output block that follows it, if any: (code, mark, (printed, rtol) or None)."""
    params = []
    for p in PAGES:
        blocks = _blocks(p)
        for k, (lang, line, code, mark) in enumerate(blocks):
            if lang != "python":
                continue
            after = blocks[k + 1] if k + 1 < len(blocks) else None
            shown = None
            if after is not None and after[3].startswith(OUTPUT):
                rtol = float(after[3].removeprefix(OUTPUT).removesuffix("-->").strip().removeprefix("rtol="))
                shown = (after[2], rtol)
            params.append(pytest.param(code, mark, shown, id=f"{p.relative_to(REPO)}:{line}"))
    return params


_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?%?"


ANY = "(any)"  # a shown number the run does not determine (a degenerate fit's beta): any printed number matches it


def same_output(got: str, want: str, rtol: float) -> str | None:
    """None when ``got`` prints what ``want`` shows: the same words (spacing and the length of a table's rule aside)
    and every number within ``rtol`` of the shown one (relative; plus 1 in the shown number's last digit), or any
    number where the page shows ``ANY``; else the first difference."""
    import re

    def parts(s: str):  # a table's rule is as long as its widest cell, which an ANY number sets: any length
        return re.split(f"({_NUMBER}|{re.escape(ANY)})", re.sub("-{3,}", "---", " ".join(s.split())))

    g, w = parts(got), parts(want)
    if len(g) != len(w):
        return f"a different shape of output:\n{got}\n--- the page shows ---\n{want}"
    for i, (a, b) in enumerate(zip(g, w)):
        if i % 2 == 0:
            if " ".join(a.split()) != " ".join(b.split()):
                return f"text {a!r} where the page shows {b!r}"
            continue
        if b == ANY:
            continue
        x, y = float(a.rstrip("%")), float(b.rstrip("%"))
        digits = b.rstrip("%").lower().split("e")[0]
        ulp = 10.0 ** -(len(digits.split(".")[1]) if "." in digits else 0)
        if "e" in b.lower():
            ulp *= 10.0 ** int(b.rstrip("%").lower().split("e")[1])
        if not abs(x - y) <= rtol * abs(y) + ulp:
            return f"{a} where the page shows {b} (rtol {rtol})"
    return None


def test_the_output_check_can_fail():
    assert same_output("beta 0.0908 ok", "beta   0.09077  ok", 1e-3) is None
    assert same_output("beta 0.12 ok", "beta 0.09077 ok", 1e-3) is not None
    assert same_output("beta 0.0908 FLAGGED", "beta 0.0908 ok", 1e-3) is not None
    assert same_output("['derf', 'dyt']", "['dyisru', 'dyt']", 0) is not None
    assert same_output("beta 8453.0 ok", f"beta {ANY} ok", 0) is None  # an undetermined number: any
    assert same_output("beta big ok", f"beta {ANY} ok", 0) is not None  # but a number
    assert same_output("beta 8453.0 FLAGGED", f"beta {ANY} ok", 0) is not None  # and the words as shown
    assert same_output("a\n---  ------\nb 914 ok", f"a\n---  -----------\nb {ANY} ok", 0) is None  # its rule too
    assert same_output("a\n---  -\nb 914 ok", f"a\n---  ---\nb {ANY} ok", 0) is not None  # but a rule


def _tiny_llama(path: Path) -> Path:
    """A tiny random Llama saved with a tiny BPE tokenizer that has a chat template (`conftest.tiny_tokenizer`), so
    a block that prompts through the template and decodes runs as printed."""
    import torch
    import transformers

    from conftest import tiny_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _tiny_converted(tmp_path: Path) -> Path:
    """`_tiny_llama` converted to DyISRU per channel (calibrated on a few batches) and saved with its tokenizer by
    `normlab.save_converted`: what ``normlab convert --out`` writes, for a block that starts from such a folder."""
    import torch

    import normlab
    from normlab.conversion.data.models import load_model

    model, tok = load_model(_tiny_llama(tmp_path / "tiny-original"), progress=False)
    calib = [torch.randint(2, 256, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    record = normlab.convert_norms(model, "dyisru", calibrate=calib, per="channel", progress=False)
    return normlab.save_converted(model, record, tmp_path / "tiny-converted", tokenizer=tok)


def test_the_export_page_starts_from_a_converted_folder():
    """issue 86: export.md's ONNX block loaded the unconverted model from a converted folder; it reads the folder
    with normlab.load_converted and its tokenizer, and the docs test runs it on a converted tiny model, comparing
    the decoded tokens with generate()'s (the block's own assert)."""
    blocks = [code for lang, _, code, mark in _blocks(REPO / "docs" / "export.md") if "ort.InferenceSession" in code]
    assert len(blocks) == 1 and "normlab.load_converted(folder)" in blocks[0]
    assert "AutoTokenizer.from_pretrained(folder)" in blocks[0] and "tokens == same[0" in blocks[0]


def test_load_model_refuses_a_converted_folder(tmp_path):
    from normlab.conversion.data.models import load_model

    folder = _tiny_converted(tmp_path)
    with pytest.raises(ValueError, match=r"normlab conversion .*normlab\.load_converted.*trust_remote_code=True"):
        load_model(folder)


@pytest.mark.slow
@pytest.mark.parametrize("code, mark, shown", _python_blocks())
def test_every_python_block_of_the_docs_runs(code, mark, shown, tmp_path, monkeypatch, capsys):
    """Each ``python`` block of README.md and docs/ runs as printed, in a fresh folder that holds ``my_text.txt``
    (the start of the Shakespeare corpus). A block that names a large model says, in a mark just above it, what
    the test puts in its place; a block marked ``skip`` is illustrative only (none today). A block followed by an
    output block (marked ``output rtol=X``) prints what that block shows."""
    from normlab.corpus import fetch_shakespeare

    if mark.startswith(f"{MARK} skip"):
        pytest.skip(mark)
    (tmp_path / "my_text.txt").write_text(Path(fetch_shakespeare()).read_text()[:200_000])
    names = {}
    if mark.startswith(f"{MARK} replace"):
        for pair in mark.removeprefix(f"{MARK} replace").removesuffix("-->").split(";"):
            old, new = (s.strip() for s in pair.split("=>"))
            assert old in code, f"the mark replaces {old!r}, which the block does not contain"
            code = code.replace(old, new)
        if "TINY_LLAMA" in code:
            names["TINY_LLAMA"] = str(_tiny_llama(tmp_path / "tiny-llama"))
        if "TINY_CONVERTED" in code:
            names["TINY_CONVERTED"] = str(_tiny_converted(tmp_path))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(compile(code, "<docs block>", "exec"), names)
    if shown is not None:
        printed = capsys.readouterr().out
        differs = same_output(printed, *shown)
        assert differs is None, differs


def _commands():
    """Every ``normlab ...`` (or ``python scripts/X.py ...``) command shown in a bash block, as its words."""
    import shlex

    found = []
    for p in PAGES:
        for lang, line, code, _ in _blocks(p):
            if lang != "bash":
                continue
            for text in code.replace("\\\n", " ").splitlines():
                text = text.split(" #")[0].strip()
                if not text or text.startswith("#"):
                    continue
                words = shlex.split(text)
                for k, w in enumerate(words):
                    if (w == "normlab" and k == 0) or (w == "normlab.cli" and words[k - 1] == "-m"):
                        found.append((f"{p.relative_to(REPO)}:{line}", ["normlab", *words[k + 1 :]]))
                        break
                    if w.startswith("scripts/") and w.endswith(".py") and words[k - 1].startswith("python"):
                        found.append((f"{p.relative_to(REPO)}:{line}", words[k:]))
                        break
    return found


@pytest.mark.slow
def test_every_flag_a_docs_command_shows_exists():
    """Each command of a bash block, run with ``--help``: the command exists, and every ``--flag`` the docs show for it
    is in its help. A script runs as a real process; ``normlab CMD --help`` through the command line's own main here
    (the same parser; a process each cost 2 s; tests/test_packaging.py runs the installed command)."""
    import contextlib
    import io
    import re
    import subprocess
    import sys

    from normlab.cli import main

    helps, missing = {}, []
    cmds = _commands()
    assert len(cmds) >= 15, cmds  # the parser found the commands of the pages
    for where, words in cmds:
        key = ("normlab", words[1]) if words[0] == "normlab" else (words[0],)
        if key in helps:
            pass
        elif words[0] == "normlab":
            out = io.StringIO()
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
                main([words[1], "--help"])
            assert done.value.code == 0, f"{where}: normlab {words[1]} --help failed"
            helps[key] = out.getvalue()
        else:
            argv = [sys.executable, str(REPO / words[0]), "--help"]
            run = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
            assert run.returncode == 0, f"{where}: {' '.join(key)} --help failed: {run.stderr[-500:]}"
            helps[key] = run.stdout
        flags = {w.split("=")[0] for w in words if w.startswith("--")}
        missing += [
            f"{where}: {' '.join(key)} {f}"
            for f in sorted(flags)
            if not re.search(re.escape(f) + r"(?![\w-])", helps[key])  # the whole flag, not a prefix of one
        ]
    assert not missing, missing


def test_every_relative_link_and_image_of_the_docs_exists():
    """Every ``[text](target)`` and ``![alt](target)`` in README.md and docs/ that is not a web address points at
    a file of the repository."""
    import re

    broken = []
    for p in PAGES:
        text = re.sub(r"```.*?```", "", p.read_text(), flags=re.S)  # links inside code are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (p.parent / target.split("#")[0]).exists():
                broken.append(f"{p.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_every_command_has_help_on_every_flag_and_ends_with_its_docs_page():
    import argparse

    from normlab.cli import DOCS, build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = [
        f"{name} {a.option_strings or a.dest}"
        for name, cmd in sub.choices.items()
        for a in cmd._actions
        if not isinstance(a, argparse._HelpAction) and not a.help
    ]
    assert not silent, silent
    for name, cmd in sub.choices.items():
        page = DOCS[name]
        assert cmd.format_help().rstrip().endswith("in the normlab repository."), name
        assert page in cmd.format_help() and (REPO / page).exists(), (name, page)
    assert DOCS[None] in parser.format_help()


def test_the_site_builds_with_strict_checks(tmp_path):
    """``make docs``: MkDocs with --strict, so that a broken link or an API reference to a missing name fails."""
    import subprocess
    import sys

    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=REPO, timeout=600, env={**__import__("os").environ,
                         "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "conversion" / "index.html").exists()


def prose_words(text: str) -> int:
    """Words of a Markdown page outside its fenced code blocks (what a reader reads, not what they copy)."""
    return len(re.sub(r"```.*?```", "", text, flags=re.S).split())


def test_the_readme_is_a_front_page():
    """issue 86: the README was 195 lines and 2,357 words, a lab notebook; a front page is at most 120 lines and
    1,200 words outside code."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    assert prose_words(readme) <= 1200


def test_the_docs_are_read_in_minutes_not_hours():
    """issue 86: 36,400 words over 21 pages, a guide of 8,200. Each number is stated once, on its results page:
    the docs hold at most 25,000 words outside code, no page over 3,000, and the conversion guide at most 2,500."""
    words = {p.relative_to(REPO).as_posix(): prose_words(p.read_text()) for p in PAGES if p.name != "README.md"}
    assert sum(words.values()) <= 25000, sum(words.values())
    assert not {page: n for page, n in words.items() if n > 3000}
    assert words["docs/conversion.md"] <= 2500
    assert prose_words("two words\n```python\nnot = these\n```\nand three more") == 5


COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def commits_in_prose(text: str) -> list[str]:
    """The commit hashes of a Markdown page outside its code blocks and link targets (a GitHub user's name in a
    web address is not a hash): seven or more hex digits with at least one letter and one digit."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return COMMIT.findall(text)


def test_the_docs_state_results_not_commits():
    """issue 67: README.md and docs/ name no commit in their prose, tables or figure captions; a result's commit is in
    its bench row, and history is in CHANGELOG.md."""
    hits = {p.relative_to(REPO).as_posix(): commits_in_prose(p.read_text()) for p in PAGES}
    assert not {k: v for k, v in hits.items() if v}
    assert commits_in_prose("measured at 6201ef4, and `3683c49` too") == ["6201ef4", "3683c49"]
    assert commits_in_prose("```\ngit checkout 6201ef4\n```\n[repo](https://github.com/abcde17/x), 2026") == []


def test_scripts_import_only_modules_of_the_api_reference():
    """The scripts are tools and benchmarks on normlab's public modules: every normlab module they import is in the
    API reference (docs/api), where its names are documented, or is a package whose modules are."""
    import ast
    import re

    documented = {"normlab"} | {
        m for page in (REPO / "docs" / "api").glob("*.md") for m in re.findall(r"^::: (\S+)", page.read_text(), re.M)
    }
    used = {}
    for script in (REPO / "scripts").glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            names = (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module
                else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            )  # fmt: skip
            for name in names:
                if name == "normlab" or name.startswith("normlab."):
                    used.setdefault(name, script.name)
    packages = {d.rsplit(".", 1)[0] for d in documented}  # packages whose modules are documented
    undocumented = {m: s for m, s in used.items() if m not in documented | packages}
    assert not undocumented, undocumented
    assert "normlab.conversion.convert" in documented and len(used) >= 10  # the check sees the scripts' imports


# The API pages whose every module documents each parameter of its public functions and classes in an Args section,
# rendered by mkdocstrings as a table: every page of the API reference.
API_PAGES = sorted((REPO / "docs" / "api").glob("*.md"))
ARGS_DOCUMENTED = tuple(m for page in API_PAGES for m in re.findall(r"^::: (\S+)", page.read_text(), re.M))


def undocumented_args(obj) -> list[str]:
    """The parameters of a function (or a class's constructor) that its docstring's Args section does not name."""
    import dataclasses
    import inspect
    import re

    target = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return []  # a config: its fields carry their own docstrings
    try:
        params = [p for p in inspect.signature(target).parameters if p not in ("self", "cls") and not p.startswith("_")]
    except (TypeError, ValueError):
        return []
    params = [p for p in params if inspect.signature(target).parameters[p].kind not in (
        inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]  # fmt: skip
    doc = inspect.getdoc(obj) or ""
    section = re.search(r"^(?:Args|Attributes):\n((?:    .*\n?|\n)*)", doc, re.M)
    named = set(re.findall(r"^    (\w+)(?: \(.*?\))?:", section.group(1), re.M)) if section else set()
    return [p for p in params if p not in named]


@pytest.mark.parametrize("module", ARGS_DOCUMENTED)
def test_every_public_parameter_is_in_an_args_table(module):
    import importlib
    import inspect

    mod = importlib.import_module(module)
    missing = {}
    public = [n for n, v in vars(mod).items() if not n.startswith("_") and getattr(v, "__module__", None) == module]
    for name in getattr(mod, "__all__", public):  # a module without __all__: the names it defines
        obj = getattr(mod, name)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and (gaps := undocumented_args(obj)):
            missing[name] = gaps
    assert not missing, f"{module}: parameters missing from the Args section: {missing}"


def test_the_args_check_fails_on_a_missing_parameter():
    def documented(a: int, b: int) -> int:
        """Sum.

        Args:
            a: One.
            b: Two.
        """

    def half(a: int, b: int) -> int:
        """Sum.

        Args:
            a: One.
        """

    assert undocumented_args(documented) == [] and undocumented_args(half) == ["b"]


def _first_convert(page: Path) -> list[str] | None:
    """The words of the first ``normlab convert`` command in a bash block of ``page``, or None."""
    import shlex

    for lang, _, code, _ in _blocks(page):
        if lang != "bash":
            continue
        for text in code.replace("\\\n", " ").splitlines():
            text = text.split(" #")[0].strip()
            if text.startswith("normlab convert"):
                return shlex.split(text)
    return None


def test_every_page_that_converts_leads_with_the_recommended_recipe():
    """issue 86: the pages disagreed on what to run (conversion.md led with `--per channel`, which the README rates
    wrong answers; getting-started with `--budget-nats 0.4`). The first conversion on every page is the recommended
    recipe, whose flags are written once (normlab.conversion.flags.RECOMMENDED)."""
    from normlab.conversion.flags import RECOMMENDED

    def leads(words: list[str]) -> bool:
        n = len(RECOMMENDED)
        return any(tuple(words[i : i + n]) == RECOMMENDED for i in range(len(words) - n + 1))

    firsts = {p.relative_to(REPO).as_posix(): w for p in PAGES if (w := _first_convert(p)) is not None}
    assert {"README.md", "docs/conversion.md", "docs/getting-started.md", "docs/index.md"} <= set(firsts)
    assert not [page for page, words in firsts.items() if not leads(words)]
    assert not leads(["normlab", "convert", "--per", "channel", "--budget-nats", "0.4"])  # the check can fail
