"""Model-written code run where it can hurt nothing but itself, and the worker processes that call reward_fn and the
Python tool with deadlines.

Machinery that a researcher does not edit: reward.py is the task (its data, prompts and graders) and train.py the
algorithm; both reach this file through a narrow interface.

    run_python(code, timeout, memory_mb) -> str     what the code printed, as text; never raises
    tool_interpreter() -> str                       the Python that runs tool code, "" when there is none
    workers = RewardWorkers(reward_fn, n, timeout)  n forked worker processes, each in its own session
    workers.score(completions, items)               (scores, errors): reward_fn of each, a failed call scoring 0
    workers.run_python(codes)                       what run_python printed for each code, the runs in parallel
    workers.close()                                 every worker killed, with what it started

It stands apart because its guarantees are its point, and easy to break in passing. A reward_fn that raises, hangs
(even where no signal reaches), or ends its process costs its sample the score and the batch at most the timeout and
a second, never the run. Code that the model writes gets bounded time, memory, output and processes, no network, no
file of the trainer's or of another call, and nothing it starts or writes outlives its call. It never imports torch,
train or reward: the trainer hands RewardWorkers its reward_fn.
"""

import ctypes
import functools
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import resource
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import stopping

# ----------------------------------------------------------------------------------------------------------------
# the Python tool: model-written code, run where it can hurt nothing but itself (run_python)

TOOL_OUTPUT_CHARS = 10_000  # what the model sees of a run's stdout and stderr
TOOL_TIMEOUT = 10.0  # seconds of wall time for one run
TOOL_PROCESSES = 16  # processes and threads one call may run at once, when the trainer is root
# When the trainer is root, each call runs as a user of its own, TOOL_UID_BASE + the id of the thread that makes it: no
# two calls running at once share one. The base starts the band that systemd leaves unused, above its container UIDs.
TOOL_UID_BASE = 0x70000000
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # where every user may write
# Run as root inside the call's new namespaces, before the code's user takes over: the call's folder becomes /tmp and
# a new tmpfs of memory_mb becomes /dev/shm, so what the code writes to either is the call's alone and goes with it.
# The code's stderr joins its stdout here; unshare's own goes to /dev/null (what it says of killed code is noise).
TOOL_MOUNTS = (
    'folder=$1 size=$2; shift 2; mount --bind "$folder" /tmp && '
    'mount -t tmpfs -o size="$size"m,nosuid,nodev tmpfs /dev/shm && cd /tmp/work && exec "$@" 2>&1'
)


def _runnable_by_others(path: str) -> bool:
    """Whether a user other than the owner can execute `path`: every folder above it searchable, itself r-x."""
    path = os.path.realpath(path)
    folders = [os.path.dirname(path)]
    while folders[-1] != os.path.dirname(folders[-1]):
        folders.append(os.path.dirname(folders[-1]))
    return all(os.stat(f).st_mode & 0o001 for f in folders) and os.stat(path).st_mode & 0o005 == 0o005


def tool_interpreter() -> str:
    """The Python that runs tool code: this one, or when the trainer is root and the unprivileged user cannot run it
    (a pyenv under /root), the system's /usr/bin/python3. "" when there is none."""
    if os.geteuid() != 0:
        return sys.executable
    for path in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(path) and _runnable_by_others(path):
            return path
    return ""


def _tool_uid() -> int:
    """The user a call made by this thread runs as: its own under root (TOOL_UID_BASE), else the trainer's."""
    return TOOL_UID_BASE + threading.get_native_id() if os.geteuid() == 0 else os.getuid()


def _command(namespaces: list[str], folder: str, uid: int, memory_mb: int, program: list[str]) -> list[str]:
    """The command that runs `program` for a call: in the namespaces with TOOL_MOUNTS done, if any; as `uid` under root
    (which dies with its parent as PID 1 does: a change of user would drop that)."""
    command = list(namespaces)
    if namespaces:
        command += ["sh", "-c", TOOL_MOUNTS, "sh", folder, str(memory_mb)]
    if os.geteuid() == 0:
        command += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--pdeathsig=KILL", "--"]
    return command + program


