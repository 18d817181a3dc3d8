"""sandbox.run_python, the Python tool, against hostile code: it returns text and never raises; time, memory (of the
call as a whole), output, processes, the trainer's files, other calls' files and the network are out of the code's
reach, and nothing it starts or writes outlives the call: in namespaces, and as root where the OS allows none."""

import os
import pathlib
import shutil
import socket
import sys
import tempfile
import threading
import time

import psutil
import pytest

import reward
import sandbox

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not sandbox.tool_interpreter(),
    reason="the sandbox uses Linux limits and a Python that others can run",
)
# Where the OS allows no namespaces the code runs with limits only: these would then hurt the machine running them.
ISOLATED = pytest.mark.skipif(
    sys.platform != "linux" or "unshare" not in (sandbox._isolation() or []), reason="no namespaces allowed here"
)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the user switch happens when the trainer is root")


@pytest.fixture
def no_namespaces(monkeypatch, tmp_path):
    """The OS of a container that allows no namespaces: unshare fails."""
    failing = tmp_path / "bin" / "unshare"
    failing.parent.mkdir()
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("PATH", f"{failing.parent}:{os.environ['PATH']}")
    sandbox._isolation.cache_clear()
    assert sandbox._isolation() == []
    yield failing.parent
    sandbox._isolation.cache_clear()


@pytest.fixture(params=[pytest.param("namespaces", marks=ISOLATED), pytest.param("none", marks=ROOT_ONLY)])
def isolation(request):
    """A test that takes it runs twice: in the tool's namespaces, and under root where the OS allows none."""
    if request.param == "none":
        request.getfixturevalue("no_namespaces")
    return request.param


@pytest.fixture
def trainer_folder():
    """A folder of the trainer's, outside /tmp (which the code sees as its own folder)."""
    folder = tempfile.mkdtemp(dir="/var/tmp")
    yield pathlib.Path(folder)
    shutil.rmtree(folder)


@pytest.fixture
def call_folders(monkeypatch):
    """The folders that the calls make, by their paths here (in its namespaces, the code sees its folder as /tmp)."""
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *args, **kwargs: made.append(mkdtemp(*args, **kwargs)) or made[-1])
    return made


def test_output_and_tracebacks_come_back_as_text_and_nothing_raises():
    assert sandbox.run_python("print(6 * 7)") == "42\n"
    assert "ZeroDivisionError" in sandbox.run_python("print('before')\n1 / 0")
    assert "SyntaxError" in sandbox.run_python("def (:")
    assert isinstance(sandbox.run_python("\0\udcff print('x')"), str)  # a NUL byte and a lone surrogate
    assert sandbox.run_python("") == ""


@ROOT_ONLY
@ISOLATED
def test_the_code_runs_as_a_user_of_its_own_in_its_own_namespaces():
    code = "import os\nprint(os.getuid(), os.getpid(), *sorted(filter(str.isdigit, os.listdir('/proc'))))"
    uid, *pids = sandbox.run_python(code).split()
    assert uid == str(sandbox._tool_uid()) and int(uid) >= sandbox.TOOL_UID_BASE  # no other call runs as it
    assert pids == ["1", "1"]  # PID 1 of a namespace of its own, and the only process its /proc shows


def test_each_call_runs_in_a_fresh_empty_folder_its_working_directory_and_tmpdir_removed_after(isolation, call_folders):
    code = (
        "import os, tempfile\nprint(os.listdir('.'), os.getcwd() == os.environ['TMPDIR'] == tempfile.gettempdir())"
        "\ntempfile.mkstemp(); open('left', 'w')"
    )
    assert sandbox.run_python(code) == "[] True\n"
    assert sandbox.run_python(code) == "[] True\n"  # the next call's folder is new: nothing of the last one's is there
    assert len(call_folders) >= 2 and not any(os.path.exists(folder) for folder in call_folders)  # a probe's too


def test_wall_and_cpu_time_are_cut_off():
    for code in ("while True: pass", "import time; time.sleep(60)"):
        start = time.perf_counter()
        out = sandbox.run_python("print('started', flush=True)\n" + code, timeout=1)
        assert time.perf_counter() - start < 3 and out == "started\n\n[timed out after 1 s]"
        assert reward.tool_failure(out) == "timeout"  # counted as tool_timeouts


def test_filling_memory_hurts_only_the_code():
    out = sandbox.run_python("x = bytearray(8 << 30)", memory_mb=512)
    assert "MemoryError" in out


def test_a_flood_of_output_is_cut_to_the_limit_with_a_note():
    for code in ("print('x' * 10**7)", "while True: print('y' * 1000)"):
        out = sandbox.run_python(code, timeout=2)
        assert out.startswith("x" * 100) or out.startswith("y" * 100)
        assert len(out) < sandbox.TOOL_OUTPUT_CHARS + 100 and f"[output cut at {sandbox.TOOL_OUTPUT_CHARS}" in out


DAEMON = """
import os, subprocess
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # a double-forked daemon in a session of its own
        subprocess.Popen(["sleep", "{marker}"]).wait()
    os._exit(0)
subprocess.Popen(["sleep", "{marker}"])  # and a plain child
print("started", flush=True)
"""


