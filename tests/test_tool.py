"""reward.run_python, the Python tool, against hostile code: it returns text and never raises; time, memory,
output, processes, the trainer's files and the network are out of the code's reach."""
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

import reward

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not reward.tool_interpreter(),
                                reason="the sandbox uses Linux limits and a Python that others can run")
# Where the OS allows no namespaces the code runs with limits only: these would then hurt the machine running them.
ISOLATED = pytest.mark.skipif(sys.platform != "linux" or "unshare" not in (reward._isolation() or []),
                              reason="no namespaces allowed here")
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the user switch happens when the trainer is root")


def test_output_and_tracebacks_come_back_as_text_and_nothing_raises():
    assert reward.run_python("print(6 * 7)") == "42\n"
    assert "ZeroDivisionError" in reward.run_python("print('before')\n1 / 0")
    assert "SyntaxError" in reward.run_python("def (:")
    assert isinstance(reward.run_python("\0\udcff print('x')"), str)  # a NUL byte and a lone surrogate
    assert reward.run_python("") == ""


@ROOT_ONLY
@ISOLATED
def test_the_code_runs_as_an_unprivileged_user_in_its_own_folder_and_namespaces():
    uid, pid, cwd = reward.run_python("import os; print(os.getuid(), os.getpid(), os.getcwd())").split()
    assert uid == str(reward.NOBODY) and pid == "1"  # PID 1 of a namespace of its own
    assert cwd.startswith("/tmp/tool_") and not os.path.exists(cwd)  # the folder is gone after the call


def test_wall_and_cpu_time_are_cut_off():
    for code in ("while True: pass", "import time; time.sleep(60)"):
        start = time.perf_counter()
        out = reward.run_python("print('started', flush=True)\n" + code, timeout=1)
        assert time.perf_counter() - start < 3 and out == "started\n\n[timed out after 1 s]"
        assert reward.tool_failure(out) == "timeout"  # counted as tool_timeouts


def test_filling_memory_hurts_only_the_code():
    out = reward.run_python("x = bytearray(8 << 30)", memory_mb=512)
    assert "MemoryError" in out


def test_a_flood_of_output_is_cut_to_the_limit_with_a_note():
    for code in ("print('x' * 10**7)", "while True: print('y' * 1000)"):
        out = reward.run_python(code, timeout=2)
        assert out.startswith("x" * 100) or out.startswith("y" * 100)
        assert len(out) < reward.TOOL_OUTPUT_CHARS + 100 and f"[output cut at {reward.TOOL_OUTPUT_CHARS}" in out


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


@ISOLATED
def test_no_process_it_starts_outlives_the_call_daemons_included():
    for timeout in (5, 1.5):  # the code returns at once; or it leaves the worker's session, hangs and is killed
        marker = f"{1000 + timeout + time.time() % 1:.6f}"
        code = DAEMON.format(marker=marker) + ("" if timeout == 5 else "os.setsid()\nimport time; time.sleep(60)")
        assert reward.run_python(code, timeout=timeout).startswith("started")
        time.sleep(0.2)
        assert leftovers(marker) == []


def test_the_code_cannot_swap_its_output_for_a_link_or_a_fifo(tmp_path):
    secret = tmp_path / "secret"  # as the trainer's environment in /proc/<worker>/environ: the trainer's eyes only
    secret.write_text("HF_TOKEN=hf_secret")
    secret.chmod(0o600)
    start = time.perf_counter()
    for swap in (f"os.symlink({str(secret)!r}, name)", "os.mkfifo(name)"):
        code = f"import os\nfor name in os.listdir('.'):\n    if name != 'main.py':\n        os.remove(name)\n"
        out = reward.run_python(code + "name = '.output'\n" + swap + "\nprint('swapped')")
        assert out == "swapped\n"
    assert time.perf_counter() - start < 5  # a FIFO that is read would block until the worker's deadline


