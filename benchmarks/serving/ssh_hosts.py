"""Test hosts that Ray's cluster launcher reaches over SSH, as it reaches on-premises machines.

Each host is a network namespace of `separate_hosts.namespaces` (its own address, routed by
this machine) whose processes also get their own hostname, process IDs (`ray stop` on one
host sees only that host's processes), /dev/shm, /tmp and root's home. Its init (a
process-reaping PID 1) runs an sshd that admits a throw-away key. What the hosts share with
this machine is the rest of the file system: the Python the venvs are made from (kept
visible under the private home and /tmp) and the system's packages (ssh, rsync, redis).
Killing the namespace's processes ends the host and everything it started."""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.serving.separate_hosts import SUBNET, kill_all_in, namespaces

REAPER = """
import os, signal, subprocess, sys
child = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: child.terminate())
while True:
    pid, status = os.wait()
    if pid == child.pid:
        sys.exit(os.waitstatus_to_exitcode(status))
"""
"""PID 1 of a host: runs sshd and reaps the orphans (daemons started by `nohup ... &`)."""

LEFT_BEHIND = ("ray", "raylet", "gcs_server", "splitserve", "cluster.cli", "redis-server")
"""Words of the command lines `ray down` must leave no process of."""

SSHD_CONFIG = """\
ListenAddress {address}
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AuthorizedKeysFile /root/.ssh/authorized_keys
UsePAM no
StrictModes no
PidFile none
MaxStartups 100
MaxSessions 100
Subsystem sftp internal-sftp
"""


def unavailable() -> str | None:
    """Why SSH test hosts cannot be made here, or None."""
    from benchmarks.serving.separate_hosts import unavailable as no_namespaces

    if (why := no_namespaces()) is not None:
        return why
    for tool in ("/usr/sbin/sshd", "ssh", "ssh-keygen", "rsync"):
        if not (os.path.exists(tool) if tool.startswith("/") else shutil.which(tool)):
            return f"SSH test hosts need openssh-server, openssh-client and rsync ({tool} is missing)"
    if not Path("/etc/ssh/ssh_host_ed25519_key").exists():
        return "SSH test hosts need sshd's host key (/etc/ssh/ssh_host_ed25519_key)"
    return None


def kept_paths() -> list[str]:
    """What every host must still see under its private home and /tmp: the Python
    installation and this environment (the hosts' venvs point at them)."""
    return sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})