def leftovers(marker):
    return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


def test_no_process_it_starts_outlives_the_call_daemons_included(isolation):
    """Without namespaces (root), every process of the call's own user is the call's, and is killed after it."""
    for timeout in (5, 1.5):  # the code returns at once; or it leaves the worker's session, hangs and is killed
        marker = f"{1000 + timeout + time.time() % 1:.6f}"
        code = DAEMON.format(marker=marker) + ("" if timeout == 5 else "os.setsid()\nimport time; time.sleep(60)")
        assert sandbox.run_python(code, timeout=timeout).startswith("started")
        time.sleep(0.2)
        assert leftovers(marker) == []


LEAVE_FILES = """
import os
for folder in ("/tmp", "/dev/shm", "/var/tmp", "/run/lock"):
    try:
        os.mkdir(f"{folder}/{marker}")
        open(f"{folder}/{marker}/file", "w").write("left")
        open(f"{folder}/{marker}.file", "w").write("left")
    except OSError as error:
        print(folder, error)
print("written")
"""


def test_files_it_writes_to_tmp_or_dev_shm_do_not_outlive_the_call(isolation):
    """In its own namespaces, /tmp is the call's folder and /dev/shm a tmpfs of its own; without them (under root),
    what the call's user owns in the folders that every user may write is removed after it."""
    marker = f"tool_test_{os.getpid()}_{time.time_ns()}"
    assert sandbox.run_python(LEAVE_FILES.replace("{marker}", marker)).endswith("written\n")
    left = [
        f"{folder}/{name}"
        for folder in ("/tmp", "/dev/shm", "/var/tmp", "/run/lock")
        if os.path.isdir(folder)
        for name in (marker, marker + ".file")
        if os.path.lexists(f"{folder}/{name}")
    ]
    assert left == []


WRITER = """
import os, time
paths = ["{marker}", "/tmp/{marker}", "/dev/shm/{marker}", "/var/tmp/{marker}"]
for path in paths:
    open(path, "w").write("secret")
time.sleep(2.5)
print(all(open(path).read() == "secret" for path in paths))
"""
SNOOPER = """
import glob, os
paths = [f"{folder}/{marker}" for folder in ("/tmp", "/dev/shm", "/var/tmp", "/tmp/work")]
paths += glob.glob("/tmp/tool_*/work/{marker}") + glob.glob("/proc/[0-9]*/cwd/{marker}")
paths += glob.glob("/proc/[0-9]*/root/tmp/{marker}")
for path in paths:
    for action, flags in (("read", os.O_RDONLY), ("could write", os.O_WRONLY)):  # no O_CREAT: the first's files only
        try:
            os.close(os.open(path, flags))
            print(action, path)
        except OSError:
            pass
print("done")
"""


def test_two_calls_at_once_cannot_read_or_write_each_others_files(isolation):
    """Two runs on one machine, or two calls of one run: the second looks for the first one's files in its folder,
    /tmp, /dev/shm, /var/tmp and through /proc while the first still runs, and can neither read nor write one."""
    marker = f"secret_{os.getpid()}_{time.time_ns()}"
    first = []
    writer = threading.Thread(target=lambda: first.append(sandbox.run_python(WRITER.replace("{marker}", marker))))
    writer.start()
    time.sleep(1.0)
    second = sandbox.run_python(SNOOPER.replace("{marker}", marker))
    writer.join()
    assert first == ["True\n"] and second == "done\n"


@ISOLATED
def test_dev_shm_cannot_fill_the_machines_memory():
    """Past memory_mb, /dev/shm is full (its tmpfs) or the call is killed (its cgroup): never the host's memory."""
    code = (
        "import os\nn = 0\ntry:\n    for i in range(10):\n        with open(f'/dev/shm/fill{i}', 'wb') as f:\n"
        "            for _ in range(32):\n                f.write(b'x' * (1 << 20))\n        n += 1\n"
        "        print(n, flush=True)\nexcept OSError as error:\n    print(error.strerror)"
    )
    out = sandbox.run_python(code, memory_mb=128)
    written = [int(line) for line in out.splitlines() if line.isdigit()]  # files of 32 MB
    assert ("No space left on device" in out or "MemoryError" in out) and max(written, default=0) * 32 <= 128, out


def test_the_code_cannot_swap_its_output_for_a_link_or_a_fifo(tmp_path):
    secret = tmp_path / "secret"  # as the trainer's environment in /proc/<worker>/environ: the trainer's eyes only
    secret.write_text("HF_TOKEN=hf_secret")
    secret.chmod(0o600)
    start = time.perf_counter()
    for swap in (f"os.symlink({str(secret)!r}, name)", "os.mkfifo(name)"):
        code = "import os\nfor name in os.listdir('.'):\n    if name != 'main.py':\n        os.remove(name)\n"
        out = sandbox.run_python(code + "name = '.output'\n" + swap + "\nprint('swapped')")
        assert out == "swapped\n"
    assert time.perf_counter() - start < 5  # a FIFO that is read would block until the worker's deadline


