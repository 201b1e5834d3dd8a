"""Child interpreters that start with torch already imported, forked from one server process.

Many tests need a fresh interpreter: one per rank, or one with a different environment (a fix
switched off, a fake Transformer Engine on the path). Importing torch and the torch modules
megatron-core pulls in (dynamo, inductor, DTensor, DCP) costs about 8 s of CPU per interpreter;
megatron-core and the shim on top of that, under 1 s. A session therefore starts one server
(``start``) that imports only torch (and, where installed, transformers), once, and forks a
child per run (``Process``). The child
takes the request's environment, working folder, ``sys.path`` (from its ``PYTHONPATH``) and
``sys.argv``, then runs the code as ``python -c`` would, in a clean ``__main__``.

A child is a real process: its own CUDA state (never initialised in the server), its own
session (``os.setsid``, so killing its group ends what it started), its exit code or signal.
What differs from ``python -c``: torch and those torch modules are already in ``sys.modules``,
and what Python does at startup was done with the server's settings (``PYTHON*`` variables
other than ``PYTHONPATH``; ``sitecustomize`` and ``.pth`` files in the request's path are not
run). A test about what gets imported at startup needs a new interpreter instead.
"""

import gc
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Connection

# What megatron-core imports from torch (``python -X importtime``): nearly all of its cost.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.multiprocessing",
)
# Must stay out of the server: the tests import them under their own settings.
# Also preloaded where installed (the Bridge legs): what Megatron-Bridge's import spends most of
# its time on that imports nothing of megatron (modelopt does: it stays out).
PRELOAD_IF_INSTALLED = ("transformers", "transformers.modeling_utils", "transformers.models.auto", "safetensors.torch")
NOT_PRELOADED = ("megatron", "mcore_cpu_shim", "transformer_engine")
ADDRESS_VARIABLE = "MCORE_CPU_SHIM_TEST_PRELOADED"


def start(env):
    """Start a server (a fresh interpreter with ``env``) and return it; its address goes into
    this process's environment, where ``Process`` finds it. The server imports torch while
    the caller goes on; the first ``Process`` waits for it."""
    address = os.path.join(tempfile.gettempdir(), f"mcore-cpu-shim-preloaded-{os.getpid()}")
    if os.path.exists(address):
        os.unlink(address)
    code = f"import preloaded; preloaded.serve({address!r}, {os.getpid()})"
    server = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL)
    os.environ[ADDRESS_VARIABLE] = address
    return server


def available():
    return ADDRESS_VARIABLE in os.environ


def _connect(timeout=300):
    """A connection to the server, waiting while it still imports torch."""
    address = os.environ[ADDRESS_VARIABLE]
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, family="AF_UNIX")
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no preloaded interpreter answers at {address} after {timeout} s") from None
            time.sleep(0.1)


class Process:
    """``python -c code *args`` as a child of the server, with ``subprocess.Popen``'s
    ``pid``, ``returncode``, ``poll()`` and ``wait()``. Output goes to the files named."""

    def __init__(self, code, args, env, stdout, stderr):
        env = dict(env)
        env.pop(ADDRESS_VARIABLE, None)
        self.args = ["-c", code, *args]
        self._connection = _connect()
        self._connection.send(
            dict(code=code, argv=["-c", *args], env=env, cwd=os.getcwd(), stdout=stdout, stderr=stderr)
        )
        self.pid = self._connection.recv()
        if isinstance(self.pid, Exception):
            raise self.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and self._connection.poll(0):
            self.returncode = self._connection.recv()
            self._connection.close()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None and not self._connection.poll(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()


def serve(address, parent):
    """The server: import ``PRELOAD``, then fork one child per request while ``parent`` lives.
    Each child forks the runner, reports its pid, waits for it and reports how it ended (as
    ``Popen.returncode``: negative for a signal); the runner returns from here into ``_run``
    and then ends as ``python -c`` would."""
    import importlib
    import traceback

    failure = None
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        for name in PRELOAD_IF_INSTALLED:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                importlib.import_module(name)
        leaked = [m for m in sys.modules if m.split(".")[0] in NOT_PRELOADED]
        assert not leaked, f"preloading torch imported {leaked}"
    except BaseException:  # noqa: BLE001  (told to every client instead)
        failure = traceback.format_exc()
    base_path = [p for p in sys.path if p and p not in _pythonpath()]
    # Out of the collector's reach: else the children's collections and exit walk (and so
    # copy) every page of them; an exit took 2 s instead of 0.5 s.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    listener.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the reporters
    while os.getppid() == parent:
        try:
            client, _ = listener.accept()
        except socket.timeout:
            continue
        if failure is not None:
            Connection(client.detach()).send(RuntimeError(f"the preloaded interpreter failed to start:\n{failure}"))
        elif os.fork() == 0:
            listener.close()
            return _run(_report(Connection(client.detach())), base_path)
        client.close()
    os.unlink(address)


def _report(connection):
    """In the reporter: fork the runner (which gets the request back) and tell the client its
    pid and, once it ended, its exit code."""
    runner = None
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        request = connection.recv()
        runner = os.fork()
        if runner == 0:
            connection.close()
            os.setsid()
            return request
        connection.send(runner)
        _, status = os.waitpid(runner, 0)
        connection.send(os.waitstatus_to_exitcode(status))
    finally:
        if runner != 0:  # the reporter ends here, also when the client went away
            os._exit(0)


def _pythonpath():
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _run(request, base_path):
    """Become ``python -c``: environment, folder, standard streams, argv, path, __main__."""
    import importlib
    import multiprocessing.process

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    multiprocessing.process.ORIGINAL_DIR = os.path.abspath(request["cwd"])
    output = os.O_WRONLY | os.O_CREAT | os.O_APPEND  # stdout and stderr may be one file
    streams = ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], output), (2, request["stderr"], output))
    for fd, path, flags in streams:
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = request["argv"]
    sys.path[:] = ["", *_pythonpath(), *base_path]
    importlib.invalidate_caches()
    main = sys.modules["__main__"]
    for name in list(vars(main)):
        if name != "__builtins__":
            delattr(main, name)
    main.__name__, main.__doc__, main.__package__, main.__spec__ = "__main__", None, None, None
    exec(compile(request["code"], "<string>", "exec"), vars(main))
