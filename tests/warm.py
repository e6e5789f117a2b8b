"""A warm launcher for the suite's `python -m <module> ...` / `python -c <code> ...` processes.

Most of a fault test's subprocess is start-up: importing torch, transformers, llm-compressor and the
stages costs 4-5 CPU-seconds before the first line of the stage runs, and the suite starts dozens of
them to SIGKILL, Ctrl-C or time them. `popen`/`run` here start such a process as a fork of one server
per pytest worker that imported all that once (`python -m tests.warm`): the child is still a real,
separate process with its own pid, file descriptors, cwd, environment, exit status and signals, so a
test can SIGKILL or SIGINT it, read its stdout/stderr and its return code exactly as with `subprocess`.

What a fork cannot give is a fresh interpreter's start-up, so the launch falls back to a real exec
(`subprocess.Popen`, the same arguments) whenever the difference could show:
- the command is not `[sys.executable, "-m", module, ...]` or `[sys.executable, "-c", code, ...]`;
- the cwd is not the repository root the server runs in (sys.path[0] would differ);
- the environment differs from the server's in anything but the variables read at run time (`RUNTIME_ENV`):
  HF_HOME, OMP_NUM_THREADS, PYTHONPATH and the like are read while importing.
Tests of start-up itself (import-time warnings, console scripts, `--help` speed) use `subprocess` directly.
`SPECQUANT_TEST_COLD=1` turns the warm path off for a whole run (every launch is a real exec).

The protocol, one Unix-socket connection per child: the client sends a JSON header (argv, cwd, env) with
the child's stdin/stdout/stderr as SCM_RIGHTS file descriptors; the server forks, replies the child's pid,
and later its wait status; a server with no client (its stdin closed) exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# read by the code the child runs, not while importing it (checked: pipeline/, huggingface_hub's get_token)
RUNTIME_ENV = frozenset({"TMPDIR", "SPECQUANT_TEST_KILLPOINT", "PYTEST_CURRENT_TEST", "HF_TOKEN",
                         "SPECQUANT_SIGNING_KEY", "SPECQUANT_HUB_TOKEN", "COLUMNS", "LINES",
                         "CUBLAS_WORKSPACE_CONFIG",  # read when cuBLAS starts, on a GPU only
                         # torch puts its default into os.environ the first time it asks for the inductor
                         # cache folder (torch/_inductor/runtime/cache_dir_utils.py) and reads it only there
                         "TORCHINDUCTOR_CACHE_DIR",
                         "PYTHONUNBUFFERED"})  # applied by the child when it makes its std streams (_std_streams)
# The server runs with PYTHONHASHSEED=0, so a child may stand for a real exec with PYTHONHASHSEED unset (whose
# seed is random: 0 is one of its values) or 0. An in-process stage run sets it to its seed (pipeline/core/
# seeding.py), for the processes it starts, so most workers' environments hold 0 after their first stage.
HASH_SEED = "0"
# imported by the server once; every one of them is imported by a stage run anyway
PRELOAD = ("torch", "numpy", "safetensors.torch", "transformers", "datasets", "huggingface_hub",
           "compressed_tensors", "hydra", "omegaconf", "matplotlib", "tqdm", "pipeline.core.config",
           "pipeline.stages.runner", "pipeline.stages.data", "pipeline.stages.cache", "pipeline.stages.quantize_drafter",
           "pipeline.stages.quantize_target", "pipeline.stages.evaluate", "pipeline.stages.manifest",
           "pipeline.stages.publish", "pipeline.commands.verify")
# not `pipeline.__main__` or `tests.faults`: runpy warns when the module it is asked to run is already imported


# ---------------------------------------------------------------- server (python -m tests.warm SOCKET)
def _child(conn: socket.socket, listener: socket.socket, others, header: dict, fds: list[int]) -> None:
    """In the forked child: become `python <argv[1:]>` in header's cwd and env, then exit like it."""
    import atexit
    import runpy
    import tempfile
    import traceback

    listener.close()
    conn.close()
    for other in others:  # the connections of the other children still running
        other.close()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    _std_streams(header["env"])
    # a new interpreter turns SIGINT into KeyboardInterrupt unless it started with SIGINT ignored
    signal.signal(signal.SIGINT, signal.SIG_IGN if header["sigint_ignored"] else signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(header["cwd"])
    os.environ.clear()
    os.environ.update(header["env"])
    tempfile.tempdir = None  # read TMPDIR again, as a new interpreter does
    flag, what, *args = header["argv"][1:]
    code = 0
    try:
        if flag == "-m":
            sys.argv = [what, *args]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            import __main__
            exec(compile(what, "<string>", "exec"), vars(__main__))
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exception(exc.with_traceback(exc.__traceback__.tb_next))  # from the child's own frames
        code = "SIGINT" if isinstance(exc, KeyboardInterrupt) else 1
    try:
        threading._shutdown()  # the interpreter waits for non-daemon threads before exiting
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code == "SIGINT":  # an uncaught KeyboardInterrupt ends the process by SIGINT, as CPython does
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(0 if code is None else code & 0xFF)


def _std_streams(env: dict) -> None:
    """sys.stdin/stdout/stderr made again for fds 0-2 as the interpreter makes them at start (Python/
    pylifecycle.c, create_stdio): line-buffered where the fd is a terminal, stderr always; with PYTHONUNBUFFERED
    stdout and stderr unbuffered and written through instead. Encoding and errors stay the server's (same env)."""
    import io

    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    made = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        if fd == 0:
            buf = io.BufferedReader(raw)
        else:
            buf = raw if unbuffered else io.BufferedWriter(raw)
        made.append(io.TextIOWrapper(buf, encoding=old.encoding, errors=old.errors, newline="\n",
                                     line_buffering=not (unbuffered and fd > 0) and (fd == 2 or raw.isatty()),
                                     write_through=unbuffered and fd > 0))
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def serve(path: str) -> None:
    import selectors

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    from pipeline.core.quiet import import_llmcompressor

    import_llmcompressor()
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import matplotlib.pyplot  # noqa: F401  (after the stages chose their backend)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.data == "stdin":
                if not sys.stdin.buffer.read1(1 << 16):  # the client went away: so do we
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    return
                continue
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            header = json.loads(msg.decode())
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _child(conn, listener, list(children.values()), header, fds)
                finally:
                    os._exit(1)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"status {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


# ---------------------------------------------------------------- client
class _Server:
    def __init__(self) -> None:
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="warm-")
        self.path = os.path.join(self.dir, "s")
        self.env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm", self.path], cwd=REPO, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            line = self.proc.stdout.readline()
            self.ready = line.strip() == b"ready"
        return self.ready

    def close(self) -> None:
        import shutil

        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_server: _Server | None = None
