"""Run an agent's shell command so that nothing it does reaches the host.

Mechanism (util-linux only; bubblewrap is not required): each command runs in fresh user, mount,
pid, network, ipc and uts namespaces (`unshare`). A small init script (pid 1 of the new pid
namespace) builds the command's view of the world:

- a root of its own, an empty tmpfs made read-only once built, into which the host lends only
  the system's programs and libraries (/usr, /bin, /sbin, /lib*), the few files of /etc they read
  (users, name service, time zone, certificates) and `tool_paths`, each bound read-only with every
  mount under it. Nothing else of the host is there: no home directory (~/.ssh), no data dir (the
  pool), no config with its keys, no /var, /run or /srv, so no host UNIX socket either (a gateway
  worker's, Docker's). Which mounts to make read-only the host reads from its mountinfo and passes
  as arguments, so a mount point with a space (which `findmnt -r` writes as `\\x20`) is one too;
- a fresh /proc (only the sandbox's processes), a minimal /dev (null, zero, full, random,
  urandom, tty), and empty private tmpfs mounts on /tmp and /dev/shm;
- the workspace as a size-limited tmpfs at the workspace's own path: the host copy goes in
  before the command and comes back after it (even after a kill), so a command can never put
  more than `disk_mb` on the host's disk;
- no network: the new namespace has only a loopback device, and it is down.

The command itself runs with an empty capability bounding set and no-new-privs, under rlimits
(CPU seconds, address space, processes, file size); the host sums the resident memory of all its
processes every 0.1 s (the process tree under `unshare`: an orphan is re-parented to the
namespace's init, so none leaves it) and kills the namespace past `total_memory_mb`. No cgroup is
needed, so it works wherever the namespaces do, and the command cannot kill the watchdog (it can
kill the timer below). Resource counting needs a non-root host uid:
the kernel does not enforce RLIMIT_NPROC for uid 0, so a host root drops to `SANDBOX_UID` before
creating the namespaces (a fork bomb then stalls at `max_procs`). At the wall limit a timer in
the namespace kills every process in it; should that timer itself be killed, the host kills the
namespace's init after a grace period, which takes every process in the namespace with it.

Which mechanism works is probed until it works once in the process. When none does, `Sandbox` refuses
(`SandboxUnavailable`) unless `allow_unsandboxed` is set, which keeps only the rlimits.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from clawr1.core.config import EnvsConfig

#: Host uid (and gid) the sandbox runs as when the host process is root. Unused by anything else,
#: so its processes and files are recognisably the sandbox's.
SANDBOX_UID = 2_000_000_000
#: Combined stdout + stderr past which a command is stopped (its pipes closed): a `yes` must not
#: keep the host busy reading for the whole wall limit.
OUTPUT_KILL_BYTES = 8 * 1024 * 1024
#: Extra seconds the host waits past the wall limit (namespace setup, copying the workspace back)
#: before it kills the namespace itself.
HOST_GRACE_S = 15.0
#: How often the host sums the resident memory of a command's processes (`envs.total_memory_mb`).
MEMORY_EVERY_S = 0.1
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
#: PATH inside the sandbox (and of the unsandboxed runner): system directories only.
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: What a command sees of the host besides its workspace: the system's programs and libraries, and
#: the files of /etc they read. Everything else (homes, data dirs, /var, /run, /srv, /opt) stays out.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group",
             "nsswitch.conf", "hosts", "host.conf", "protocols", "services", "mime.types", "ssl", "ca-certificates")

# pid 1 of the sandbox. Arguments: base root work wall_s disk_mb nproc as_bytes cpu_s fsize
# command, then what the host lends (`lent`): `link PATH TARGET`, `bind PATH` (with
# the mounts under it), `ro PATH` (a mount to make read-only), every path as one argument.
# Its own output goes to $B/init.log; the command gets the host's pipes (fds 3 and 4).
_INIT = r"""
set -eu
B=$1 R=$2 W=$3 WALL=$4 DISK=$5 NPROC=$6 AS=$7 CPU=$8 FSIZE=$9
shift 9
CMD=$1
shift
exec 3>&1 4>&2 >>"$B/init.log" 2>&1
mount --make-rprivate /
mount -t tmpfs -o size=1m,mode=755 tmpfs "$R"
while [ $# -gt 0 ]; do
  case $1 in
    link) mkdir -p "$R${2%/*}"; ln -s "$3" "$R$2"; shift 3 ;;
    bind) if [ -d "$2" ]; then mkdir -p "$R$2"; else mkdir -p "$R${2%/*}"; : >"$R$2"; fi
          mount --rbind "$2" "$R$2"; shift 2 ;;
    # A mount it cannot stat (under a directory the sandbox's uid may not enter, such as a root
    # host's 0700 directories) is out of the command's reach as well, so it is left as it is.
    ro) if stat "$R$2" >/dev/null 2>&1; then mount -o remount,bind,ro "$R$2"; fi; shift 2 ;;
    *) echo "unknown lend $1"; exit 2 ;;
  esac
