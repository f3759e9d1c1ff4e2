"""Hostile inputs to normlab's commands, tried as a user would: each case a real process of the CLI (`normlab
convert`, `evaluate`, `export`, `study`, `train`, `reproduce`, `build-kernels`) on tiny models built here (a Llama with
a chat template, a masked LM, an encoder-decoder), on a read-only tmpfs and a full one (300 kB), killed, run twice at
once, and on damaged or edited folders. What each case printed last on stderr, its exit code and whether a Python
traceback showed are printed and appended to bench/retry_inputs.csv, with the command, commit, machine and date.

    sudo python scripts/retry_inputs.py                 # every case (about 10 minutes on 2 cores; mounts tmpfs)
    sudo python scripts/retry_inputs.py "full disk" T5  # the cases whose name holds one of these words

A red team's tool, not a test: nothing is asserted; a row with a traceback, or a message that does not name the file
or the fix, is a finding. The models use the test suite's tiny tokenizer (tests/conftest.py), so the script runs in
a clone with the dev extra.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _study import stamp  # scripts/ is on the path when a script runs
from normlab.table import append_csv

ROOT = Path(__file__).resolve().parent.parent


def make_models(root: Path) -> None:
    """A tiny Llama (with the test suite's tokenizer and chat template), BERT and T5, a text, and a conversion."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import transformers

    from conftest import TEXT, tiny_tokenizer

    torch.manual_seed(0)
    kw = {"vocab_size": 256, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    models = {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=32, num_key_value_heads=2, **kw)),
        "bert": transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=32, **kw)),
        "t5": transformers.T5ForConditionalGeneration(
            transformers.T5Config(vocab_size=256, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
        ),
    }
    for name, model in models.items():
        model.eval().save_pretrained(root / "m" / name)
        tiny_tokenizer().save_pretrained(root / "m" / name)
    (root / "m" / "text.txt").write_text(TEXT * 40)
    convert = ["normlab", "convert", "--model", "m/llama", "--calibrate", "m/text.txt", "--seq-len", "32"]
    subprocess.run([*convert, "--sequences", "8", "--no-progress", "--out", "m/conv"], cwd=root, check=True,
                   capture_output=True)  # fmt: skip