def test_a_folder_nested_deeper_than_python_recursion_is_removed(call_folders):
    out = sandbox.run_python("import os\nfor _ in range(2000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')")
    assert out == "deep\n" and len(call_folders) == 1 and not os.path.exists(call_folders[0])


@ROOT_ONLY
def test_without_namespaces_root_still_runs_the_code_as_its_own_user_or_refuses(no_namespaces):
    """A container that allows no namespaces (unshare fails) must not drop the user switch with them."""
    assert sandbox.run_python("import os; print(os.getuid())") == f"{sandbox._tool_uid()}\n"
    (no_namespaces / "setpriv").write_bytes((no_namespaces / "unshare").read_bytes())  # no user switch either
    (no_namespaces / "setpriv").chmod(0o755)
    sandbox._isolation.cache_clear()
    assert sandbox.run_python("print(1)").startswith("error: the trainer is root and cannot run code as an")


FORKS_HOLDING_MEMORY = """
import os, time
children = []
for _ in range(6):
    if (pid := os.fork()) == 0:
        memory = b"1" * (100 << 20)  # written, so resident
        time.sleep(30)
    children.append(pid)
time.sleep(1)
print(sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children), "alive")
"""


@ROOT_ONLY
def test_the_memory_limit_holds_for_the_call_as_a_whole_its_forks_included():
    """Six forks of 100 MB each, under a limit of 256 MB: a cgroup holds the call to it, where one can be made."""
    probe = sandbox._new_cgroup("tool_probe", 1)
    if not probe:
        pytest.skip("no cgroup can be made here: the process limit bounds the call instead (below)")
    sandbox._remove_cgroup(probe)
    out = sandbox.run_python(FORKS_HOLDING_MEMORY, memory_mb=256)
    assert int(out.split()[0]) * 100 <= 256 and "MemoryError: the call used its 256 MB of memory" in out, out
    assert reward.tool_failure(out) == "error"


FORK_BOMB = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
        n += 1
except OSError:
    print(n)
"""


@ROOT_ONLY
def test_without_a_cgroup_the_call_runs_so_few_processes_that_its_memory_stays_bounded(monkeypatch):
    """Each process within memory_mb and at most TOOL_PROCESSES of them, threads included: the call's user runs no
    other, so the limit counts the call's alone."""
    monkeypatch.setattr(sandbox, "_new_cgroup", lambda name, memory_mb: "")
    assert 0 < int(sandbox.run_python(FORK_BOMB, timeout=5)) < sandbox.TOOL_PROCESSES
    assert "MemoryError" in sandbox.run_python("x = bytearray(600 << 20)", memory_mb=512)


@ISOLATED
def test_killing_every_process_it_can_see_hurts_only_itself():
    bystander = psutil.Popen(["sleep", "30"])  # the trainer's side: a process of the caller's
    try:
        out = sandbox.run_python("import os, signal\nos.kill(os.getppid(), 9)\nos.kill(-1, signal.SIGKILL)\nprint('x')")
        assert isinstance(out, str) and bystander.is_running() and bystander.status() != psutil.STATUS_ZOMBIE
    finally:
        bystander.kill()


@ROOT_ONLY
@ISOLATED
def test_the_code_cannot_touch_the_trainers_files(trainer_folder):
    tmp_path = trainer_folder
    os.chmod(tmp_path, 0o755)
    (tmp_path / "weights.bin").write_text("trained")
    secret = tmp_path / "private"
    secret.mkdir(mode=0o700)
    (secret / "key").write_text("hidden")
    out = sandbox.run_python(f"""
for action in (lambda: open({str(tmp_path / "weights.bin")!r}, 'w').write('gone'),
               lambda: open({str(tmp_path / "new")!r}, 'w'),
               lambda: print(open({str(secret / "key")!r}).read())):
    try:
        action()
    except OSError as error:
        print(type(error).__name__)
""")
    assert out == "PermissionError\n" * 3
    assert (tmp_path / "weights.bin").read_text() == "trained" and not (tmp_path / "new").exists()


@ISOLATED
def test_the_network_is_out_of_reach():
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    port = server.getsockname()[1]
    out = sandbox.run_python(
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
        "    print('connected')\nexcept OSError as error:\n    print('refused', error.errno)"
    )
    time.sleep(0.2)
    server.close()
    assert out.startswith("refused") and accepted == []


def test_an_interpreter_the_unprivileged_user_cannot_read_is_refused_with_a_message(monkeypatch, tmp_path):
    hidden = tmp_path / "private" / "python3"  # as a pyenv under a 0700 /root
    hidden.parent.mkdir(mode=0o700)
    hidden.write_text("")
    hidden.chmod(0o755)
    assert not sandbox._runnable_by_others(str(hidden))
    assert sandbox._runnable_by_others("/bin/sh")  # every folder above it searchable, the file r-x for others
    monkeypatch.setattr(sandbox, "tool_interpreter", lambda: "")
    assert sandbox.run_python("print(1)").startswith("error: no Python that an unprivileged user can run")
