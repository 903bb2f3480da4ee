"""The sandbox: each hostile command is stopped or denied, reported, and the host is unharmed."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from clawr1.core.config import EnvsConfig
from clawr1.envs import sandbox
from clawr1.envs.sandbox import SANDBOX_UID, Sandbox, SandboxUnavailable


def _box(**limits: object) -> Sandbox:
    return Sandbox(limits=EnvsConfig(**{"wall_s": 5.0, "cpu_s": 5, **limits}))


def _sandbox_processes(*boxes: Sandbox) -> list[int]:
    """Host pids running as the sandbox's uid (root hosts only drop to it) in these boxes: their
    environment's HOME is the box's workdir (other tests' boxes may run at the same time)."""
    homes = {f"HOME={box.workdir}".encode() for box in boxes}
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
                uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
                if int(uid_line.split()[1]) == SANDBOX_UID and set((entry / "environ").read_bytes().split(b"\0")) & homes:
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue  # the process ended while we looked
    return pids


def _assert_no_leftovers(*boxes: Sandbox) -> None:
    """Every process of the boxes' commands is gone (the namespace is torn down asynchronously)."""
    if os.geteuid() != 0:
        return
    deadline = time.monotonic() + 3
    while _sandbox_processes(*boxes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes(*boxes) == []


def test_this_machine_has_a_working_sandbox() -> None:
    assert sandbox.probe() is None
    with _box() as box:
        assert box.mechanism == "unshare"


def test_a_failed_probe_is_tried_again_and_a_working_one_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that failed at one moment (a full /tmp) does not refuse every later command."""
    answers = iter(["sandbox setup failed (exit 32): /tmp is full", None])
    calls = []
    monkeypatch.setattr(sandbox, "_works", False)
    monkeypatch.setattr(sandbox, "_try", lambda: calls.append(1) or next(answers))
    with pytest.raises(SandboxUnavailable, match="/tmp is full"):
        _box()
    with _box() as box:
        assert box.mechanism == "unshare"
    assert sandbox.probe() is None and len(calls) == 2  # the success is kept


def test_command_runs_in_its_workspace_and_its_files_persist() -> None:
    with _box() as box:
        (box.workdir / "in.txt").write_text("from the host\n")
        result = box.run("cat in.txt; echo made > out.txt; pwd; echo oops >&2; exit 3")
        assert result.exit_code == 3 and result.killed is None
        assert result.stdout == f"from the host\n{box.workdir}\n"
        assert result.stderr == "oops\n"
        assert (box.workdir / "out.txt").read_text() == "made\n"
        assert box.run("cat out.txt").stdout == "made\n"
        assert "exit code: 3" in result.message() and "oops" in result.message()
    assert not box.workdir.exists()


def test_writes_outside_the_workspace_never_reach_the_host(tmp_path: Path) -> None:
    name = f"clawr1-escape-{uuid.uuid4().hex}"
    targets = [Path("/var/tmp") / name, tmp_path / name, Path("/etc") / name]
    with _box() as box:
        result = box.run("; ".join(f"echo pwned > {t}" for t in targets) + f"; echo pwned > ../{name}; echo done")
        assert result.stdout == "done\n"
        # /etc is the sandbox's own read-only root's; /var and the host's tmp_path are not there at all.
        assert result.stderr.count("Read-only file system") == 1 and result.stderr.count("nonexistent") == 2
        assert box.run(f"echo x > /dev/{name}").exit_code != 0
        parent = box.workdir.parent
        for target in [*targets, parent / name]:
            assert not target.exists(), target
        assert box.run(f"echo private > /tmp/{name} && cat /tmp/{name}").stdout == "private\n"
        assert not (Path("/tmp") / name).exists()


def test_a_host_mount_the_sandbox_cannot_reach_neither_stops_it_nor_opens_to_it() -> None:
    """A root host's mount under a 0700 directory (a Docker overlay, a test's own tmpfs) cannot be
    remounted read-only by the sandbox's uid, which once failed every command. The command cannot
    reach it either, so it runs, and the mount stays out of its reach. Under a lent tool path: the
    rest of the host is not in the sandbox at all, which would hide the mount for another reason."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox drops to its own uid only on a root host")
    lent = Path("/var/tmp") / f"clawr1-lent-{uuid.uuid4().hex}"
    lent.mkdir(mode=0o755)
    hidden = lent / "root-only"
    hidden.mkdir(mode=0o700)
    disk = hidden / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=False,
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        disk.rmdir()
        hidden.rmdir()
        lent.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    try:
        with _box(tool_paths=[lent]) as box:
            result = box.run(f"echo pwned > {disk}/x; ls {disk}; echo done")
            assert result.stdout == "done\n" and "Permission denied" in result.stderr, result
        assert not (disk / "x").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)
        disk.rmdir()
        hidden.rmdir()
        lent.rmdir()


