"""What a newcomer's broken setup meets at the command line: one line saying what is wrong and
an exit status, never a traceback. A profile named in $SPLITKV_PROFILE that cannot be read; an
install without SciPy (planning needs none: only fitting does); a dependency that does not
import while a command runs."""

from __future__ import annotations

import subprocess
import sys

from splitkv import cli


def test_a_missing_profile_in_the_environment_is_one_line(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    run = subprocess.run([sys.executable, "-m", "splitkv", "demo"], capture_output=True,
                         text=True, env={"SPLITKV_PROFILE": str(missing), "PATH": "",
                                         "XDG_CACHE_HOME": str(tmp_path)})
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert str(missing) in run.stderr and "$SPLITKV_PROFILE" in run.stderr


def test_plan_runs_without_scipy():
    code = ("import sys; sys.modules['scipy'] = None; sys.modules['scipy.optimize'] = None\n"
            "from splitkv.cli import main; sys.exit(main(['plan', '--batch', '2']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "plan:      Plan(" in run.stdout


def test_a_dependency_that_does_not_import_is_named(monkeypatch, capsys):
    def run(args):
        raise ModuleNotFoundError("No module named 'scipy'", name="scipy")

    module = cli.load_command("plan")
    monkeypatch.setattr(module, "run", run)
    assert cli.main(["plan"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs scipy" in err
