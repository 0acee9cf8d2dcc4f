"""Logging with the rank in every record: rank 0 at INFO and the others at WARNING by
default, MPITP_LOG_LEVEL / --log-level for every rank, MPITP_LOG_DIR one file per rank."""

import os
import sys
import textwrap

from mpitp import launch

SCRIPT = textwrap.dedent("""
    import mpitp
    from mpitp.log import get_logger
    comm = mpitp.Communicator()
    log = get_logger("test")
    log.debug("debug from %d", comm.rank)
    log.info("info from %d", comm.rank)
    log.warning("warning from %d", comm.rank)
""")


def run(n, **env):
    res = launch.run(n, [sys.executable, "-c", SCRIPT], timeout=60, env=dict(os.environ, **env))
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_default_levels_by_rank():
    err = run(3)
    assert "[rank 0/3 " in err and "INFO mpitp.test: info from 0" in err
    for r in (1, 2):
        assert f"info from {r}" not in err and f"[rank {r}/3 " in err and f"WARNING mpitp.test: warning from {r}" in err
    assert "debug from" not in err


def test_level_from_the_environment_and_files_per_rank(tmp_path):
    err = run(2, MPITP_LOG_LEVEL="debug", MPITP_LOG_DIR=str(tmp_path))
    assert "debug from 0" in err and "debug from 1" in err
    for r in (0, 1):
        text = (tmp_path / f"rank{r:05d}.log").read_text()
        assert f"[rank {r}/2 " in text and f"debug from {r}" in text and f"from {1 - r}" not in text


def test_cli_log_level(tmp_path):
    res = launch.run(
        2,
        [
            sys.executable,
            "-m",
            "mpitp.cli.main",
            "train",
            "--config",
            "tiny",
            "--data-default",
            "--steps",
            "1",
            "--seq",
            "16",
            "--batch",
            "2",
            "--no-progress",
            "--log-level",
            "warning",
        ],
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "train fsdp on 2" not in res.stderr  # INFO silenced on rank 0 too
    bad = launch.run(1, [sys.executable, "-m", "mpitp.cli.main", "info", "--log-level", "chatty"], timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
