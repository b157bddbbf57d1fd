"""The README's commands: every `python -m jaxllmq...` names a real module, real flags and real
flagfiles; and the tutorial's CPU commands run in order, as written, in a fresh directory: prepare
the quickstart data, train, plot the log, sample from the model."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from test_plot import png_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def section(title: str) -> str:
    """The README text under `## title`, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def fenced_lines(text: str) -> list[str]:
    """The lines of `text`'s fenced code blocks, in order, with `\\` continuations joined."""
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    return [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]


def parse(lines: list[str]) -> list[list[str]]:
    """The jaxllmq commands in shell lines, split like a shell would: [module, *args]."""
    out = []
    for line in lines:
        for part in re.split(r"&&", line):
            words = shlex.split(part)
            if "-m" in words and words[words.index("-m") + 1].startswith("jaxllmq"):
                out.append(words[words.index("-m") + 1 :])
            # The launchers pass their flags on to jaxllmq.main.
            for i, w in enumerate(words):
                if w in ("launch/local.sh", "launch/slurm.sbatch"):
                    flags = [a for a in words[i + 1 :] if a.startswith("--")]
                    out.append(["jaxllmq.main", *flags])
    return out


# Every fenced command, and the tutorial's inline ones (its prose teaches them too; elsewhere
# inline spans hold placeholders such as `--flagfile=configs/X.flags`).
INLINE = re.findall(r"`(python -m jaxllmq[^`]*)`", section("Tutorial"))
COMMANDS = parse(fenced_lines(README) + [s.replace("\n", " ") for s in INLINE])


def test_readme_has_the_tutorial_commands():
    modules = {c[0] for c in COMMANDS}
    assert {"jaxllmq.main", "jaxllmq.plot", "jaxllmq.data.prepare", "jaxllmq.generate"} <= modules
    for launcher in set(re.findall(r"launch/[\w.-]+", "\n".join(fenced_lines(README)))):
        # Run as `launch/local.sh ...`, a script must be executable; sbatch only reads its file.
        mode = os.X_OK if launcher.endswith(".sh") else os.R_OK
        assert os.access(os.path.join(ROOT, launcher), mode), launcher


@pytest.mark.parametrize("module", sorted({c[0] for c in COMMANDS}))
def test_readme_flags_exist(module):
    def help_text(flag: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", module, flag]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)

    proc = help_text("--helpfull")  # absl tools
    if proc.returncode == 2:  # argparse tools (data.prepare)
        proc = help_text("--help")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    defined = set(re.findall(r"--(?:\[no\])?(\w+)", proc.stdout + proc.stderr))
    for cmd in (c for c in COMMANDS if c[0] == module):
        for arg in cmd[1:]:
            if not arg.startswith("--"):
                continue
            name = arg[2:].split("=")[0]
            assert name in defined or name.removeprefix("no") in defined, (module, arg)
            if name == "flagfile":
                assert os.path.exists(os.path.join(ROOT, arg.split("=", 1)[1])), arg


def _needs_outside_files(cmd: list[str]) -> bool:
    """Whether a command reads the user's own files (an HF model, a corpus: absolute paths)."""
    return any(a.split("=", 1)[-1].startswith("/") for a in cmd[1:])


# Appended to the README's commands (later flags win) so the tutorial runs in CI time: as written
# it tokenizes a 32 MB corpus (~20 s) and trains 150 steps (~3 min on 2 cores). A 0.3 MB corpus
# (a 22k-token shard, a 1.3k-token eval set) and 4 steps of 2 x 64 tokens with one mid-run eval
# still exercise every part of the path: tokenizer, shards, train and eval steps, the log, the HF
# export, sampling.
SHRINK = {
    "jaxllmq.data.prepare": ["--quickstart_mb=0.3"],
    "jaxllmq.main": [
        *("--steps=4", "--warmup=1", "--eval_every_n_steps=2", "--eval_num_steps=1"),
        *("--seq_len=64", "--batch_size=2"),
    ],
    "jaxllmq.generate": ["--max_new_tokens=8"],
}


def test_readme_tutorial_runs_on_cpu(tmp_path):
    """The tutorial's commands that need no GPU and no files of the user's, run in its order from
    a fresh directory holding only configs/: each reads what the one before it wrote, so a path
    or flag that drifts in the README fails here."""
    cmds = [c for c in parse(fenced_lines(section("Tutorial"))) if not _needs_outside_files(c)]
    modules = [c[0] for c in cmds]
    assert modules == ["jaxllmq.data.prepare", "jaxllmq.main", "jaxllmq.plot", "jaxllmq.generate"]
    shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")
    # A reader's CPU is one device; the suite's 8 fake ones (conftest) would make 8x the batch.
    xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(xla), "PYTHONPATH": ROOT}
    outs = {}
    for cmd in cmds:
        argv = [sys.executable, "-m", *cmd, *SHRINK.get(cmd[0], [])]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env)
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-3000:])
        outs[cmd[0]] = (cmd, proc.stdout)

    def arg(module: str, name: str) -> str:
        return next(a.split("=", 1)[1] for a in outs[module][0] if a.startswith(f"--{name}="))

    data = tmp_path / arg("jaxllmq.data.prepare", "out_dir")
    assert (data / "train-000.bin").exists() and (data / "eval.bin").exists()
    log = tmp_path / outs["jaxllmq.plot"][0][1]  # the log the plot command reads
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if r["log"] == "step"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["log"] == "eval"][-1] == 4
    assert png_size(tmp_path / arg("jaxllmq.plot", "out")) == (1200, 800)
    model = tmp_path / arg("jaxllmq.generate", "model")
    assert (model / "config.json").exists() and (model / "model.safetensors").exists()
    prompt = arg("jaxllmq.generate", "prompt")
    assert outs["jaxllmq.generate"][1].startswith(prompt), outs["jaxllmq.generate"][1][:200]
