"""A real Slurm (22.05, Debian packages) on loopback, for tests and for humans.

One controller and one ``slurmd`` per fake GPU node, all children of this process, running in the
foreground (``-D`` / ``-F``) so that stopping them takes a fraction of a second (detached daemons
took 4 to 9 s to stop here; see ../shared/SLURM-TESTBED.md for every setting below and why).

    with SlurmTestbed(tmp_path) as tb:
        subprocess.run(["sinfo"], env=tb.env)

Nodes (all on 127.0.0.1, each with its own port, fake GPUs as character devices in ``workdir/dev``):

    v100-node1  Gres=gpu:v100:4  partition v100 (default)
    a100-node1  Gres=gpu:a100:4  partition a100
    h100-node1  Gres=gpu:h100:4  partition h100
    h100-node2  Gres=gpu:h100:4  partition h100 (a two-node job of one GPU type can run)

Everything (config, munge key and socket, spool, state, logs) lives in ``workdir``. Jobs run as the
user who submits them (root in the tests). ``python -m vest_slurm.testbed start|stop|status DIR``
runs the same code under a detached supervisor process (``scripts/slurm-testbed.sh`` wraps it).

Known limitations:
- needs root (munged, slurmd and mknod do); tests skip only when the Slurm binaries are missing.
- the ports are picked free just before the daemons bind them; another process could take one in
  between (start() then fails with the daemon's log tail and can simply be retried).
- ``accounting=True`` (``start DIR --accounting``) adds slurmdbd with a MariaDB of its own (Debian's
  slurmdbd and mariadb-server), both on loopback, so that ``sacct`` answers: jobs' steps are
  gathered (jobacct_gather/linux) and their batch scripts stored (AccountingStoreFlags=job_script).
  MariaDB runs with --skip-grant-tables on 127.0.0.1 only: a throwaway database for one testbed.
- ``--bridge`` runs the same cluster with job_submit.lua and the decision server through
  ``vest_slurm.bridge.testbed.BridgeTestbed`` (configured from site-config/testbed.toml).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SlurmError

CLUSTER_NAME = "vest"
GPUS_PER_NODE = 4
# Declared per node; slurmd reports these instead of the real hardware because of
# SlurmdParameters=config_overrides (the CI machine has 2 cores, several small jobs must still run).
NODE_CPUS = 4
NODE_REAL_MEMORY_MB = 4000

START_TIMEOUT_S = 30.0      # from start() to every node idle
ACCOUNTING_START_S = 90.0   # more with accounting: a fresh MariaDB data directory, slurmdbd's schema
STOP_GRACE_S = 3.0          # SIGTERM, then SIGKILL after this long
POLL_INTERVAL_S = 0.02
# AF_UNIX paths are limited to 108 bytes (sun_path); munged's socket moves to a short temp dir
# when workdir is deeper than that.
_SUN_PATH_MAX = 107

DAEMONS = ("munged", "slurmctld", "slurmd")
ACCOUNTING_DAEMONS = ("mariadbd", "mariadb-install-db", "slurmdbd", "sacct", "sacctmgr")


@dataclass(frozen=True)
class TestNode:
    name: str
    partition: str
    gpu_type: str
    gpus: int = GPUS_PER_NODE
    default: bool = False


NODES: tuple[TestNode, ...] = (
    TestNode("v100-node1", "v100", "v100", default=True),
    TestNode("a100-node1", "a100", "a100"),
    TestNode("h100-node1", "h100", "h100"),
    TestNode("h100-node2", "h100", "h100"),   # a job over two nodes (sharded training) runs here
)


def missing_binaries() -> list[str]:
    """The Slurm/munge programs the testbed needs that are not installed."""
    progs = ["munged", "slurmctld", "slurmd", "sinfo", "scontrol", "sbatch", "squeue"]
    found = []
    for p in progs:
        path = shutil.which(p) or shutil.which(p, path="/usr/sbin:/usr/bin:/sbin:/bin")
        if not path:
            found.append(p)
    return found


def _which(prog: str) -> str:
    path = shutil.which(prog) or shutil.which(prog, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if not path:
        raise SlurmError(
            f"{prog} is not installed",
            "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client "
            "slurm-wlm-basic-plugins munge lua-cjson lua-socket",
        )
    return path


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def log_tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:])


class SlurmTestbed:
    """munged + slurmctld + one slurmd per node, as foreground children, on 127.0.0.1."""

    def __init__(self, workdir: str | os.PathLike, job_submit_lua: str | None = None,
                 extra_conf: str = "", accounting: bool = False):
        self.workdir = Path(workdir).resolve()
        self.accounting = accounting
        self.job_submit_lua = Path(job_submit_lua).resolve() if job_submit_lua else None
        self.extra_conf = extra_conf
        self.nodes = NODES
        self.etc = self.workdir / "etc"
        self.conf_path = self.etc / "slurm.conf"
        self.log_dir = self.workdir / "log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None
        self._short_dir: str | None = None
        self.env = dict(os.environ, SLURM_CONF=str(self.conf_path))
        # slurmdbd reads slurmdbd.conf beside $SLURM_CONF (get_extra_conf_path)

    # --- configuration ------------------------------------------------------------------------

    def _munge_socket(self) -> Path:
        sock = self.workdir / "munge" / "munge.socket.2"
        if len(str(sock)) <= _SUN_PATH_MAX - 8:  # munged adds ".lock" beside it
            return sock
        if self._short_dir is None:
            self._short_dir = tempfile.mkdtemp(prefix="vest-munge-")
            os.chmod(self._short_dir, 0o755)
        return Path(self._short_dir) / "munge.socket.2"

    def write_config(self) -> None:
        """Write slurm.conf, gres.conf, the munge key and every directory the daemons need."""
        w = self.workdir
        for d in ("etc", "log", "run", "state", "munge", "spool", "dev"):
            (w / d).mkdir(parents=True, exist_ok=True)
        # munged refuses group/world-writable directories on the socket's and key's paths.
        os.chmod(w / "munge", 0o755)
        key = w / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.munge_socket = self._munge_socket()
        self.munge_socket.parent.mkdir(parents=True, exist_ok=True)

        ctld_port, self.db_port, self.dbd_port, *node_ports = _free_ports(3 + len(self.nodes))
        self.ctld_port = ctld_port
        gres_lines = ["AutoDetect=off"]
        node_lines, part_lines = [], []
        for node, port in zip(self.nodes, node_ports):
            (w / "spool" / node.name).mkdir(parents=True, exist_ok=True)
            devdir = w / "dev" / node.name
            devdir.mkdir(parents=True, exist_ok=True)
            for i in range(node.gpus):
                dev = devdir / f"gpu{i}"
                if not dev.exists():
                    # Same major/minor as /dev/null: a harmless character device that gres/gpu accepts.
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            gres_lines.append(
                f"NodeName={node.name} Name=gpu Type={node.gpu_type} "
                f"File={devdir}/gpu[0-{node.gpus - 1}]"
            )
            node_lines.append(
                f"NodeName={node.name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={NODE_CPUS} RealMemory={NODE_REAL_MEMORY_MB} "
                f"Gres=gpu:{node.gpu_type}:{node.gpus} State=UNKNOWN"
            )
        for part in dict.fromkeys(n.partition for n in self.nodes):   # one line per partition, its nodes
            members = [n for n in self.nodes if n.partition == part]
            part_lines.append(
                f"PartitionName={part} Nodes={','.join(n.name for n in members)} "
                f"Default={'YES' if any(n.default for n in members) else 'NO'} MaxTime=INFINITE State=UP"
            )

        lines = [
            "# Written by vest_slurm.slurm.testbed; see ../shared/SLURM-TESTBED.md for why each setting.",
            f"ClusterName={CLUSTER_NAME}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CommunicationParameters=NoInAddrAny",
            f"StateSaveLocation={w / 'state'}",
            f"SlurmdSpoolDir={w / 'spool'}/%n",
            f"SlurmctldPidFile={w / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={w / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
        ] + (self._accounting_conf() if self.accounting else [
            "JobAcctGatherType=jobacct_gather/none",
            # GPU TRES accounting makes slurmctld refuse to start without slurmdbd.
            "AccountingStorageType=accounting_storage/none",
        ]) + [
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.log_dir / 'jobcomp.txt'}",
            "MailProg=/bin/true",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            # Without it a job takes the whole node's memory and jobs run one per node.
            "DefMemPerCPU=500",
            "GresTypes=gpu",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            # A job completes in about a second instead of three.
            "SchedulerParameters=batch_sched_delay=0",
            "SchedulerType=sched/backfill",
            "KillWait=1",
            "InactiveLimit=0",
            "MinJobAge=300",
            "PropagateResourceLimits=NONE",
            "MpiDefault=none",
        ]
        if self.job_submit_lua is not None:
            dest = self.etc / "job_submit.lua"
            if dest.is_symlink() or dest.exists():
                dest.unlink()
            # The plugin reads job_submit.lua beside slurm.conf and reloads it when its mtime changes.
            dest.symlink_to(self.job_submit_lua)
            lines.append("JobSubmitPlugins=lua")
        lines += node_lines + part_lines
        if self.extra_conf:
            lines.append(self.extra_conf.rstrip("\n"))
        self.conf_path.write_text("\n".join(lines) + "\n")
        (self.etc / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        # Nothing cgroup-related is used (proctrack/linuxproc, task/none); an empty cgroup.conf
        # keeps slurmd from looking at the system one.
        (self.etc / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")

    def _accounting_conf(self) -> list[str]:
        """slurm.conf lines for slurmdbd, and slurmdbd.conf itself (mode 0600, as slurmdbd demands)."""
        w = self.workdir
        (w / "mysql").mkdir(parents=True, exist_ok=True)
        dbd = self.etc / "slurmdbd.conf"
        dbd.write_text("\n".join([
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}",
            "DbdHost=localhost", "DbdAddr=127.0.0.1", f"DbdPort={self.dbd_port}", "SlurmUser=root",
            f"LogFile={self.log_dir / 'slurmdbd.log'}", f"PidFile={w / 'run' / 'slurmdbd.pid'}", "DebugLevel=info",
            "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={self.db_port}",
            "StorageUser=root", "StorageLoc=slurm_acct_db",
        ]) + "\n")
        os.chmod(dbd, 0o600)
        return [
            # step usage (TRESUsageInMax) is gathered by polling each task's /proc
            "JobAcctGatherType=jobacct_gather/linux",
            "JobAcctGatherFrequency=task=1",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.dbd_port}",
            # the connection to slurmdbd takes its munge socket from here, not from AuthInfo
            f"AccountingStoragePass={self.munge_socket}",
            # typed entries, so that AllocTRES says which GPU type a job ran on (vest audit groups by it)
            "AccountingStorageTRES=gres/gpu," + ",".join(f"gres/gpu:{t}" for t in sorted({n.gpu_type for n in self.nodes})),
            # the stored batch script carries vsbatch's #VEST-ESTIMATE line (vest audit reads it)
            "AccountingStoreFlags=job_script,job_comment",
        ]

    def _start_accounting(self, timeout_s: float, t0: float) -> None:
        """MariaDB (a fresh data directory), then slurmdbd, then the cluster's record."""
        mariadbd, install, slurmdbd = (_which(p) for p in ACCOUNTING_DAEMONS[:3])
        data = self.workdir / "mysql"
        if not (data / "mysql").exists():
            r = subprocess.run([install, "--no-defaults", f"--datadir={data}", "--user=root", "--skip-test-db",
                                "--auth-root-authentication-method=normal"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise SlurmError(f"testbed: mariadb-install-db failed: {r.stderr.strip()[-500:]}",
                                 "install mariadb-server (scripts/install.sh does)")
        self._spawn("mariadbd", [
            mariadbd, "--no-defaults", f"--datadir={data}", "--user=root", "--bind-address=127.0.0.1",
            f"--port={self.db_port}", f"--socket={data / 'mysqld.sock'}", f"--pid-file={data / 'mysqld.pid'}",
            "--skip-grant-tables", "--innodb-buffer-pool-size=32M", "--skip-log-bin",
            f"--log-error={self.log_dir / 'mariadb.log'}",
        ], "mariadb.out")
        self._wait_for(lambda: _port_open(self.db_port), "MariaDB to listen", timeout_s, t0,
                       self.log_dir / "mariadb.log")
        self._spawn("slurmdbd", [slurmdbd, "-D"], "slurmdbd.out")
        self._wait_for(lambda: _port_open(self.dbd_port), "slurmdbd to listen", timeout_s, t0,
                       self.log_dir / "slurmdbd.log")
        subprocess.run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], env=self.env, capture_output=True,
                       text=True, timeout=30)

    # --- lifecycle ----------------------------------------------------------------------------

    def _spawn(self, key: str, argv: list[str], log_name: str) -> None:
        out = open(self.log_dir / log_name, "ab")
        try:
            self.procs[key] = subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        finally:
            out.close()

    def start(self, timeout_s: float | None = None) -> "SlurmTestbed":
        """Start munged, slurmctld and the slurmds; return once every node is idle."""
        if timeout_s is None:
            timeout_s = START_TIMEOUT_S + (ACCOUNTING_START_S if self.accounting else 0)
        t0 = time.monotonic()
        munged, slurmctld, slurmd = (_which(p) for p in DAEMONS)
        _which("sinfo")
        self.write_config()
        m = self.workdir / "munge"
        try:
            self._spawn("munged", [
                munged, "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={m / 'munge.key'}",
                f"--log-file={self.log_dir / 'munged.log'}", f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}", "--num-threads=2",
            ], "munged.out")
            self._wait_for(lambda: self.munge_socket.exists(), "munged", timeout_s, t0,
                           self.log_dir / "munged.log")
            if self.accounting:
                self._start_accounting(timeout_s, t0)
            self._spawn("slurmctld", [slurmctld, "-D", "-c", "-f", str(self.conf_path)],
                        "slurmctld.out")
            # A client that finds no controller retries after a second; wait for the port instead.
            self._wait_for(lambda: _port_open(self.ctld_port), "slurmctld to listen", timeout_s, t0,
                           self.log_dir / "slurmctld.log")
            for node in self.nodes:
                self._spawn(f"slurmd:{node.name}",
                            [slurmd, "-D", "-N", node.name, "-f", str(self.conf_path)],
                            f"slurmd-{node.name}.out")
            self._wait_for(self._all_idle, "all nodes idle", timeout_s, t0,
                           self.log_dir / "slurmctld.log")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_for(self, cond, what: str, timeout_s: float, t0: float, log: Path) -> None:
        while True:
            for key, p in self.procs.items():
                if p.poll() is not None:
                    logname = {"slurmctld": "slurmctld.log", "munged": "munged.log", "slurmdbd": "slurmdbd.log",
                               "mariadbd": "mariadb.log"}.get(key) or f"slurmd-{key.split(':', 1)[1]}.log"
                    raise SlurmError(
                        f"testbed: {key} exited with code {p.returncode} while waiting for {what}; "
                        f"last lines of its log:\n{log_tail(self.log_dir / logname)}\n"
                        f"{log_tail(self.log_dir / (key.replace(':', '-') + '.out'), 5)}",
                        f"read {self.log_dir}; a port may have been taken (retry), or the packages "
                        "are incomplete",
                    )
            if cond():
                return
            if time.monotonic() - t0 > timeout_s:
                raise SlurmError(
                    f"testbed: not ready ({what}) after {timeout_s:.0f} s; last log lines:\n{log_tail(log)}",
                    f"read the logs in {self.log_dir}",
                )
            time.sleep(POLL_INTERVAL_S)

    def _all_idle(self) -> bool:
        try:
            r = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True,
                timeout=5,
            )
        except subprocess.TimeoutExpired:
            return False
        if r.returncode != 0:
            return False
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return all(states.get(n.name) == "idle" for n in self.nodes)

    def stop(self) -> None:
        """Stop every daemon this testbed started (SIGTERM, SIGKILL after a grace period)."""
        t0 = time.monotonic()
        leftovers = self._job_processes()
        # Node daemons first, then the controller, then munge (the others need it to say goodbye).
        nodes = [k for k in self.procs if k.startswith("slurmd:")]
        for group in (nodes, ["slurmctld"], ["slurmdbd"], ["mariadbd"], ["munged"]):
            live = [self.procs[k] for k in group if k in self.procs and self.procs[k].poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for p in live:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.procs.clear()
        if self._short_dir:
            shutil.rmtree(self._short_dir, ignore_errors=True)
            self._short_dir = None
        self.stop_seconds = time.monotonic() - t0

    def _job_processes(self) -> list[int]:
        """Job step daemons (slurmstepd) our slurmds forked, and everything under them.

        slurmstepd detaches from slurmd, so it is not our child; it inherits slurmd's environment,
        whose SLURM_CONF names this testbed's config, which is how we tell ours from others'.
        """
        marker = f"SLURM_CONF={self.conf_path}".encode()
        parent: dict[int, int] = {}
        steps: set[int] = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    data = f.read()
                comm = data[data.index(b"(") + 1: data.rindex(b")")]
                parent[pid] = int(data[data.rindex(b")") + 2:].split()[1])
                if comm.startswith(b"slurmstepd"):
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if marker in f.read().split(b"\0"):
                            steps.add(pid)
            except (OSError, ValueError, IndexError):
                continue
        ours = set(steps)
        changed = True
        while changed:
            changed = False
            for pid, ppid in parent.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    changed = True
        return sorted(ours)

    def __enter__(self) -> "SlurmTestbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