def test_network_is_unreachable_and_host_sockets_stay_untouched() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        with _box() as box:
            code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                    "except OSError as e:\n    print('refused', e.errno)\nelse:\n    print('connected')\n"
                    "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
                    "except OSError as e:\n    print('refused', e.errno)\nelse:\n    print('connected')\n")
            (box.workdir / "net.py").write_text(code)
            result = box.run("python3 net.py")
            assert result.stdout.count("refused") == 2, result
            assert "connected" not in result.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_a_fork_bomb_is_contained_and_cleaned_up() -> None:
    with _box(wall_s=2.0, max_procs=32) as box:
        start = time.monotonic()
        result = box.run("bomb() { bomb | bomb & }; bomb; sleep 30")
        # Contained either way: killed at the wall time, or the shell could not even fork its
        # `sleep` under the process limit and gave up (which of the two depends on timing).
        assert result.killed == "wall time" or "Cannot fork" in result.stderr, result
        assert result.exit_code != 0
        assert time.monotonic() - start < 8
    _assert_no_leftovers(box)
    subprocess.run(["true"], check=True)  # the host can still fork


def test_endless_commands_are_killed_at_the_wall_and_cpu_limits() -> None:
    with _box(wall_s=1.0) as first:
        slept = first.run("sleep 30")
        assert slept.killed == "wall time" and 0.9 < slept.duration_s < 5
        background = first.run("sleep 30 & echo started")
        assert background.stdout == "started\n" and background.killed is None and background.duration_s < 5
    with _box(wall_s=8.0, cpu_s=1) as box:
        spun = box.run("while :; do :; done")
        assert spun.killed == "cpu time" and spun.exit_code == 152 and spun.duration_s < 8
    _assert_no_leftovers(first, box)


def test_the_host_kills_the_namespace_when_the_inner_timer_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "HOST_GRACE_S", 1.0)
    with _box(wall_s=1.0) as box:
        result = box.run("kill -KILL -1; sleep 30")  # the in-namespace wall timer dies first
        assert result.killed == "wall time" and result.duration_s < 6
    _assert_no_leftovers(box)


def test_output_is_cut_to_its_head_and_a_flood_is_stopped() -> None:
    with _box(output_chars=100) as box:
        result = box.run("yes | head -c 50000")
        assert result.stdout.startswith("y\ny\n")
        assert result.stdout.endswith("[... 49900 more bytes cut]")
        assert len(result.stdout) < 200 and result.killed is None
        flood = box.run("yes")
        assert flood.killed == "output" and flood.duration_s < 5


def test_memory_and_disk_limits_refuse_large_allocations() -> None:
    with _box(memory_mb=256, disk_mb=1) as box:
        result = box.run("python3 -c 'x = bytearray(2 * 1024 ** 3)'")
        assert result.exit_code != 0 and "MemoryError" in result.stderr
        big = box.run("head -c 5000000 /dev/zero > big.bin")
        assert big.exit_code != 0 and big.killed == "file size"
        assert (box.workdir / "big.bin").stat().st_size <= 1024 * 1024


def test_no_mechanism_means_refusal_unless_unsandboxed_runs_are_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "probe", lambda: "no user namespaces here")
    with pytest.raises(SandboxUnavailable, match="no user namespaces here"):
        Sandbox(limits=EnvsConfig())
    with Sandbox(limits=EnvsConfig(allow_unsandboxed=True, wall_s=1.0, output_chars=100)) as box:
        assert box.mechanism == "none"
        assert box.run("echo hi > f.txt; cat f.txt").stdout == "hi\n"
        assert box.run("sleep 30").killed == "wall time"
        assert box.run("yes | head -c 1000").stdout.endswith("[... 900 more bytes cut]")


