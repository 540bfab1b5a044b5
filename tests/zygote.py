"""A process that imports torch and ddlcomm once, then forks test ranks from itself.

Importing torch costs each rank about 2.4 s of CPU; with 4 ranks on 2 cores that was most of
a short test. tests/harness.py starts one zygote per pytest session and asks it, one JSON
line on stdin per rank, to run ``tests/workers/<worker>.py`` as ``__main__`` in a fork with
the rank's environment, working directory and output file. Each child then exits as the
script run by a fresh interpreter would, up to the interpreter's teardown: non-daemon
threads are joined, atexit handlers run, output is flushed, and the exit status is the
same; the teardown of torch's modules (0.7-0.9 s of CPU per rank, most of a short test's
time on 2 cores) is skipped. Exit itself is tested in fresh interpreters under torchrun
(tests/test_exit.py, tests/test_elastic.py).

Protocol (JSON lines): request ``{"id", "argv", "env", "cwd", "out"}``; replies
``{"id", "pid"}`` once forked and ``{"id", "returncode"}`` (negative: killed by that signal)
once reaped. The zygote refuses to serve if importing started a second thread (forking
would copy its locks).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys
import traceback


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(request: dict) -> int:
    """Runs in the fork: becomes the rank and runs its script; returns the exit status."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    script, *args = request["argv"]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as for `python script.py`
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (the interpreter would print it and exit 1)
        traceback.print_exc()
        return 1
    return 0


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> int | None:
    """The zygote's loop; returns in a forked child with its exit status, or None at EOF."""
    children: dict[int, int] = {}  # pid -> request id
    pending = ""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _reply({"id": children.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 1 << 16).decode()
        if not chunk:
            return None
        pending += chunk
        while "\n" in pending:
            line, pending = pending.split("\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return _child(request)
            children[pid] = request["id"]
            _reply({"id": request["id"], "pid": pid})


def main() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import ddlcomm  # noqa: F401
    import ddlcomm.compressed  # noqa: F401
    import ddlcomm.fsdp  # noqa: F401
    import ddlcomm.hooks  # noqa: F401

    threads = _threads()
    _reply({"ready": threads == 1, "threads": threads})
    if threads != 1:
        sys.exit(1)
    code = serve()
    if code is None:  # the zygote itself, at EOF
        sys.exit(0)
    _exit_as_a_script(code)


def _exit_as_a_script(code: int) -> None:
    """What Py_FinalizeEx does that a script can observe, in its order, then the exit."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()  # prints any handler's exception, as the interpreter does
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
