"""Outer test process. Multi-rank suites live in tests/mpi/ and run under a real
``mpiexec`` (see test_mpi_suites.py); they are not collected here directly."""

import os

collect_ignore = [] if os.environ.get("MPITP_INNER") else ["mpi"]
