"""The chat score of converted folders on more prompts than the judgement reads: each folder's greedy answers to the
first --prompts of `normlab.conversion.measure.prompts.PROMPTS` (all 96 by default) against the original's, which
are generated once for every folder. With 96 prompts the 95% interval is about half as wide as with the 24
`normlab convert` reads, so that recipes a few answers apart can be told apart.

    python scripts/chat_scores.py KEEP/budget_0.02 KEEP/budget_0.02_heal_2x --names walk healed

Prints each folder's chat score with its interval and the answers that end in a loop, and each folder against the
first prompt by prompt (McNemar's exact test, `normlab.conversion.measure.usage.paired_chat`). A row per folder goes
to bench/chat_scores.csv with the command, the commit, the machine and the date. A benchmark: nothing is asserted.
Every folder must record the same original (its fingerprint), which is loaded from the first folder's record.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _study import stamp  # scripts/ is on the path when a script runs
from bench_kernels import cpu_name
from normlab.conversion.data.models import load_model
from normlab.conversion.evaluate import original_of
from normlab.conversion.export.saving import RECORD_FILE, load_converted
from normlab.conversion.measure.prompts import PROMPTS
from normlab.conversion.measure.usage import (
    UsageConfig,
    chat_interval,
    chat_prompts,
    greedy_answers,
    kept_answers,
    loops,
    paired_chat,
)
from normlab.table import append_csv

ROOT = Path(__file__).resolve().parent.parent


def _fingerprint(folder: Path) -> str | None:
    return json.loads((folder / RECORD_FILE).read_text()).get("made_from", {}).get("model_fingerprint")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", type=Path, nargs="+", help="converted folders (normlab convert --out)")
    ap.add_argument("--names", nargs="+", help="a name per folder (default: the folder's name)")
    ap.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help=f"how many prompts, from the first (<= {len(PROMPTS)})"
    )
    ap.add_argument("--csv", type=Path, default=ROOT / "bench" / "chat_scores.csv", help="where the rows go")
    args = ap.parse_args()
    names = args.names or [f.name for f in args.folders]
    if len(names) != len(args.folders):
        raise SystemExit(f"--names gives {len(names)} names for {len(args.folders)} folders")
    if not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    path = [original_of(f) for f in args.folders][0]  # every folder checked before a model is loaded
    prints = {str(f): _fingerprint(f) for f in args.folders}
    if len(set(prints.values())) != 1:
        raise SystemExit(f"the folders record different originals: {prints}")
    cfg = UsageConfig(prompts=args.prompts)
    original, tokenizer = load_model(path, progress=False)
    chat = chat_prompts(tokenizer, PROMPTS[: cfg.prompts])
    if chat is None:
        raise SystemExit(f"{path}'s tokenizer has no chat template")
    prompts, _ = chat
    eos = getattr(tokenizer, "eos_token_id", None)

    def decoded(ids: list) -> list[str]:
        return [tokenizer.decode(a, skip_special_tokens=True).strip() for a in ids]

    t0 = time.perf_counter()
    ref = greedy_answers(original, prompts, cfg.new_tokens, eos)
    print(f"the original's {len(prompts)} answers in {time.perf_counter() - t0:.0f} s")
    kept, rows = [], []
    for folder, name in zip(args.folders, names):
        net, _ = load_converted(folder)
        got = greedy_answers(net, prompts, cfg.new_tokens, eos)
        answers = [{"original": a, "converted": b} for a, b in zip(decoded(ref), decoded(got))]
        k = kept_answers(answers, cfg.words)
        kept.append(k)
        lo, hi = chat_interval(sum(k), len(k))
        looped = sum(loops(b) for b in got)
        print(
            f"chat score: {name} {sum(k)} of {len(k)} ({sum(k) / len(k):.0%}; 95% interval {lo:.0%}-{hi:.0%}); "
            f"{looped} answers end in a loop (the original: {sum(loops(a) for a in ref)})"
        )
        rows.append({**stamp(), "machine": cpu_name(), "folder": name, "prompts": len(k), "kept": sum(k),
                     "chat_score": round(sum(k) / len(k), 4), "interval_low": lo, "interval_high": hi,
                     "loops": looped, "loops_original": sum(loops(a) for a in ref)})  # fmt: skip
    for name, k in zip(names[1:], kept[1:]):
        d = paired_chat(kept[0], k)
        print(
            f"{name} against {names[0]}: {d['only_second']} answers kept by {name} alone, {d['only_first']} by "
            f"{names[0]} alone; McNemar's exact p = {d['p']:.2g}"
        )
    append_csv(args.csv, rows)
    print(f"{len(rows)} rows -> {args.csv}")


if __name__ == "__main__":
    main()
