"""splitkv's notices are records of the ``splitkv`` logger: silent until the application
configures logging (the package's NullHandler), routed like any other logger once it does,
gathered by ``caught_notices`` without reaching a handler, and ``note:`` lines on stderr
while a command of the ``splitkv`` command line runs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import splitkv
from splitkv import cli
from splitkv._log import caught_notices, logger
from splitkv.planner import profile_lookup, profiles

ROOT = Path(splitkv.__file__).resolve().parents[1]
# a load_profile that gives the prior's notice (a device no profile is shipped for)
PRIOR = ("from splitkv.planner.profile_lookup import load_profile; "
         "load_profile(device_name='Acme GPU 9000', num_sms=40)")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.delenv(profiles.PROFILE_ENV, raising=False)
    monkeypatch.delenv(profiles.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profile_lookup, "_warned_prior", set())
    monkeypatch.setattr(profiles, "_warned_files", set())


def run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop(profiles.PROFILE_ENV, None)
    return subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, env=env, timeout=120)


def test_the_package_gives_its_logger_a_null_handler_only():
    assert logger is logging.getLogger("splitkv") and logger.propagate
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert all(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_nothing_prints_until_the_application_configures_logging(tmp_path):
    """No handler configured: the notice is not printed (nor raised as a warning: -W error);
    after basicConfig it is a WARNING record of the logger named splitkv."""
    quiet = run_python(PRIOR, tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    routed = run_python("import logging; logging.basicConfig(); " + PRIOR, tmp_path)
    assert routed.returncode == 0, routed.stderr
    assert routed.stderr.startswith("WARNING:splitkv:splitkv has no calibrated profile for "
                                    "'Acme GPU 9000' with 40 SMs"), routed.stderr
    silenced = run_python("import logging; logging.basicConfig(); "
                          "logging.getLogger('splitkv').setLevel(logging.ERROR); " + PRIOR,
                          tmp_path)
    assert silenced.returncode == 0 and silenced.stderr == "", silenced.stderr


def test_caught_notices_keeps_them_from_every_handler(notices):
    logger.setLevel(logging.ERROR)           # an operator's setting does not hide them from it
    try:
        with notices() as said:
            with caught_notices() as caught:
                logger.info("probed")
                logger.warning("skipped a file")
                logger.debug("below INFO")
        assert [r.getMessage() for r in caught] == ["probed", "skipped a file"]
        assert [r.levelno for r in caught] == [logging.INFO, logging.WARNING]
        assert not said.messages                  # no handler saw them
        assert logger.level == logging.ERROR and not logger.filters
    finally:
        logger.setLevel(logging.NOTSET)


def test_the_command_line_prints_notices_as_notes(monkeypatch, capsys):
    """While a command runs, the library's notices (INFO too) are one ``note:`` line each on
    stderr; the logger is as it was afterwards."""
    def command(argv):
        logger.info("timed the probes")
        logger.warning("two\nlines")
        return 0

    monkeypatch.setattr(cli, "_dispatch", command)
    handlers = list(logger.handlers)
    assert cli.main(["anything"]) == 0
    assert capsys.readouterr().err == "note: timed the probes\nnote: two\\nlines\n"
    assert logger.handlers == handlers and logger.level == logging.NOTSET


def test_splitkv_plan_says_the_priors_notice_once(capsys):
    assert cli.main(["plan", "--device-name", "Acme GPU 9000", "--num-sms", "40"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "note: splitkv has no calibrated profile for 'Acme GPU 9000' with 40 SMs"), err


def test_splitkv_env_lists_a_skipped_profile_among_its_warnings(notices):
    """``splitkv env`` gathers the notices its probes give into the report (not printed)."""
    from splitkv.cli import env as env_cli

    path = profiles.user_profile_path("NVIDIA H200")
    path.parent.mkdir(parents=True)
    path.write_text("coef: [oops\n")
    with notices() as said:
        report = env_cli.collect()
    assert not said.messages
    assert report["profile"].startswith("shipped"), report["profile"]
    assert [w for w in report["warnings"] if str(path) in w and "ignoring it" in w], report
