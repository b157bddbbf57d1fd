"""The README's commands: every `python -m jaxllmq...` names a real module, real flags and real
flagfiles; the tutorial's plot command runs as written on a quickstart-shaped log. (Training the
quickstart itself takes minutes: it is the README's, run by hand, not here.)"""

import os
import re
import shlex
import subprocess
import sys

import pytest
from test_plot import png_size, write_jaxllmq_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[list[str]]:
    """The jaxllmq commands in the README's fenced blocks, split like a shell would."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    out = []
    for block in re.findall(r"```\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
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


COMMANDS = readme_commands()


def test_readme_has_the_tutorial_commands():
    modules = {c[0] for c in COMMANDS}
    assert {"jaxllmq.main", "jaxllmq.plot", "jaxllmq.data.prepare", "jaxllmq.generate"} <= modules


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


def test_readme_plot_command_runs(tmp_path):
    (cmd,) = [c for c in COMMANDS if c[0] == "jaxllmq.plot" and "runs/quickstart/log.jsonl" in c]
    write_jaxllmq_log(tmp_path / "runs" / "quickstart" / "log.jsonl")
    subprocess.run([sys.executable, "-m", *cmd], check=True, capture_output=True, cwd=tmp_path)
    out = next(a.split("=", 1)[1] for a in cmd if a.startswith("--out="))
    assert png_size(tmp_path / out) == (1200, 800)