done
mkdir -p "$R/proc" "$R/tmp" "$R/dev" "$R/run"
mount -t proc proc "$R/proc"
mount -t tmpfs -o size=${DISK}m,nr_inodes=16384,mode=1777 tmpfs "$R/tmp"
mount -t tmpfs -o size=1m,mode=755 tmpfs "$R/dev"
for d in null zero full random urandom tty; do : >"$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
ln -s /proc/self/fd "$R/dev/fd"
ln -s fd/0 "$R/dev/stdin"; ln -s fd/1 "$R/dev/stdout"; ln -s fd/2 "$R/dev/stderr"
mkdir "$R/dev/shm"
mount -t tmpfs -o size=16m,mode=1777 tmpfs "$R/dev/shm"
mount -o remount,bind,ro "$R/dev"
mkdir -p "$R$W"
mount -t tmpfs -o size=${DISK}m,nr_inodes=16384,mode=755 tmpfs "$R$W"
cp -a "$W/." "$R$W/"
mount -o remount,bind,ro "$R"
( exec 3>&- 4>&-; sleep "$WALL"; echo "wall time" >"$B/killed"; kill -KILL -1 ) &
set +e
chroot "$R" setpriv --bounding-set=-all --inh-caps=-all --nnp \
  prlimit --nproc="$NPROC" --as="$AS" --cpu="$CPU:$((CPU + 1))" --fsize="$FSIZE" --core=0 -- \
  env -i PATH="$PATH" HOME="$W" TMPDIR=/tmp LANG=C.UTF-8 sh -c 'cd "$1" && exec sh -c "$2"' sh "$W" "$CMD" \
  </dev/null >&3 2>&4 3>&- 4>&-
rc=$?
set -e
kill -KILL -1 2>/dev/null || true
find "$W" -mindepth 1 -delete
cp -a "$R$W/." "$W/"
echo "$rc" >"$B/rc"
"""


def lent(tool_paths: list[Path] | tuple[Path, ...] = ()) -> list[str]:
    """The init's arguments for what the host lends a command (`_INIT`): the system's paths, the
    files of /etc, then `tool_paths`, each bound with what is mounted under it, then every one of
    those mounts made read-only. A top-level symlink (/bin -> usr/bin) is made again as a link."""
    binds: list[str] = []
    links: list[str] = []
    for path in [*SYSTEM_PATHS, *(f"/etc/{name}" for name in ETC_FILES)]:
        if os.path.islink(path) and os.path.dirname(path) == "/":
            links += ["link", path, os.readlink(path)]
        elif os.path.exists(path):
            binds.append(path)
    for given in tool_paths:
        real = os.path.realpath(given)
        if not os.path.exists(real):
            continue  # lent where it exists: a config names paths of several hosts
        binds.append(real)
        if real != os.path.normpath(given):
            links += ["link", os.path.normpath(given), real]
    points = mount_points()
    args = [*links]
    for path in binds:
        args += ["bind", path]
    for path in binds:
        args += ["ro", path]
        args += [a for m in points if m.startswith(path.rstrip("/") + "/") for a in ("ro", m)]
    return args


def mount_points() -> list[str]:
    """The host's mount points, as the kernel names them in /proc/self/mountinfo (where a space,
    tab, newline or backslash is an octal escape), decoded."""
    points = []
    for line in Path("/proc/self/mountinfo").read_bytes().splitlines():
        field = line.split(b" ")[4]
        points.append(os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), field)))
    return points


# The unsandboxed runner: set the rlimits, then become `sh -c command`.
_PLAIN = """
import os, resource, sys
cpu, mem, fsize, nproc, command = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                     (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NPROC, (nproc, nproc)),
                     (resource.RLIMIT_CORE, (0, 0))):
    resource.setrlimit(limit, value)
os.execvp("sh", ["sh", "-c", command])
"""


class SandboxUnavailable(RuntimeError):
    """No isolation mechanism works on this machine and unsandboxed runs are not allowed."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command): its setup log is in the message."""


