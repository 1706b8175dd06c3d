"""A real Docker engine for the deployment tests: Debian's docker.io started without a bridge; the README's commands.

The engine is the one Debian 12 ships (Engine 20.10). Where no engine answers, it is installed with apt and
started as ``dockerd --bridge=none --iptables=false``: containers then have the host's network alone, the
host's firewall is left as it was, and the engine is stopped again at the end. The README's Deploy commands
run verbatim, one line at a time, through ``bash`` in a copy of the checkout; exported variables carry from
one line to the next as they would in the user's shell.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PACKAGES = ("docker.io", "debootstrap")  # the engine, and what docker/base-image.sh builds the base image with
ENGINE_START_TIMEOUT_S = 60.0
ENGINE_STOP_TIMEOUT_S = 30.0
LINE_TIMEOUT_S = 900.0  # a limit, not a wait: the first torch image build on two busy cores


def unavailable() -> Optional[str]:
    """Why this machine cannot run the engine tests, or None."""
    if sys.platform != "linux":
        return f"a Docker engine on Linux is needed; this is {sys.platform}"
    if os.geteuid() != 0:
        return "root is needed to install and start the Docker engine (dockerd) and to build the base image"
    if shutil.which("apt-get") is None and shutil.which("dockerd") is None:
        return "neither dockerd nor apt-get (to install Debian's docker.io) is on the PATH"
    return None


def readme_compose_blocks() -> list[list[str]]:
    """The command lines of each code block under the README's "On one machine, with Docker Compose"."""
    text = README.read_text()
    section = text.split("### On one machine, with Docker Compose", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"^```(?:sh)?\n(.*?)^```", section, re.S | re.M)
    return [[line for line in block.splitlines() if line.strip()] for block in blocks]


class Phases:
    """Wall-clock seconds of each named phase, printed as each ends and together at the end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        print(f"e2e phase: {name}: {seconds:.1f} s", flush=True)

    def timed(self, name: str):
        phases = self

        class _Timer:
            def __enter__(self):
                self.t0 = time.monotonic()

            def __exit__(self, *exc):
                phases.add(name, time.monotonic() - self.t0)

        return _Timer()

    def summary(self) -> str:
        return "; ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())


class Engine:
    """The Docker engine: installed with apt and started without a bridge where none answers; stopped at the
    end only if started here."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self._dockerd: Optional[subprocess.Popen] = None

    @staticmethod
    def answers() -> bool:
        return shutil.which("docker") is not None and subprocess.run(
            ["docker", "info"], capture_output=True, timeout=30).returncode == 0

    def __enter__(self) -> "Engine":
        missing = [p for p, tool in zip(PACKAGES, ("dockerd", "debootstrap")) if shutil.which(tool) is None]
        if missing:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
                run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
                assert run.returncode == 0, f"{' '.join(command)} exited {run.returncode}:\n{run.stdout}{run.stderr}"
        if not self.answers():
            log = open(self.log_dir / "dockerd.log", "ab")
            # No bridge and no iptables rules: containers use the host's network (loopback only, as the
            # host-network override and RESHARD_LISTEN_IP=127.0.0.1 arrange), and the firewall stays as it was.
            self._dockerd = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false"], stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
            while not self.answers():
                code = self._dockerd.poll()
                assert code is None, f"dockerd exited {code}: {(self.log_dir / 'dockerd.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"dockerd did not answer in {ENGINE_START_TIMEOUT_S} s"
                time.sleep(0.5)
        return self

    @property
    def started_here(self) -> bool:
        return self._dockerd is not None

    def __exit__(self, *exc) -> None:
        if self._dockerd is None:
            return
        self._dockerd.terminate()  # dockerd stops its containers and the containerd it started
        try:
            self._dockerd.wait(ENGINE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._dockerd.kill()
            self._dockerd.wait()


def copy_checkout(dest: Path) -> Path:
    """The files git tracks or would track (what a fresh clone plus this change holds), copied to ``dest``:
    the README's commands write token files and a .env where they run, never into the working tree."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


class Shell:
    """Runs command lines as a user types them into one bash session, in ``cwd``: each line its own bash,
    exported variables carried to the next through a file."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path):
        self.cwd = cwd
        self.env = env
        self.log = log
        self._state = cwd.parent / "shell-exports.sh"
        self._state.write_text("")

    def __call__(self, line: str, timeout: float = LINE_TIMEOUT_S) -> str:
        script = f"set -e\n. {self._state}\n{line}\nexport -p > {self._state}\n"
        run = subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        with open(self.log, "a") as log:
            log.write(f"$ {line}\n{run.stdout}{run.stderr}[exit {run.returncode}]\n")
        assert run.returncode == 0, f"`{line}` exited {run.returncode}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
        return run.stdout

    def variable(self, name: str) -> str:
        return subprocess.run(["bash", "-c", f". {self._state}; printf %s \"${name}\""], env=self.env,
                              capture_output=True, text=True, check=True).stdout