@functools.cache
def _isolation() -> list[str] | None:
    """The command prefix that gives tool code new mount, PID, network and IPC namespaces (and a user namespace of
    the trainer's user when it is not root): TOOL_MOUNTS gives it a /tmp and /dev/shm of its own, and the /proc of
    its own processes; when its PID 1 exits, the kernel kills every process it started, double-forked daemons included;
    no network but a loopback that is down; SysV shared memory and queues go with the call. [] where the OS allows no
    namespaces (then, under root, the call's own user, whose processes and files are found and removed after the
    call); None when root cannot switch users: then no code runs."""
    namespaces = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--ipc", "--"]
    if os.geteuid() != 0:  # a user namespace of the trainer's user allows the others without root
        namespaces[1:1] = ["--user", "--map-root-user"]
    folder = tempfile.mkdtemp(prefix="tool_")
    try:
        os.mkdir(os.path.join(folder, "work"))
        for prefix in (namespaces, []):
            try:
                command = _command(prefix, folder, _tool_uid(), 64, ["true"])
                if subprocess.run(command, capture_output=True, timeout=10).returncode == 0:
                    return prefix
            except (OSError, subprocess.SubprocessError):
                pass
        return None
    finally:
        subprocess.run(["rm", "-rf", "--", folder], capture_output=True)


def _threads_of(uid: int) -> int:
    """How many threads the processes of `uid` run now (Linux; 0 elsewhere): what RLIMIT_NPROC counts."""
    if not os.path.isdir("/proc"):
        return 0
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # ended meanwhile
            pass
    return count


def _new_cgroup(name: str, memory_mb: int) -> str:
    """A new memory cgroup `name` that caps a call's memory as a whole (its forks, its /dev/shm and page cache
    included; no swap): a child of the trainer's cgroup (cgroup v1), or of the trainer's or the root cgroup, whichever
    lets a child control memory (v2). "" where none can be made: not root, or no such cgroup file system."""
    if os.geteuid() != 0 or not os.path.exists("/proc/self/cgroup"):
        return ""
    with open("/proc/self/cgroup") as f:  # lines of ID:controllers:the trainer's cgroup in their hierarchy
        own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
    if "memory" in own:  # cgroup v1, a hierarchy per controller: a child of the trainer's memory cgroup
        parents = [f"/sys/fs/cgroup/memory{own['memory']}"]
        limits = [("memory.limit_in_bytes", memory_mb << 20), ("memory.memsw.limit_in_bytes", memory_mb << 20)]
    else:  # v2: a cgroup that holds processes (the trainer's, mostly) cannot give a child memory control; the root can
        parents = [f"/sys/fs/cgroup{own.get('', '/')}", "/sys/fs/cgroup"]
        limits = [("memory.max", memory_mb << 20), ("memory.swap.max", 0)]
    for parent in parents:
        folder = os.path.join(parent, name)
        try:
            os.mkdir(folder)
        except OSError:
            continue
        try:
            for i, (file, value) in enumerate(limits):
                if i == 0 or os.path.exists(os.path.join(folder, file)):  # the swap file exists where swap is counted
                    with open(os.path.join(folder, file), "w") as f:
                        f.write(str(value))
            return folder
        except OSError:  # no memory.max: v2 gives this child no memory control
            os.rmdir(folder)
    return ""


def _oom_kills(cgroup: str) -> int:
    """How many of the call's processes the kernel killed for passing its cgroup's memory limit."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        if os.path.exists(os.path.join(cgroup, name)):
            with open(os.path.join(cgroup, name)) as f:
                return int(dict(line.split() for line in f).get("oom_kill", 0))
    return 0


def _remove_cgroup(folder: str) -> None:
    """The call's cgroup removed, once the processes it held have all exited (at most a second)."""
    for _ in range(100):
        try:
            return os.rmdir(folder)
        except FileNotFoundError:
            return
        except OSError:  # busy: a killed process not yet gone
            time.sleep(0.01)


