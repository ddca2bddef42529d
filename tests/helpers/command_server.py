"""A fork server that runs `python ...` and `torchrun ...` command lines without paying torch's import each time
(tests/test_doc_commands.py runs some 200 commands, many through the launchers, which call python several times).

    python tests/helpers/command_server.py serve SOCKET     # imports torch, the package and every entry script
    PATH=$(python tests/helpers/command_server.py shims SOCKET DIR):$PATH bash -c 'python tools/x.py ...'

`shims` writes `python`, `python3` and `torchrun` into DIR: each sends its argv, environment, working directory
and its stdin / stdout / stderr to the server, which forks a child that runs the command as the interpreter would
(`-c CODE`, `-m MODULE`, or a script with sys.path[0] its folder) and answers with its exit code. `torchrun
[--nproc_per_node N] [--standalone ...] SCRIPT ARGS` runs SCRIPT once with WORLD_SIZE=N, as a launcher's dry run
plans a run (the commands are run with --check_only: nothing starts a process group). DOC_FAKE_GPUS=N in the
command's environment makes torch report N CUDA devices (`torch.cuda.is_available`, `device_count`): a check of a
command meant for a GPU node plans its run as it would there (the world size the launcher counts, an `<N>gpu` run
name); a check opens no device.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).resolve().with_name("command_client.py")
TORCHRUN_VALUE_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank",
                        "--master_addr", "--master-addr", "--master_port", "--master-port", "--rdzv_endpoint",
                        "--rdzv-endpoint", "--rdzv_backend", "--rdzv-backend", "--rdzv_id", "--rdzv-id", "--tee",
                        "--max_restarts", "--max-restarts"}


def preload() -> None:
    """torch, the package and every entry script's imports, once, before any fork."""
    import importlib.util

    import torch  # noqa: F401

    scripts = [*REPO_ROOT.glob("train_*.py"), *REPO_ROOT.glob("fvtools/train_*.py"), *REPO_ROOT.glob("tools/*.py"),
               REPO_ROOT / "benchmarks" / "gpu_acceptance.py", REPO_ROOT / "benchmarks" / "fault_injection.py",
               REPO_ROOT / "benchmarks" / "check_real_size_memory.py"]
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    for path in scripts:
        spec = importlib.util.spec_from_file_location(f"_preload_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)  # its top-level imports stay in sys.modules for the children
    sys.path.remove(str(REPO_ROOT / "tools"))


def run_python(argv: list[str]) -> int:
    """What `python ARGV` does, in this (forked) process; returns the exit code."""
    try:
        if argv[:1] == ["-c"]:
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:  # a traceback, as the interpreter prints it
        import traceback

        traceback.print_exc()
        return 1
    return 0


def run_torchrun(argv: list[str]) -> int:
    """`torchrun [launcher flags] SCRIPT ARGS` as one process with WORLD_SIZE = nproc_per_node x nnodes."""
    nproc, nnodes, index = 1, 1, 0
    while index < len(argv) and argv[index].startswith("-"):
        flag, _, value = argv[index].partition("=")
        if flag in TORCHRUN_VALUE_FLAGS and not value:
            value, index = argv[index + 1], index + 1
        if flag in ("--nproc_per_node", "--nproc-per-node"):
            nproc = int(value)
        elif flag == "--nnodes":
            nnodes = int(value)
        index += 1
    os.environ["WORLD_SIZE"] = str(nproc * nnodes)
    return run_python(argv[index:])


def child(request: dict, fds: list[int]) -> int:
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if os.environ.get("DOC_FAKE_GPUS"):
        import torch

        count = int(os.environ["DOC_FAKE_GPUS"])
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: count
    code = run_torchrun(request["argv"]) if request["kind"] == "torchrun" else run_python(request["argv"])
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(path: str) -> None:
    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel; they report their own code
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
        size = int.from_bytes(message[:8], "big")
        data = message[8:]
        while len(data) < size:
            data += connection.recv(size - len(data))
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 1
            try:
                code = child(json.loads(data), fds)
            finally:
                connection.sendall(str(code).encode())
                os._exit(0)
        connection.close()
        for fd in fds:
            os.close(fd)


def write_shims(path: str, folder: str) -> str:
    """`python`, `python3` and `torchrun` in `folder` that run their command on the server at `path`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, kind in (("python", "python"), ("python3", "python"), ("torchrun", "torchrun")):
        shim = folder / name
        shim.write_text(f"#!/bin/sh\nDOC_COMMAND_SERVER={path} exec {sys.executable} -S -E {CLIENT} {kind} \"$@\"\n")
        shim.chmod(0o755)
    return str(folder)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        print(write_shims(sys.argv[2], sys.argv[3]))
