# Sourced by the sbatch scripts in slurm/. Finds mpitp, activates its venv, and checks
# that the ranks really form one MPI world before the real work starts.
#
#   MPITP_HOME   the mpitp checkout (bin/ lives there); default: where sbatch was run
#   MPITP_VENV   virtual environment with mpitp installed; default: $MPITP_HOME/.venv
#                (set it to "none" to use whatever python/mpitp is on PATH, e.g. a module)
MPITP_HOME=${MPITP_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
MPITP_VENV=${MPITP_VENV:-$MPITP_HOME/.venv}
if [ "$MPITP_VENV" != none ]; then
  if [ ! -x "$MPITP_VENV/bin/python" ]; then
    echo "mpitp: no virtual environment at $MPITP_VENV (set MPITP_VENV, or MPITP_VENV=none)" >&2
    exit 2
  fi
  export PATH="$MPITP_VENV/bin:$PATH" PYTHON="$MPITP_VENV/bin/python"
fi
RUN="$MPITP_HOME/bin/mpitp-run"

mpitp_check_world() {
  # One line from rank 0: the world size MPI reports. A mismatch means srun started
  # singletons (wrong or missing --mpi) or the launcher dropped ranks.
  local want=${SLURM_NTASKS:-1} got
  got=$("$RUN" "$@" -- python -c "from mpi4py import MPI; c = MPI.COMM_WORLD; c.rank or print(c.size)" | tail -n 1)
  if [ "$got" != "$want" ]; then
    echo "mpitp: expected a world of $want rank(s), MPI reports '$got'. With srun use --mpi=pmi2 (MPICH) or --mpi=pmix (Open MPI); bin/mpitp-run chooses for you." >&2
    exit 3
  fi
  echo "mpitp: world of $got rank(s) on ${SLURM_JOB_NUM_NODES:-1} node(s): OK"
}