def _remove_files_of(uid: int, folders) -> None:
    """Whatever `uid` owns in `folders` and in the folders within them that every user may write, removed."""
    found = []
    folders = list(folders)
    while folders:
        try:
            entries = list(os.scandir(folders.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == uid:
                found.append(entry.path)
            elif stat.S_ISDIR(info.st_mode) and info.st_mode & 0o002:
                folders.append(entry.path)
    for i in range(0, len(found), 1000):  # rm, as for the call's folder (_clean_up)
        subprocess.run(["rm", "-rf", "--", *found[i : i + 1000]], stdin=subprocess.DEVNULL, capture_output=True)


def run_python(code: str, timeout: float = TOOL_TIMEOUT, memory_mb: int = 2048) -> str:
    """Run model-written `code` in a fresh Python process and return its stdout and stderr as text: at most
    TOOL_OUTPUT_CHARS, with a note when cut or timed out. Never raises. The code runs in a new empty folder of its own,
    as a user of its own when the trainer is root, in its own namespaces where the OS allows (_isolation), with limits
    on CPU time, wall time, memory (of the call as a whole where a cgroup can be made), file size and processes; nothing
    it starts or writes outlives the call."""
    root = os.geteuid() == 0
    uid = _tool_uid()
    namespaces = []
    folder = ""
    cgroup = ""
    try:
        interpreter = tool_interpreter()
        if sys.platform == "linux":
            namespaces = _isolation()
        if not interpreter:
            return (
                "error: no Python that an unprivileged user can run (the trainer's lives where others cannot "
                "read); install /usr/bin/python3"
            )
        if namespaces is None:
            return (
                "error: the trainer is root and cannot run code as an unprivileged user: setpriv (util-linux >= 2.33)"
            )
        folder = tempfile.mkdtemp(prefix="tool_")  # main.py, and work/: the code's working directory, TMPDIR and HOME
        inside = "/tmp" if namespaces else folder  # the folder as the code sees it: TOOL_MOUNTS makes it /tmp
        os.mkdir(os.path.join(folder, "work"))
        with open(os.path.join(folder, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        if root:
            for path in (folder, os.path.join(folder, "work"), os.path.join(folder, "main.py")):
                os.chown(path, uid, uid)
        if sys.platform == "linux":
            cgroup = _new_cgroup(os.path.basename(folder), memory_mb)
        # Processes and threads, more than the code's user runs already: under root the call's own user, which runs
        # none (or zombies that a PID 1 has not reaped); otherwise the trainer's, which runs hundreds of threads.
        processes = TOOL_PROCESSES if root else 256
        processes += _threads_of(uid)

        def limit():  # in the child, before exec: its own session, cgroup and limits, which its children inherit
            os.setsid()
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the worker that started it
            os.umask(0o077)  # what the code writes, its user's alone
            if cgroup:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            for kind, value in (
                (resource.RLIMIT_CPU, math.ceil(timeout) + 1),
                (resource.RLIMIT_NPROC, processes),
                (resource.RLIMIT_AS, memory_mb << 20),
                (resource.RLIMIT_FSIZE, 64 << 20),
                (resource.RLIMIT_NOFILE, 256),
                (resource.RLIMIT_CORE, 0),
            ):
                resource.setrlimit(kind, (value, value))

        work = f"{inside}/work"
        # One thread each for OpenMP and OpenBLAS: numpy's threads would count against the limit.
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": work,
            "TMPDIR": work,
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        }
        # A file, not a pipe: a flood of output cannot block anyone. Nameless and outside the folder: the code cannot
        # swap it for a link to a file only the trainer may read, or for a FIFO that would stall the reading.
        with tempfile.TemporaryFile() as output:
            command = _command(namespaces, folder, uid, memory_mb, [interpreter, "-I", f"{inside}/main.py"])
            process = subprocess.Popen(
                command,
                cwd=os.path.join(folder, "work"),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.DEVNULL if namespaces else subprocess.STDOUT,
                preexec_fn=limit,
            )
            note = "" if _ended_within(process, timeout) else f"\n[timed out after {timeout:g} s]"
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its namespace's PID 1 goes, and every process with it
            except ProcessLookupError:
                pass
            process.wait()
            if cgroup and _oom_kills(cgroup):  # said as Python would: tool_failure counts it as an error
                note += f"\nMemoryError: the call used its {memory_mb} MB of memory, its processes together; killed"
            output.seek(0)
            head = output.read(4 * TOOL_OUTPUT_CHARS)  # a character is at most 4 bytes
            size = os.fstat(output.fileno()).st_size
        text = head.decode("utf-8", errors="replace")
        if len(text) > TOOL_OUTPUT_CHARS or size > len(head):
            text = text[:TOOL_OUTPUT_CHARS] + f"\n[output cut at {TOOL_OUTPUT_CHARS} characters]"
        return text + note
    except Exception as error:  # the tool never raises: the model sees what went wrong
        return f"error: the tool could not run the code ({type(error).__name__}: {error})"
    finally:
        if folder:
            _clean_up(folder, uid, namespaces, cgroup)


def _ended_within(process: subprocess.Popen, timeout: float) -> bool:
    """Whether `process` ended within `timeout` seconds. Woken by its pidfd when it ends, where the kernel has them:
    Popen.wait(timeout) polls at intervals that double, so a call ending at 16 ms would be seen at 31 ms."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux 5.3 or newer
        try:
            process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


def _clean_up(folder: str, uid: int, namespaces: list[str], cgroup: str) -> None:
    """After a call, never raising: its folder removed, and its cgroup; under root, what its user left where every user
    may write (the namespaces' own /tmp and /dev/shm went with them), and without a PID namespace, every process its
    user still runs: kill(-1) as that user reaches those and no others."""
    try:
        if os.geteuid() == 0 and not namespaces:
            subprocess.run(_command([], folder, uid, 0, ["sh", "-c", "kill -KILL -1"]), capture_output=True)
            _remove_files_of(uid, SHARED_FOLDERS)
        elif os.geteuid() == 0:  # the namespaces' own /tmp and /dev/shm went with them
            _remove_files_of(uid, ("/var/tmp", "/run/lock"))
        # rm, not shutil.rmtree, which recurses per level: a folder nested 10,000 deep would raise
        subprocess.run(["rm", "-rf", "--", folder], stdin=subprocess.DEVNULL, capture_output=True)
    except OSError:
        pass
    if cgroup:
        _remove_cgroup(cgroup)


# ----------------------------------------------------------------------------------------------------------------
# the workers: reward_fn and run_python on model output, in forked processes, each call with a deadline


def _reward_or_error(
    reward_fn, completion: str, item: dict, timeout: float, terms: tuple = ()
) -> tuple[float | dict, str | None]:
    """In a worker: (score, None), or (0.0, why) when reward_fn raises, runs past `timeout` seconds, or returns
    anything but a finite number (a NaN reward would stop all learning). With `terms`, the names of the terms that
    reward_fn returns in a dict: ({name: value}, None), or, where a term is missing or not a finite number (scored 0)
    or one is not among them (left out), ({name: value}, why). reward_fn arrives pickled, by reference: a
    module-level function, found by name in the worker, which holds the trainer's modules as they were at its fork."""

    def raise_timeout(signum, frame):
        raise TimeoutError("reward_fn ran past --reward_timeout")

    signal.signal(signal.SIGALRM, raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout, 1.0)  # repeats if reward_fn swallows the TimeoutError
    try:
        value = reward_fn(completion, item)
    except Exception:
        return _failed(terms), traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if terms:
        return _terms_or_error(value, terms)
    if not _is_finite_number(value):
        return 0.0, f"reward_fn returned {repr(value)[:200]}, not a finite number"
    return float(value), None


def _is_finite_number(value) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


def _failed(terms: tuple) -> float | dict:
    """What a failed reward_fn call scores: 0, or 0 for each of its terms."""
    return dict.fromkeys(terms, 0.0) if terms else 0.0


def _terms_or_error(value, terms: tuple) -> tuple[dict, str | None]:
    """reward_fn's dict of terms, each of `terms` a float: a missing or bad one 0, and why (None if none was)."""
    if not isinstance(value, dict):
        return _failed(terms), f"reward_fn returned {repr(value)[:200]}, not a dict of its terms {list(terms)}"
    scored = {}
    wrong = []
    for name in terms:
        term = value.get(name)
        scored[name] = float(term) if _is_finite_number(term) else 0.0
        if name not in value:
            wrong.append(f"no term {name!r}")
        elif not _is_finite_number(term):
            wrong.append(f"term {name!r} is {repr(term)[:100]}, not a finite number")
    unknown = [repr(name)[:100] for name in value if name not in terms]
    if unknown:
        wrong.append(f"terms {', '.join(unknown)} that no item returned at start (left out)")
    if wrong:
        return scored, f"reward_fn returned {'; '.join(wrong)}: those terms score 0"
    return scored, None


def _send(connection: socket.socket, data: bytes, deadline: float | None = None) -> None:
    """`data` sent as one message (its length, then itself); TimeoutError past `deadline` (time.monotonic()) if any."""
    connection.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
    connection.sendall(len(data).to_bytes(8, "big") + data)


def _receive(connection: socket.socket, deadline: float | None = None) -> bytes:
    """One message; TimeoutError past `deadline` if any, EOFError when the other end has closed."""

    def read(size):
        data = bytearray()
        while len(data) < size:
            connection.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
            chunk = connection.recv(min(size - len(data), 1 << 20))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    return read(int.from_bytes(read(8), "big"))


def _serve(connection: socket.socket) -> None:
    """A worker: calls each (function, args) that arrives (reward_fn's or the tool's) until the trainer closes the
    connection."""
    os.setsid()  # its own session and process group: signals sent to the trainer's group are the trainer's
    # Not the trainer's stop handler, which a replacement inherits. SIGTERM ends a worker, as multiprocessing's own
    # clean-up at exit needs; SIGINT and SIGUSR1 (a batch system's time-limit warning, sent to every process of a
    # job) leave it scoring: a stop is the trainer's to act on.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux): killed when the trainer dies
    except (OSError, AttributeError):
        pass
    while True:
        try:
            function, args = pickle.loads(_receive(connection))
        except EOFError:
            return
        _send(connection, pickle.dumps(function(*args)))


class RewardWorkers:
    """`reward_fn` (the trainer's is reward.reward_fn: a module-level function, which a worker finds by its name), and
    the tool's run_python, in `workers` forked processes, each in its own session. A reward_fn call past `timeout` is
    cut off inside its worker (SIGALRM). A worker that has not answered a second later (stuck where SIGALRM cannot
    reach, as C code with signals blocked, or stopped by SIGSTOP) or is dead is killed with its process group and
    replaced, and its call scores 0: every exchange with a worker, the call sent and its answer read, has that
    deadline, so a batch never waits much longer than its slowest allowed call. With `terms`, the names of the terms
    that reward_fn returns in a dict, each completion scores a dict of them. With show_first_error, the first
    failure is printed, once."""

    def __init__(self, reward_fn, workers: int, timeout: float, terms: tuple = (), show_first_error: bool = False):
        self.reward_fn = reward_fn
        self.timeout = timeout
        self.terms = tuple(terms)
        self.show_first_error = show_first_error
        self.context = multiprocessing.get_context("fork")
        self.workers = [self._start() for _ in range(workers)]

    def _start(self):
        """A new worker: (process, the trainer's end of its connection)."""
        ours, theirs = socket.socketpair()  # a socket, whose every exchange can have a deadline (_run)
        process = self.context.Process(target=_serve, args=(theirs,), daemon=True)
        process.start()
        theirs.close()
        return process, ours

    @staticmethod
    def _stop(process, connection):
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the worker and whatever reward_fn started in its group
        except ProcessLookupError:  # gone already, or killed before its setsid
            process.kill()
        process.join()
        connection.close()  # after the kill: a worker that saw its socket close would print a traceback

    def _replace(self, w):
        """Worker w killed and a new one in its place; the old one's exit code."""
        process, connection = self.workers[w]
        self._stop(process, connection)
        self.workers[w] = self._start()
        return process.exitcode

    def score(self, completions: list[str], items: list[dict]) -> tuple[list, list[str]]:
        """reward_fn of each completion with its item: a float each, or a dict of the terms the workers were made
        with; why the failed calls (scored 0) and terms (0) failed."""
        calls = []
        for completion, item in zip(completions, items):
            calls.append((_reward_or_error, (self.reward_fn, completion, item, self.timeout, self.terms)))
        results, failed = self._run(calls, self.timeout + 1.0, "reward_fn", interruptible=True)
        for i, why in failed.items():
            results[i] = (_failed(self.terms), f"{why}: scored 0, and the worker replaced")
        errors = [error for _, error in results if error]
        if errors and self.show_first_error:
            print(f"reward_fn failed; it scores 0, counted as reward_errors (shown once):\n{errors[0]}", flush=True)
            self.show_first_error = False
        return [value for value, _ in results], errors

    def run_python(self, codes: list[str]) -> list[str]:
        """What run_python of each code printed, the runs in parallel; a run whose worker failed says why."""
        outputs, failed = self._run([(run_python, (code,)) for code in codes], TOOL_TIMEOUT + 5.0, "tool")
        return [f"error: {failed[i]}" if i in failed else output for i, output in enumerate(outputs)]

    def _run(
        self, calls: list[tuple], seconds: float, what: str, interruptible: bool = False
    ) -> tuple[list, dict[int, str]]:
        """Each (function, args) called in a free worker; the results in order, and why each call that has none failed:
        its worker died, or did not answer within `seconds` of being sent the call, sending and answering included
        (stuck where SIGALRM cannot reach, or stopped by SIGSTOP): then it is killed and replaced. `interruptible`:
        stopping.Interrupted, looked for five times a second, once a stop gives up the step's rollouts."""
        # Calls travel as pickle's bytes: SGLang patches multiprocessing's own pickling of tensors for CUDA IPC in
        # the trainer's process, after which it fails on a CPU tensor that a row may hold.
        waiting = [(i, pickle.dumps(call)) for i, call in enumerate(calls)][::-1]
        results = [None] * len(calls)
        failed = {}
        busy = {}  # worker index -> (call index, deadline)
        died = f"its {what} worker died"
        late = f"its {what} worker did not answer within {seconds:g} s (stuck where SIGALRM cannot reach, or stopped)"
        while waiting or busy:
            if interruptible:
                stopping.check()
            failures = {}  # worker index -> why its call failed
            for w in range(len(self.workers)):
                if w not in busy and waiting:
                    if not self.workers[w][0].is_alive():  # killed between calls
                        self._replace(w)
                    i, call = waiting.pop()
                    busy[w] = (i, time.monotonic() + seconds)
                    try:  # a stopped worker reads nothing: a call larger than the socket's buffer waits for it
                        _send(self.workers[w][1], call, busy[w][1])
                    except OSError as error:  # TimeoutError is one
                        failures[w] = late if isinstance(error, TimeoutError) else died
            answering = [w for w in busy if w not in failures]
            wait = max(0.0, min((busy[w][1] for w in answering), default=0.0) - time.monotonic())
            wait = min(wait, 0.2)  # a stop looked for five times a second
            ready = multiprocessing.connection.wait([self.workers[w][1] for w in answering], wait)
            for w in answering:
                i, deadline = busy[w]
                if self.workers[w][1] in ready:
                    try:  # a worker stopped half-way through its answer sends the rest never
                        results[i] = pickle.loads(_receive(self.workers[w][1], deadline))
                        del busy[w]
                    except TimeoutError:
                        failures[w] = late
                    except (EOFError, OSError):  # the call ended its worker (os._exit), or something killed it
                        failures[w] = died
                elif time.monotonic() >= deadline:
                    failures[w] = late
            for w, failure in failures.items():
                failed[busy.pop(w)[0]] = f"{failure} (exit code {self._replace(w)})"
        return results, failed

    def close(self):
        """Every worker killed, with what its reward_fn started: never waits on a stuck call."""
        for process, connection in self.workers:
            self._stop(process, connection)
        self.workers = []