def test_a_folder_nested_deeper_than_python_recursion_is_removed():
    out = reward.run_python("import os\nfor _ in range(2000):\n    os.mkdir('d')\n    os.chdir('d')\n"
                            "print(os.getcwd().split('/d/')[0])")
    assert out.startswith("/tmp/tool_") and not os.path.exists(out.strip())


@ROOT_ONLY
def test_without_namespaces_root_still_runs_the_code_as_the_unprivileged_user_or_refuses(monkeypatch, tmp_path):
    """A container that allows no namespaces (unshare fails) must not drop the user switch with them."""
    failing = tmp_path / "unshare"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    reward._isolation.cache_clear()
    try:
        assert reward._isolation()[0] == "setpriv"
        assert reward.run_python("import os; print(os.getuid())") == f"{reward.NOBODY}\n"
        (tmp_path / "setpriv").write_bytes(failing.read_bytes())  # no user switch either: nothing runs
        (tmp_path / "setpriv").chmod(0o755)
        reward._isolation.cache_clear()
        assert reward.run_python("print(1)").startswith("error: the trainer is root and cannot run code as an")
    finally:
        reward._isolation.cache_clear()


@ROOT_ONLY
def test_the_process_limit_counts_from_the_processes_the_user_runs_already():
    """RLIMIT_NPROC counts every thread of the code's user (nobody under root, the trainer's own user otherwise, which
    runs hundreds): the tool must still start then, while a fork bomb stays bounded."""
    threads = "import threading, time\nfor _ in range(300):\n    threading.Thread(target=time.sleep, args=[60]).start()"
    busy = psutil.Popen(["setpriv", f"--reuid={reward.NOBODY}", f"--regid={reward.NOBODY}", "--clear-groups",
                         reward.tool_interpreter(), "-c", threads + "\nprint('ready', flush=True)"],
                        stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline() == "ready\n"
        assert reward.run_python("print(6 * 7)") == "42\n"
        bomb = ("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; "
                "time.sleep(30)\n        n += 1\nexcept OSError:\n    print(n < 300)")
        assert reward.run_python(bomb, timeout=5) == "True\n"
    finally:
        busy.kill()


@ISOLATED
def test_killing_every_process_it_can_see_hurts_only_itself():
    bystander = psutil.Popen(["sleep", "30"])  # the trainer's side: a process of the caller's
    try:
        out = reward.run_python("import os, signal\nos.kill(os.getppid(), 9)\nos.kill(-1, signal.SIGKILL)\nprint('x')")
        assert isinstance(out, str) and bystander.is_running() and bystander.status() != psutil.STATUS_ZOMBIE
    finally:
        bystander.kill()


@ROOT_ONLY
@ISOLATED
def test_the_code_cannot_touch_the_trainers_files(tmp_path):
    os.chmod(tmp_path, 0o755)
    (tmp_path / "weights.bin").write_text("trained")
    secret = tmp_path / "private"
    secret.mkdir(mode=0o700)
    (secret / "key").write_text("hidden")
    out = reward.run_python(f"""
for action in (lambda: open({str(tmp_path / 'weights.bin')!r}, 'w').write('gone'),
               lambda: open({str(tmp_path / 'new')!r}, 'w'),
               lambda: print(open({str(secret / 'key')!r}).read())):
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
    out = reward.run_python(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
                            "    print('connected')\nexcept OSError as error:\n    print('refused', error.errno)")
    time.sleep(0.2)
    server.close()
    assert out.startswith("refused") and accepted == []


def test_an_interpreter_the_unprivileged_user_cannot_read_is_refused_with_a_message(monkeypatch, tmp_path):
    hidden = tmp_path / "private" / "python3"  # as a pyenv under a 0700 /root
    hidden.parent.mkdir(mode=0o700)
    hidden.write_text("")
    hidden.chmod(0o755)
    assert not reward._runnable_by_others(str(hidden))
    assert reward._runnable_by_others("/bin/sh")  # every folder above it searchable, the file r-x for others
    monkeypatch.setattr(reward, "tool_interpreter", lambda: "")
    assert reward.run_python("print(1)").startswith("error: no Python that an unprivileged user can run")
