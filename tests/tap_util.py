"""TAP output for the Python tests meson runs with protocol 'tap', free loopback endpoints, and
stopping the service processes the tests start.

    from tap_util import tap, skip, plan, free_port, free_endpoint, stop_process
"""
import signal
import socket
import subprocess
import sys

results = []  # one bool per check, in order


def tap(ok, name, detail=""):
    """Prints one check's line (with the last 40 lines of `detail` when it failed); returns ok."""
    results.append(ok)
    print(f"{'ok' if ok else 'not ok'} {len(results)} - {name}")
    if detail and not ok:
        for line in str(detail).splitlines()[-40:]:
            print(f"# {line}")
    sys.stdout.flush()
    return ok


def skip(name, why):
    """A check that cannot run here, said as TAP's SKIP (it counts as passed)."""
    results.append(True)
    print(f"ok {len(results)} - {name} # SKIP {why}")
    sys.stdout.flush()


def plan():
    """Prints the plan line; returns the exit status: 0 when there were checks and all passed."""
    print(f"1..{len(results)}")
    return 0 if results and all(results) else 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_endpoint():
    return f"tcp://127.0.0.1:{free_port()}"


def stop_process(proc, sig=signal.SIGINT, patience_s=30):
    """Asks a still running `proc` to stop with `sig` (a service answers what it holds first), and
    kills it if it has not exited after `patience_s` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(patience_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