@pytest.fixture
def host_dir():
    """A directory any user of the host may read (not under the sandbox's fresh /tmp): where a
    pool, a config with keys or a home directory lives, for what a command may see."""
    path = Path("/var/tmp") / f"clawr1-host-{uuid.uuid4().hex}"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=True)


def test_a_command_sees_its_task_and_the_system_tools_and_nothing_else_of_the_host(host_dir: Path) -> None:
    """Not the pool, a config with its keys, nor ~/.ssh, even where the host lets any user read them."""
    secrets = {"pool.sqlite": "steps of every tenant", "clawr1.toml": 'api_keys = ["sk-secret-key"]',
               ".ssh/id_ed25519": "PRIVATE KEY"}
    for name, text in secrets.items():
        (host_dir / name).parent.mkdir(mode=0o755, exist_ok=True)
        (host_dir / name).write_text(text)
        (host_dir / name).chmod(0o644)
        (host_dir / name).parent.chmod(0o755)
    with _box() as box:
        (box.workdir / "task.txt").write_text("the task\n")
        result = box.run("; ".join(f"cat {host_dir / name}" for name in secrets)
                         + f"; ls {host_dir.parent}; ls /home /root /work /srv; cat task.txt")
        for text in secrets.values():
            assert text not in result.stdout
        assert result.stdout == "the task\n", result
        tools = box.run("python3 -c 'print(6 * 7)' && ls /usr/bin/env && sh -c 'echo $HOME' && id -u")
        assert tools.stdout.splitlines()[:3] == ["42", "/usr/bin/env", str(box.workdir)], tools


def test_no_host_unix_socket_is_reachable(host_dir: Path) -> None:
    """A gateway worker's socket (the full API when it has no keys), a Docker socket: none is there."""
    path = host_dir / "gateway-0.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    path.chmod(0o777)
    listener.listen()
    listener.setblocking(False)
    try:
        with _box() as box:
            code = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({str(path)!r})\n"
                    "except OSError as e:\n    print('refused')\nelse:\n    print('connected')\n")
            (box.workdir / "sock.py").write_text(code)
            result = box.run("python3 sock.py; find / -type s 2>/dev/null")  # no socket file anywhere
            assert result.stdout == "refused\n", result
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_tools_are_lent_read_only_with_the_mounts_under_them_even_at_paths_with_spaces(host_dir: Path) -> None:
    """`findmnt -r` writes a space as `\\x20`: a mount there once stayed writable."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs on the host needs root")
    spaced = host_dir / "my tools"
    spaced.mkdir(mode=0o755)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=777", "tmpfs", str(spaced)], check=False,
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    try:
        (spaced / "tool.sh").write_text("echo tool ran\n")
        (spaced / "tool.sh").chmod(0o755)
        with _box(tool_paths=[host_dir]) as box:
            result = box.run(f"sh '{spaced}/tool.sh'; echo pwned > '{spaced}/x'; echo pwned > '{host_dir}/y'; "
                             "echo done")
            assert result.stdout == "tool ran\ndone\n", result
            assert result.stderr.count("Read-only file system") == 2, result
        assert not (spaced / "x").exists() and not (host_dir / "y").exists()
    finally:
        subprocess.run(["umount", str(spaced)], check=True)


def test_all_processes_of_a_command_share_one_memory_cap() -> None:
    """Each process under its own `memory_mb` and all of them over `total_memory_mb`: killed, even
    by a command that first kills whatever it can and closes its output (the host keeps count)."""
    hold = "python3 -c 'import time; x = b\"1\" * (150 << 20); time.sleep(20)' &"
    with _box(wall_s=15.0, memory_mb=256, total_memory_mb=400) as box:
        result = box.run(f"{hold} {hold} {hold} {hold} wait")
        assert result.killed == "memory" and result.exit_code != 0, result
        sly = box.run(f"kill -KILL -1; exec >/dev/null 2>&1; {hold} {hold} {hold} {hold} wait")
        assert sly.killed == "memory", sly
        alone = box.run("python3 -c 'x = b\"1\" * (150 << 20); print(len(x) >> 20)'")
        assert alone.stdout == "150\n" and alone.killed is None, alone
    _assert_no_leftovers(box)
