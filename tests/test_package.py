"""The wheel users install: built offline from the checkout, installed apart from the
editable copy, it imports, finds its presets and runs its command line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_imports_and_runs_its_command_line(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    # the build backend of this environment, no index: nothing is downloaded
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
        "-w", str(wheels), str(ROOT))
    (wheel,) = wheels.glob("memattn-*.whl")
    run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target),
        str(wheel))
    # the installed copy comes first on the path, ahead of the checkout's editable one
    env = dict(os.environ, PYTHONPATH=str(target))
    code = ("import memattn, memattn.cli\n"
            "from memattn.config import load_config\n"
            "print(memattn.__file__)\n"
            "print(load_config('demo', []).model.attention.name)\n")
    where, attention = run(sys.executable, "-c", code, env=env, cwd=tmp_path).split()
    assert Path(where).is_relative_to(target) and attention
    assert "usage: memattn" in run(str(target / "bin" / "memattn"), "--help", env=env, cwd=tmp_path)
    info = run(sys.executable, "-m", "memattn", "info", "--config", "tiny", env=env, cwd=tmp_path)
    assert "parameters" in info