class SshHosts:
    """`names` as SSH hosts (the i-th at 10.77.i.2), their files under `root/NAME`:
    `home` (root's home there), `tmp`, `shm`. `key` is the private key they admit."""

    def __init__(self, netns: dict[str, str], names: tuple[str, ...], root: Path) -> None:
        self.netns, self.names, self.root = netns, names, root
        self.key = root / "id_ed25519"
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "splitserve-test", "-f", str(self.key)],
                       check=True, capture_output=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for name in names:
            self._start(name)
        for name in names:
            self._wait_ssh(name)

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}.2"

    def dir(self, name: str, part: str) -> Path:
        """`home`, `tmp` or `shm` of host `name`, as this machine sees it."""
        return self.root / name / part

    def _start(self, name: str) -> None:
        for part in ("home", "tmp", "shm"):
            self.dir(name, part).mkdir(parents=True, exist_ok=True)
        self.dir(name, "tmp").chmod(0o1777)
        ssh_dir = self.dir(name, "home") / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        (ssh_dir / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        config = self.dir(name, "home") / ".sshd_config"
        config.write_text(SSHD_CONFIG.format(address=self.address(name)))
        lines = ["set -e", f"hostname {name}", f"mount --bind {self.dir(name, 'shm')} /dev/shm"]
        for private, over in (("home", "/root"), ("tmp", "/tmp")):
            for path in kept_paths():
                if path == over or path.startswith(over + "/"):
                    inside = self.dir(name, private) / os.path.relpath(path, over)
                    lines += [f"mkdir -p {shlex.quote(str(inside))}",
                              f"mount --rbind {shlex.quote(path)} {shlex.quote(str(inside))}"]
            lines.append(f"mount --rbind {self.dir(name, private)} {over}")
        lines.append(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(REAPER)} /usr/sbin/sshd -D -e "
                     f"-f /root/.sshd_config")
        log = (self.root / f"{name}-sshd.log").open("a")
        subprocess.Popen(["ip", "netns", "exec", self.netns[name], "unshare", "--mount", "--uts", "--pid", "--fork",
                          "--mount-proc", "sh", "-c", "\n".join(lines)], stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)

    def ssh(self, name: str, command: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """Runs `command` on host `name` through its sshd, as root."""
        return subprocess.run(["ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o",
                               "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                               "-o", "ConnectTimeout=5", f"root@{self.address(name)}", command],
                              capture_output=True, text=True, timeout=timeout_s)

    def _wait_ssh(self, name: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.ssh(name, "hostname")
            if done.returncode == 0 and done.stdout.strip() == name:
                return
            if time.monotonic() > deadline:
                log = (self.root / f"{name}-sshd.log").read_text()[-2000:]
                raise AssertionError(f"host {name}: sshd did not answer ({done.stderr.strip()}) {log}")
            time.sleep(0.3)

    def processes(self, name: str) -> list[str]:
        """The command lines of what runs on host `name`, but its init and sshd."""
        out = []
        pids = subprocess.run(["ip", "netns", "pids", self.netns[name]], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                line = " ".join(a.decode(errors="replace") for a in argv if a)
                if line and "sshd" not in line:  # (the init's command line runs sshd too)
                    out.append(line)
        return out

    def left_running(self) -> dict[str, list[str]]:
        """What of splitserve, Ray or Redis still runs, by host (hosts running none left out)."""
        found = {h: [p[:160] for p in self.processes(h) if any(w in p for w in LEFT_BEHIND)] for h in self.names}
        return {h: ps for h, ps in found.items() if ps}

    def preinstall(self, name: str, env: str = "splitserve-env") -> None:
        """Gives host `name` what a package index would: a venv at ~/`env` whose site-packages
        see this environment's packages (the test hosts reach no index, and installing torch and
        Ray from one takes minutes), that environment's `ray` command, and a pip told that there
        is no index and no build isolation. A cluster file's pip commands then find every
        dependency installed and build and install splitserve itself from what they are given."""
        import sysconfig

        home = self.dir(name, "home")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / env)], check=True)
        site = home / env / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        (site / "_preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        ray = home / env / "bin" / "ray"
        ray.write_text(f"#!/root/{env}/bin/python\nimport sys\nfrom ray.scripts.scripts import main\n"
                       "sys.exit(main())\n")
        ray.chmod(0o755)
        # Ray's autoscaler looks at the cluster every AUTOSCALER_UPDATE_INTERVAL_S (5 s by
        # default): ticks it waited out were ~10 s of a `ray up` here, and the test checks none
        # of Ray's timing. (Ray runs every command in a login shell, which reads ~/.bashrc.)
        (home / ".bashrc").write_text("export AUTOSCALER_UPDATE_INTERVAL_S=1\n")
        pip = home / ".config" / "pip"
        pip.mkdir(parents=True, exist_ok=True)
        # (pip reads a `no-` option's value inverted: false here means --no-build-isolation)
        (pip / "pip.conf").write_text("[global]\nno-index = true\ndisable-pip-version-check = true\n"
                                      "[install]\nno-build-isolation = false\n")

    def seed_conversion(self, name: str, converted: Path) -> None:
        """Puts `converted`, a GGUF file's directory in this machine's cache
        (engine/checkpoints/gguf_checkpoint.py), at the same place in host `name`'s cache (its home's
        default one), as that host's own first use would leave it (hard links; copies across
        file systems): the hosts see this environment's GGUF files at the same paths, so their
        cache keys are the same."""
        from engine.checkpoints.gguf_checkpoint import cache_root

        target = self.dir(name, "home") / ".cache" / "splitserve" / converted.relative_to(cache_root())
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(converted, target, copy_function=_link_or_copy)

    def stop(self) -> None:
        for name in self.names:
            kill_all_in(self.netns[name])


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")


def onprem_file(hosts: SshHosts, cluster_name: str, swaps: dict[str, str] | None = None) -> str:
    """deploy/onprem.yaml for hosts `h` (head), `p` (prefill) and `d` (decode): `swaps`
    first (on the file as written), then their addresses, root with the throw-away key, and
    the CPU in place of the GPU (each must match, so a change to the file fails loudly)."""
    text = (REPO / "deploy" / "onprem.yaml").read_text()
    every = [*(swaps or {}).items(), ("10.0.0.10", hosts.address("h")), ("10.0.0.11", hosts.address("p")),
             ("10.0.0.12", hosts.address("d")), ("ssh_user: ubuntu", "ssh_user: root"),
             ("~/.ssh/id_ed25519", str(hosts.key)), ("cluster_name: splitserve-onprem", f"cluster_name: {cluster_name}"),
             ("[gpu]", ""), ("--device cuda --dtype bfloat16", "--device cpu")]
    for old, new in every:
        if old not in text:
            raise AssertionError(f"deploy/onprem.yaml no longer has {old!r}: update benchmarks/serving/ssh_hosts.py")
        text = text.replace(old, new)
    return text


def checkout(dest: Path) -> Path:
    """A copy at `dest` of what `git` sees of this checkout (tracked files and untracked ones
    it does not ignore: what the cluster file's rsync sends), for `ray_cli` to run from. From
    the checkout itself `ray up` reads every file under `.`, the 2.8 GB `.venv` included, to
    hash the file mount (~7 s of CPU). Without git, the checkout itself."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=False)
    if listed.returncode != 0:
        return REPO
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def ray_cli(*args: str, timeout_s: float, cwd: Path = REPO) -> tuple[float, str]:
    """`ray ARGS` from `cwd` (the file mounts `.`; `checkout`): its seconds and output;
    AssertionError with the output's end when it fails."""
    started = time.monotonic()
    done = subprocess.run([str(RAY), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise AssertionError(f"ray {args[0]} failed ({done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}")
    return took, done.stdout + done.stderr


def ray_down_quietly(config: Path, cluster_name: str, cwd: Path = REPO) -> None:
    """`ray down` whatever state the cluster is in, and the launcher's own record of it."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([str(RAY), "down", "-y", str(config)], cwd=cwd,
                       capture_output=True, timeout=240)
    for leftover in Path("/tmp/ray").glob(f"cluster-{cluster_name}.*"):
        leftover.unlink()


@contextlib.contextmanager
def ssh_hosts(names: tuple[str, ...], root: Path) -> Iterator[SshHosts]:
    """Hosts `names` (the first at 10.77.1.2), removed with everything they ran on the way out."""
    with namespaces(names) as netns:
        hosts = SshHosts(netns, names, root)
        try:
            yield hosts
        finally:
            hosts.stop()
