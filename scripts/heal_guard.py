"""The heal guard's verdict on two converted folders of one model: the one before a heal and the one after it
(`normlab.conversion.measure.judge.heal_verdict`), on the validation split the heal would use, its prefixed copies and
its
windows at 16 offsets.

    python scripts/heal_guard.py BEFORE_DIR AFTER_DIR

Both folders must come from the same original (their records name it) and the same text. Prints the verdict as
JSON. A tool, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import normlab
from normlab.conversion.data.models import TextCut, fixture_path, load_model, quiet, text_splits
from normlab.conversion.measure.judge import guard_items, guard_prefixes, heal_verdict, judge_tokens
from normlab.corpus import fetch_shakespeare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after")
    args = p.parse_args()
    record = json.loads((Path(args.before) / "normlab_conversion.json").read_text())
    with quiet(True):
        original, tok = load_model(fixture_path(record["made_from"]["model"]), progress=False)
        before, _ = normlab.load_converted(args.before)
        after, _ = normlab.load_converted(args.after)
    splits = text_splits(fetch_shakespeare(), tok, original.config.vocab_size, TextCut(128, 32, 32, 8))
    items = guard_items(splits.val, guard_prefixes(tok))
    verdict = heal_verdict(judge_tokens(original, before, items), judge_tokens(original, after, items))
    print(json.dumps({"items": len(items), **verdict}, indent=2))


if __name__ == "__main__":
    main()