@dataclass(frozen=True)
class SandboxResult:
    """One command's result. `stdout`/`stderr` are heads of the streams; when output was cut, the
    text ends with a note saying how many bytes were dropped. `killed` names the limit that
    stopped the command ("wall time", "cpu time", "file size", "output", "memory"), None when it ended on
    its own (a refused allocation under the memory limit is the command's own error exit)."""

    exit_code: int
    stdout: str
    stderr: str
    killed: str | None
    duration_s: float

    def message(self) -> str:
        """The tool message an agent sees: exit code, why it was stopped, then both streams."""
        parts = [f"exit code: {self.exit_code}"]
        if self.killed:
            parts.append(f"killed: {self.killed} limit reached")
        if self.stdout:
            parts.append("stdout:\n" + self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        return "\n".join(parts)


_works = False  # set once a probe succeeded: a mechanism that worked keeps working


def probe() -> str | None:
    """Why the namespace sandbox cannot run here, or None when it works. Runs `true` through the
    whole mechanism until it once succeeds (then never again in this process), so a refusal names
    the step that failed. A failure is not kept: one caused by the moment (a full /tmp, a fork
    refused) must not refuse every command until a restart."""
    global _works
    if not _works:
        reason = _try()
        _works = reason is None
        return reason
    return None


def _try() -> str | None:
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return "util-linux `unshare`/`setpriv` not found on PATH"
    box = Sandbox(limits=EnvsConfig(wall_s=10, disk_mb=1), _mechanism="unshare")
    try:
        result = box.run("true")
    except SandboxError as err:
        return str(err)
    finally:
        box.close()
    return None if result.exit_code == 0 else f"`true` exited {result.exit_code}: {result.stderr.strip()}"


class Sandbox:
    """A workspace plus a way to run commands in it; one per episode.

    Args:
        workdir: The workspace. None: a fresh temporary directory, removed by `close`. A given
            directory is handed over to the sandbox (its ownership changes when the host is root).
        limits: Wall, CPU, memory, process, disk and output limits.

    Raises:
        SandboxUnavailable: no mechanism works here and `limits.allow_unsandboxed` is off.
    """

    def __init__(self, workdir: Path | str | None = None, limits: EnvsConfig | None = None, *,
                 _mechanism: str | None = None):
        self.limits = limits or EnvsConfig()
        if _mechanism is None:
            reason = probe()
            if reason is not None and not self.limits.allow_unsandboxed:
                raise SandboxUnavailable(f"no sandbox works on this machine ({reason}); refusing to run agent "
                                         "commands. Set envs.allow_unsandboxed = true to run them with rlimits only.")
            _mechanism = "unshare" if reason is None else "none"
        self.mechanism = _mechanism
        self._base = Path(tempfile.mkdtemp(prefix="clawr1-sbx-"))
        (self._base / "root").mkdir()
        self.workdir = Path(workdir) if workdir is not None else self._base / "work"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = self.workdir.resolve()

    def run(self, command: str) -> SandboxResult:
        """Run `command` with `sh -c` in the workspace, under the limits. Never raises for what the
        command does; raises `SandboxError` only when the sandbox itself could not be set up."""
        if self.mechanism == "unshare":
            return self._run_unshare(command)
        return self._run_plain(command)

    def close(self) -> None:
        """Remove the temporary directories (the workspace too, when the sandbox made it)."""
        if self._base.exists():
            shutil.rmtree(self._base)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_unshare(self, command: str) -> SandboxResult:
        lim = self.limits
        for name in ("rc", "killed", "init.log"):
            (self._base / name).unlink(missing_ok=True)
        drop: list[str] = []
        if os.geteuid() == 0:
            drop = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"]
            _chown_tree(self._base, SANDBOX_UID)
            if not self.workdir.is_relative_to(self._base):
                _chown_tree(self.workdir, SANDBOX_UID)
        argv = [*drop, "unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--kill-child",
                "--net", "--ipc", "--uts", "sh", "-c", _INIT, "clawr1-sandbox",
                str(self._base), str(self._base / "root"), str(self.workdir), f"{lim.wall_s:g}", str(lim.disk_mb),
                str(lim.max_procs), str(lim.memory_mb * 1024 * 1024), str(lim.cpu_s),
                str(lim.disk_mb * 1024 * 1024), command, *lent(lim.tool_paths)]
        proc = subprocess.Popen(argv, cwd=self._base, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, env={"PATH": SANDBOX_PATH})
        out = _collect(proc, lim.wall_s + HOST_GRACE_S, lim.output_chars, lambda: _kill_namespace(proc),
                       lim.total_memory_mb << 20)
        rc_file, killed_file = self._base / "rc", self._base / "killed"
        killed = killed_file.read_text().strip() if killed_file.exists() else out.killed
        if rc_file.exists():
            code = int(rc_file.read_text())
        elif out.killed is not None:  # the host killed the namespace (wall time, memory)
            code = 128 + signal.SIGKILL
        else:
            log = (self._base / "init.log").read_text(errors="replace") if (self._base / "init.log").exists() else ""
            raise SandboxError(f"sandbox setup failed (exit {proc.returncode}): {log.strip()[-2000:]} "
                               f"{out.stderr.strip()[-1000:]}".strip())
        killed = killed or _signal_limit(code)
        return SandboxResult(code, out.stdout, out.stderr, killed, out.duration_s)

    def _run_plain(self, command: str) -> SandboxResult:
        """No isolation: rlimits only (set by a tiny Python wrapper, since `preexec_fn` is unsafe
        when rollouts run in threads), and the process group is killed at the wall limit."""
        lim = self.limits
        argv = [sys.executable, "-I", "-c", _PLAIN, str(lim.cpu_s), str(lim.memory_mb << 20), str(lim.disk_mb << 20),
                str(lim.max_procs), command]
        proc = subprocess.Popen(argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                env={"PATH": SANDBOX_PATH, "HOME": str(self.workdir), "LANG": "C.UTF-8"})
        out = _collect(proc, lim.wall_s, lim.output_chars, lambda: _kill_group(proc.pid), lim.total_memory_mb << 20)
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return SandboxResult(code, out.stdout, out.stderr, out.killed or _signal_limit(code), out.duration_s)


@dataclass
class _Output:
    stdout: str
    stderr: str
    killed: str | None
    duration_s: float


def _collect(proc: subprocess.Popen[bytes], limit_s: float, keep: int, kill: Callable[[], None],
             memory_bytes: int) -> _Output:
    """Read both pipes until the command ends: keep the head of each, count the rest, close the
    pipes past `OUTPUT_KILL_BYTES` (the writer then dies of SIGPIPE), call `kill` at `limit_s`, or
    once the command's processes together hold more than `memory_bytes` resident (checked every
    `MEMORY_EVERY_S`, also after the command closed its pipes)."""
    assert proc.stdout is not None and proc.stderr is not None
    start = time.monotonic()
    fds = [proc.stdout.fileno(), proc.stderr.fileno()]
    heads = {fd: bytearray() for fd in fds}
    cut = dict.fromkeys(fds, 0)
    total, killed, checked = 0, None, start

    def over_memory() -> bool:
        nonlocal checked
        if time.monotonic() - checked < MEMORY_EVERY_S:
            return False
        checked = time.monotonic()
        return _resident(proc.pid) > memory_bytes

    with selectors.DefaultSelector() as sel:
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and killed is None:
            left = start + limit_s - time.monotonic()
            if left <= 0:
                killed = "wall time"
                kill()
                break
            for key, _ in sel.select(timeout=min(left, MEMORY_EVERY_S)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                room = max(0, keep - len(heads[key.fd]))
                heads[key.fd] += chunk[:room]
                cut[key.fd] += max(0, len(chunk) - room)
                total += len(chunk)
            if total > OUTPUT_KILL_BYTES:
                killed = "output"
            elif over_memory():
                killed = "memory"
                kill()
    proc.stdout.close()
    proc.stderr.close()
    while proc.poll() is None:
        left = start + limit_s - time.monotonic()
        if left <= 0:
            killed = killed or "wall time"
            kill()
            break
        if killed is None and over_memory():
            killed = "memory"
            kill()
            break
        time.sleep(min(left, MEMORY_EVERY_S))
    proc.wait()
    out, err = (_head_text(heads[fd], cut[fd], keep) for fd in fds)
    return _Output(out, err, killed, time.monotonic() - start)


def _resident(root: int) -> int:
    """Resident bytes of process `root` and every process under it (threads share their process's
    memory: each process counts once). One that ends while it is read counts 0."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES
            for task in os.listdir(f"/proc/{pid}/task"):
                todo += map(int, Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _head_text(head: bytearray, cut: int, keep: int) -> str:
    text = head.decode("utf-8", errors="replace")[:keep]
    return text + (f"\n[... {cut} more bytes cut]" if cut else "")


def _signal_limit(code: int) -> str | None:
    """The limit behind an exit status: the kernel sends SIGXCPU for RLIMIT_CPU and SIGXFSZ for
    RLIMIT_FSIZE, which the shell reports as 128 + signal."""
    return {128 + signal.SIGXCPU: "cpu time", 128 + signal.SIGXFSZ: "file size"}.get(code)


def _kill_namespace(proc: subprocess.Popen[bytes]) -> None:
    """Kill the namespace's init (which takes every process in the namespace with it), so that
    `unshare` reaps it and exits; kill `unshare` only if it does not. Killing `unshare` first
    would also end the init (`--kill-child`), but leave it a zombie under a host init that may
    not reap."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    pids = children.read_text().split() if children.exists() else []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
            os.kill(int(pid), signal.SIGKILL)
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        proc.kill()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # every process of the group ended meanwhile
        os.killpg(pgid, signal.SIGKILL)


def _chown_tree(root: Path, uid: int) -> None:
    """Give the sandbox's host uid the workspace (files the host wrote since the last command)."""
    os.chown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)