def mount(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def cases(RO: str, FULL: str) -> list[tuple[str, str, str]]:
    """(name, setup, command) of each case, run from the work folder (m/ holds the models, o/ the outputs)."""
    C = "--calibrate m/text.txt --seq-len 32 --sequences 8 --no-progress"
    return [
     # read-only outputs
     ("convert --out in a read-only folder", "", f"normlab convert --model m/llama --to dyisru {C} --out {RO}/out"),
     ("convert --checkpoint in a read-only folder", "", f"normlab convert --model m/llama --to dyisru {C} --heal-tokens 256 --checkpoint {RO}/ck.pt --out o/ck"),
     ("export --onnx into a read-only folder", "", f"normlab export m/conv --onnx {RO}/m.onnx"),
     ("evaluate a read-only converted folder", f"rm -rf {RO}x; true", f"normlab evaluate {RO}/conv"),
     ("study --root read-only", "", f"normlab study real_model --root {RO}/r --only dyisru"),
     ("train --out read-only", "", f"normlab train --preset tiny --out {RO}/t"),
     ("reproduce --root read-only", "", f"normlab reproduce --quick --root {RO}/rep"),
     ("build-kernels with a read-only cache", "", f"env NORMLAB_CACHE={RO}/cache normlab build-kernels"),
     # full disk
     ("convert --out on a full disk", "", f"normlab convert --model m/llama --to dyisru {C} --out {FULL}/out"),
     ("export --onnx on a full disk", "", f"normlab export m/conv --onnx {FULL}/m.onnx"),
     ("evaluate report on a full disk", f"rm -rf {FULL}/* {FULL}/.[a-z]*; cp -r m/conv {FULL}/conv; dd if=/dev/zero of={FULL}/fill bs=1k 2>/dev/null; true", f"normlab evaluate {FULL}/conv"),
     ("train on a full disk", f"rm -rf {FULL}/* {FULL}/.[a-z]*; dd if=/dev/zero of={FULL}/fill bs=1k count=200 2>/dev/null; true", f"normlab train --preset tiny --out {FULL}/t"),
     ("study on a full disk", f"rm -rf {FULL}/* {FULL}/.[a-z]*; dd if=/dev/zero of={FULL}/fill bs=1k 2>/dev/null; true", f"normlab study real_model --root {FULL}/r --only dyisru"),
     # model kinds
     ("convert a masked LM (BERT) with its tokenizer", "rm -rf o/bert", f"normlab convert --model m/bert --to dyisru {C} --out o/bert"),
     ("convert a seq2seq (T5)", "rm -rf o/t5", f"normlab convert --model m/t5 --to dyisru {C} --out o/t5"),
     ("evaluate a converted masked LM", "", "normlab evaluate o/bert"),
     ("export a converted masked LM to ONNX", "", "normlab export o/bert --onnx o/bert.onnx"),
     ("evaluate a converted seq2seq", "", "normlab evaluate o/t5"),
     ("export a converted seq2seq", "", "normlab export o/t5 --onnx o/t5.onnx"),
     ("evaluate an original (not converted)", "", "normlab evaluate m/llama"),
     ("export an original (not converted)", "", "normlab export m/llama --onnx o/orig.onnx"),
     ("convert a converted folder", "", f"normlab convert --model m/conv --to dyt {C} --out o/again"),
     ("evaluate --original a conversion", "", "normlab evaluate m/conv --original m/conv"),
     ("evaluate --original a missing folder", "", "normlab evaluate m/conv --original m/nowhere"),
     ("evaluate --original another model", "", "normlab evaluate m/conv --original m/bert"),
     ("export to a .onnx that is a folder", "mkdir -p o/dir.onnx", "normlab export m/conv --onnx o/dir.onnx"),
     ("export with no --onnx", "", "normlab export m/conv"),
     ("convert --model a text file", "", f"normlab convert --model m/text.txt --to dyisru {C} --out o/x"),
     ("convert --model an empty folder", "mkdir -p o/empty", f"normlab convert --model o/empty --to dyisru {C} --out o/x2"),
     ("convert --to an unknown norm", "", f"normlab convert --model m/llama --to banana {C} --out o/x3"),
     ("convert --calibrate an empty file", ": > o/empty.txt", "normlab convert --model m/llama --to dyisru --calibrate o/empty.txt --seq-len 32 --sequences 8 --out o/x4"),
     ("convert --calibrate a binary file", "head -c 20000 /dev/urandom > o/bin.txt", "normlab convert --model m/llama --to dyisru --calibrate o/bin.txt --seq-len 32 --sequences 8 --no-progress --out o/x5"),
     ("convert --seq-len beyond the model's positions", "", "normlab convert --model m/llama --to dyisru --calibrate m/text.txt --seq-len 100000 --sequences 2 --no-progress --out o/x6"),
     ("convert --sequences 0", "", "normlab convert --model m/llama --to dyisru --calibrate m/text.txt --seq-len 32 --sequences 0 --out o/x7"),
     ("convert --budget-nats nan", "", f"normlab convert --model m/llama --to dyisru {C} --budget-nats nan --out o/x8"),
     ("convert --heal-tokens -5", "", f"normlab convert --model m/llama --to dyisru {C} --heal-tokens -5 --out o/x9"),
     ("convert --set heal.lr=abc", "", f"normlab convert --model m/llama --to dyisru {C} --heal-tokens 256 --set heal.lr=abc --out o/x10"),
     ("convert --set nosuch=1", "", f"normlab convert --model m/llama --to dyisru {C} --set nosuch=1 --out o/x11"),
     ("convert --device cuda on a CPU machine", "", f"normlab convert --model m/llama --to dyisru {C} --device cuda --out o/x12"),
     ("convert --massive-tokens route --no-calibrate", "", f"normlab convert --model m/llama --to dyisru {C} --massive-tokens route --no-calibrate --out o/x13"),
     ("convert --heal-text self with its chat template", "rm -rf o/x14", f"normlab convert --model m/llama --to dyisru {C} --heal-text self --heal-tokens 256 --set data.samples=16 --out o/x14"),
     ("convert --set data.samples=100000000", "", f"normlab convert --model m/llama --to dyisru {C} --heal-text self --heal-tokens 256 --set data.samples=100000000 --out o/x15"),
     ("convert --budget-nats 0 kl (no site kept)", "", f"normlab convert --model m/llama --to dyisru {C} --budget-nats 0 --set budget.metric=kl --out o/x16"),
     ("convert --exclude everything", "", f"normlab convert --model m/llama --to dyisru {C} --exclude '*' --out o/x17"),
     ("convert --eval-text a missing file", "", f"normlab convert --model m/llama --to dyisru {C} --eval-text o/nope.txt --out o/x18"),
     ("convert --resume with nothing to resume", "", f"normlab convert --model m/llama --to dyisru {C} --heal-tokens 256 --resume --out o/x19"),
     ("convert --out an existing file", ": > o/afile", f"normlab convert --model m/llama --to dyisru {C} --out o/afile"),
     ("convert --out the model folder", "", f"normlab convert --model m/llama --to dyisru {C} --out m/llama"),
     ("evaluate --prompts 0", "", "normlab evaluate m/conv --prompts 0"),
     ("evaluate --prompts 100000", "", "normlab evaluate m/conv --prompts 100000"),
     ("evaluate a folder with a truncated normlab_conversion.json", "rm -rf o/trunc; cp -r m/conv o/trunc; head -c 50 m/conv/normlab_conversion.json > o/trunc/normlab_conversion.json", "normlab evaluate o/trunc"),
     ("export a folder with truncated weights", "rm -rf o/tw; cp -r m/conv o/tw; f=$(ls o/tw/*.safetensors|head -1); head -c 1000 $f > $f.x && mv $f.x $f", "normlab export o/tw --onnx o/tw.onnx"),
     ("study an unknown name", "", "normlab study banana --root o/s"),
     ("study --only an unknown cell", "", "normlab study real_model --root o/s --only nosuchcell"),
     ("study a TOML with a bad field", "printf 'title=\"t\"\\n[base]\\nmodel=\"m/llama\"\\nnosuch=1\\n[[cells]]\\nname=\"a\"\\n' > o/bad.toml", "normlab study o/bad.toml --root o/s2"),

     ("BERT budget walk by KL", "", f"normlab convert --model m/bert --to dyisru {C} --budget-nats 0.1 --set budget.metric=kl --out o/r1"),
     ("llama without tokenizer, heal-text self", "rm -rf m/notok; mkdir -p m/notok; cp m/llama/config.json m/llama/*.safetensors m/notok/", f"normlab convert --model m/notok --to dyisru {C} --heal-text self --heal-tokens 256 --out o/r2"),
     ("llama without tokenizer, data.walk=self", "", f"normlab convert --model m/notok --to dyisru {C} --budget-nats 0.1 --set budget.metric=kl data.walk=self --out o/r3"),
     ("evaluate a folder converted without a tokenizer", "rm -rf o/r4", f"normlab convert --model m/notok --to dyisru {C} --out o/r4 && normlab evaluate o/r4"),
     ("export --opset 5", "", "normlab export m/conv --onnx o/op.onnx --opset 5"),
     ("export --opset 10000", "", "normlab export m/conv --onnx o/op2.onnx --opset 10000"),
     ("convert --massive-tokens shared --per channel", "rm -rf o/r5", f"normlab convert --model m/llama --to dyisru {C} --massive-tokens shared --per channel --out o/r5"),
     ("two evaluates of one folder at once", "rm -rf o/ev; cp -r m/conv o/ev", "(normlab evaluate o/ev > /dev/null 2>&1 &) ; sleep 1; normlab evaluate o/ev"),
     ("two exports to one file at once", "", "(normlab export m/conv --onnx o/same.onnx > /dev/null 2>&1 &); sleep 4; normlab export m/conv --onnx o/same.onnx"),
     ("SIGKILL during evaluate, then evaluate again", "rm -rf o/kv; cp -r m/conv o/kv", "normlab evaluate o/kv > /dev/null 2>&1 & p=$!; sleep 4; kill -9 $p; ls -a o/kv | tr '\\n' ' ' >&2; echo >&2; normlab evaluate o/kv > /dev/null && ls -a o/kv | tr '\\n' ' ' >&2"),
        ("transformers loads the portable folder without normlab", "", f"{sys.executable} -I -c \"import os, transformers as T; m = T.AutoModelForCausalLM.from_pretrained(os.path.abspath('m/conv'), trust_remote_code=True); print(type(m).__name__)\" 2>&1 | tail -1 >&2"),
        ("a portable folder whose normlab_sites has a channel axis of words", "rm -rf o/ed; cp -r m/conv o/ed; python3 -c \"import json; p = 'o/ed/config.json'; d = json.load(open(p)); next(iter(d['normlab_sites'].values()))['channel_dim'] = 'q'; json.dump(d, open(p, 'w'))\"", f"{sys.executable} -I -c \"import os, transformers as T; T.AutoModelForCausalLM.from_pretrained(os.path.abspath('o/ed'), trust_remote_code=True)\" 2>&1 | tail -1 >&2"),
     ("study killed mid-cell, then resumed", "rm -rf o/st; printf 'title=\"t\"\\n[base]\\nmodel=\"m/llama\"\\n\"data.text\"=\"m/text.txt\"\\nseq_len=32\\nsequences=8\\n\"heal.tokens\"=400000\\n[[cells]]\\nname=\"a\"\\n' > o/st.toml", "timeout -s KILL 15 normlab study o/st.toml --root o/st --no-progress > /dev/null 2>&1; ls o/st/st/a >&2; normlab study o/st.toml --root o/st --no-progress 2>&1 | tail -2 >&2"),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("only", nargs="*", help="run only the cases whose name holds one of these words")
    p.add_argument("--csv", default=str(ROOT / "bench" / "retry_inputs.csv"), help="where the rows go")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="normlab-retry-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    os.environ.update(env)
    make_models(work)
    (work / "o").mkdir()
    mount(work / "ro", "2m")
    subprocess.run(["cp", "-r", str(work / "m" / "conv"), str(work / "ro" / "conv")], check=True)
    subprocess.run(["mount", "-o", "remount,ro", str(work / "ro")], check=True)
    mount(work / "full", "300k")
    rows = []
    try:
        for name, setup, cmd in cases(str(work / "ro"), str(work / "full")):
            if args.only and not any(o in name for o in args.only):
                continue
            if setup:
                subprocess.run(setup, shell=True, env=env, cwd=work)
            start = time.time()
            run = subprocess.run(cmd, shell=True, env=env, cwd=work, capture_output=True, text=True, timeout=900)
            lines = [ln for ln in (run.stderr or "").replace("\r", "\n").splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if "it/s" not in ln and "step/s" not in ln), "")
            seconds, traceback = time.time() - start, "Traceback" in run.stderr
            print(f"{'TB ' if traceback else '   '}rc={run.returncode:<4}{seconds:6.1f}s  {name}\n        {last[:400]}")
            rows.append({"case": name, "exit": run.returncode, "traceback": traceback, "seconds": round(seconds, 1),
                         "said": last[:400]})  # fmt: skip
    finally:
        for folder in ("ro", "full"):
            subprocess.run(["umount", str(work / folder)], check=False)
    append_csv(args.csv, rows, stamp())


if __name__ == "__main__":
    main()
