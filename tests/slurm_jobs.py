"""Submit a batch job and wait for it, as ``sbatch --wait`` does, but polling the job's
state every 0.2 s: sbatch --wait polls slurmctld at intervals that grow to 10 s, so a job
done in one second was seen done after 10, and the SLURM tests spent most of their time
waiting for sbatch to look (every job took a multiple of 10 s)."""

import re
import subprocess
import time

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
DONE |= {"OUT_OF_MEMORY"}


class Job:
    """A submitted job, with the part of Popen's interface the tests use (poll,
    communicate, kill, returncode); the exit code is the job's, as sbatch --wait's."""

    def __init__(self, argv: list[str], env: dict, cwd=None):
        argv = [a for a in argv if a != "--wait"]
        res = subprocess.run([argv[0], "--parsable", *argv[1:]], capture_output=True, text=True, env=env, cwd=cwd)
        self.env, self.returncode, self.stderr = env, None, res.stderr
        self.id = res.stdout.strip().split(";")[0]
        if res.returncode != 0 or not self.id:
            self.returncode = res.returncode or 1

    def poll(self):
        if self.returncode is None:
            info = subprocess.run(
                ["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True, env=self.env
            ).stdout
            state = re.search(r"JobState=(\S+)", info)
            code = re.search(r"ExitCode=(\d+):(\d+)", info)
            if state and state.group(1) in DONE:
                status, signal = (int(code.group(1)), int(code.group(2))) if code else (1, 0)
                ok = state.group(1) == "COMPLETED"
                self.returncode = status or (128 + signal if signal else (0 if ok else 1))
        return self.returncode

    def communicate(self, timeout: float | None = None):
        deadline = time.monotonic() + (timeout or 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"job {self.id}", timeout or 0)
            time.sleep(0.2)
        return "", self.stderr

    def kill(self):
        subprocess.run(["scancel", self.id], capture_output=True, env=self.env)
        if self.returncode is None:
            self.returncode = -9


def run(argv: list[str], *, env: dict, timeout: float, cwd=None, **_) -> subprocess.CompletedProcess:
    """``subprocess.run(["sbatch", "--wait", ...])``'s result, without its slow polling."""
    job = Job(argv, env, cwd)
    try:
        out, err = job.communicate(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    return subprocess.CompletedProcess(argv, job.returncode, out, err)