_lock = threading.Lock()
launches = {"warm": 0, "cold": 0}


def _ensure() -> _Server:
    global _server
    with _lock:
        if _server is None:
            import atexit

            _server = _Server()
            atexit.register(_server.close)
        return _server


def _get_server() -> _Server | None:
    server = _ensure()
    with _lock:
        return server if server.wait_ready() else None


def start() -> None:
    """Start this process's server now, in the background, so its imports overlap the caller's work."""
    if not os.environ.get("SPECQUANT_TEST_COLD"):
        _ensure()


def _warm_ok(argv, cwd, env) -> bool:
    if os.environ.get("SPECQUANT_TEST_COLD") or len(argv) < 3 or argv[0] != sys.executable:
        return False
    if argv[1] not in ("-m", "-c") or Path(cwd or os.getcwd()).resolve() != REPO:
        return False
    env = dict(os.environ if env is None else env)
    if env.pop("PYTHONHASHSEED", HASH_SEED) != HASH_SEED:
        return False
    base = {**(_server.env if _server is not None else os.environ)}
    base.pop("PYTHONHASHSEED", None)
    keys = (set(env) | set(base)) - RUNTIME_ENV
    return all(env.get(k) == base.get(k) for k in keys)


class WarmProcess:
    """What the tests use of `subprocess.Popen`: pid, stdout/stderr, poll, wait, communicate, signals."""

    def __init__(self, server: _Server, argv, cwd, env, stdin, stdout, stderr, text, sigint_default) -> None:
        self.args, self.returncode = list(argv), None
        self.stdin = self.stdout = self.stderr = None
        mine: list[int] = []  # the child's ends, closed here once sent

        def child_end(spec, fd: int, attr: str | None):
            if spec is None:
                return os.dup(fd)
            if spec == subprocess.DEVNULL:
                return os.open(os.devnull, os.O_RDWR)
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                ours, theirs = (w, r) if fd == 0 else (r, w)
                mode = ("w" if fd == 0 else "r") if text else ("wb" if fd == 0 else "rb")
                setattr(self, attr, open(ours, mode, **({"encoding": "utf-8", "errors": "replace"} if text else {})))
                return theirs
            return os.dup(spec if isinstance(spec, int) else spec.fileno())

        fds = [child_end(stdin, 0, "stdin"), child_end(stdout, 1, "stdout")]
        fds.append(os.dup(fds[1]) if stderr == subprocess.STDOUT else child_end(stderr, 2, "stderr"))
        mine.extend(fds)
        header = {"argv": [str(a) for a in argv], "cwd": str(Path(cwd or os.getcwd()).resolve()),
                  "env": dict(os.environ if env is None else env),
                  "sigint_ignored": not sigint_default and signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(server.path)
            socket.send_fds(self._conn, [json.dumps(header).encode()], fds)
        finally:
            for fd in mine:
                os.close(fd)
        self._buf = b""
        self.pid = int(self._line().split()[1])

    def _line(self, timeout: float | None = None) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            self._conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError("the warm launcher's server went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self):
        if self.returncode is None:
            try:
                self.returncode = int(self._line(timeout=0).split()[1])
            except subprocess.TimeoutExpired:
                return None
            self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None):
        if self.returncode is None:
            self.returncode = int(self._line(timeout).split()[1])
            self._conn.close()
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        out: dict[str, object] = {}

        def drain(name: str) -> None:
            out[name] = getattr(self, name).read()

        readers = [threading.Thread(target=drain, args=(n,), daemon=True) for n in ("stdout", "stderr")
                   if getattr(self, n) is not None]
        for t in readers:
            t.start()
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
            self.stdin = None
        self.wait(timeout)
        for t in readers:
            t.join()
        for n in ("stdout", "stderr"):
            if getattr(self, n) is not None:
                getattr(self, n).close()
        return out.get("stdout"), out.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for n in ("stdin", "stdout", "stderr"):
            f = getattr(self, n)
            if f is not None:
                f.close()
        self.wait()


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen(argv, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False, sigint_default=False):
    """`subprocess.Popen(argv, ...)`, forked from the warm server where that cannot show (module docstring).
    `sigint_default`: start the child with SIGINT at its default, as a shell with job control does, even when
    this process ignores it (a cold exec gets it through preexec_fn)."""
    server = _get_server() if _warm_ok(argv, cwd, env) else None
    if server is None:
        launches["cold"] += 1
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                preexec_fn=_sigint_default if sigint_default else None)
    launches["warm"] += 1
    return WarmProcess(server, argv, cwd, env, stdin, stdout, stderr, text, sigint_default)


def run(argv, cwd=None, env=None, capture_output=False, text=False, timeout=None, input=None, check=False,
        stdout=None, stderr=None):
    """`subprocess.run` through `popen`: returns a CompletedProcess; kills the child on timeout."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE if input is not None else None, stdout=stdout,
                 stderr=stderr, text=text)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(sys.argv[1])
