"""Background compilations: ready per kind, off for good after a failure, and never a crash
when the process exits while one is still running."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading

from streamgrok_kernels.background_compile import BackgroundCompiles


def test_a_kind_is_ready_once_its_compilation_returned():
    compiles, release = BackgroundCompiles("test graphs"), threading.Event()
    compiles.start("a", release.wait)
    compiles.start("a", lambda: None)  # under way: not started twice
    assert not compiles.is_ready("a") and compiles.ready_count() == 0
    release.set()
    assert compiles.wait(timeout=60)
    assert compiles.is_ready("a") and not compiles.is_ready("b")
    assert compiles.ready_count() == 1 and compiles.error is None


def test_a_failed_compilation_turns_every_kind_off_with_one_warning(caplog):
    compiles = BackgroundCompiles("test graphs")
    compiles.start("a", lambda: None)
    compiles.wait(timeout=60)

    def broken() -> None:
        raise RuntimeError("no C++ compiler here")

    with caplog.at_level(logging.WARNING):
        compiles.start("b", broken)
        compiles.wait(timeout=60)
        compiles.turn_off(RuntimeError("a second failure"))
    assert compiles.error == "RuntimeError: no C++ compiler here"
    assert not compiles.is_ready("a") and compiles.ready_count() == 0
    assert caplog.text.count("compiled test graphs off") == 1
    compiles.start("c", lambda: None)  # off: nothing starts
    assert compiles.wait(timeout=1) and not compiles.is_ready("c")


def test_a_process_exiting_mid_compilation_waits_for_it_and_exits_cleanly(tmp_path):
    # a daemon thread still inside PyTorch's C++ code at interpreter exit aborts the process
    # (exit status 134), which `streamgrok chat` did while its decode graph compiled
    done = tmp_path / "done"
    script = textwrap.dedent(f"""
        import torch
        from streamgrok_kernels.background_compile import BackgroundCompiles

        def busy() -> None:
            a = torch.randn(600, 600)
            for _ in range(300):
                a = (a @ a).tanh()
            open({str(done)!r}, "w").write("finished")

        BackgroundCompiles("test graphs").start("a", busy)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "terminate called" not in result.stderr
    assert done.read_text() == "finished"


def test_a_compilation_the_exiting_interpreter_refuses_is_not_reported_as_a_failure():
    # the compiler submits work to executors that shut down as the main thread ends (`make
    # demo` printed "compiled paged K/V reads off (... cannot schedule new futures after
    # shutdown); running eagerly" as its last line when a compilation outlived the stream)
    script = textwrap.dedent("""
        import logging, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from streamgrok_kernels.background_compile import BackgroundCompiles

        logging.basicConfig()
        pool = ThreadPoolExecutor(1)

        def compile_late() -> None:
            while threading.main_thread().is_alive():
                time.sleep(0.01)
            time.sleep(0.2)
            pool.submit(print)

        BackgroundCompiles("test graphs").start("a", compile_late)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "running eagerly" not in result.stderr


def test_threads_switch_faster_while_a_compilation_runs_and_as_before_after():
    # dynamo holds the interpreter lock while it traces: the model's thread, which takes the
    # lock back after every native operator, waited a whole switch interval each time
    default = sys.getswitchinterval()
    compiles, release = BackgroundCompiles("test graphs"), threading.Event()
    other, other_release = BackgroundCompiles("other graphs"), threading.Event()
    compiles.start("a", release.wait)
    other.start("b", other_release.wait)
    assert sys.getswitchinterval() < default
    release.set()
    assert compiles.wait(timeout=60)
    assert sys.getswitchinterval() < default  # the other one still runs
    other_release.set()
    assert other.wait(timeout=60)
    for _ in range(100):  # the thread restores it in its last lines, after `wait` returns
        if sys.getswitchinterval() == default:
            break
        threading.Event().wait(0.01)
    assert sys.getswitchinterval() == default
