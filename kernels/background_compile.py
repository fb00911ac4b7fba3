"""Compilations on background threads, one per kind of call, that never outlive the process.

A torch.compile of a CPU graph takes seconds to tens of seconds on two cores; callers keep
running eagerly meanwhile and switch once a kind is ready. The thread is a daemon, so an
unfinished compilation never keeps a process alive on its own, but a daemon thread still
inside PyTorch's C++ code when the interpreter finalizes aborts the process ("terminate
called without an active exception", exit status 134: CPython ends such threads by
unwinding them through C++ frames). So each compilation under way is joined at exit
(`atexit`, which runs before daemon threads are ended); a process that exits mid-compilation
waits for it instead of crashing.

While any compilation runs, the interpreter switches threads every 0.5 ms instead of 5 ms:
dynamo traces in Python and holds the interpreter lock most of the time, and the thread
serving the model, which gives the lock up around every native operator and waits for it
again, waited up to a switch interval each time (the live demo's first question with a
host tier, asked while recall's scoring compiled: TTFT 1.7-2.2 s, 0.2 s with 0.5 ms).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

THREAD_PREFIX = "compile "  # names every compilation thread
COMPILING_SWITCH_INTERVAL_S = 0.0005  # the interpreter's switch interval while one runs
DEFAULT_SWITCH_INTERVAL_S = 0.005  # CPython's, restored once none runs


class BackgroundCompiles:
    """The compilations of one compiled function: which kinds are ready, which are under way,
    and the error that turned compilation off for good (`error`; then every call runs
    eagerly). `what` names the function in the warning a failure logs."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.error: str | None = None
        self._lock = threading.Lock()  # guards _ready and _pending
        self._ready: set[Hashable] = set()
        self._pending: dict[Hashable, threading.Thread] = {}

    def is_ready(self, kind: Hashable) -> bool:
        """Whether `kind` compiled (and compilation is still on)."""
        with self._lock:
            return self.error is None and kind in self._ready

    def ready_count(self) -> int:
        """How many kinds compiled and are in use."""
        with self._lock:
            return 0 if self.error is not None else len(self._ready)

    def start(self, kind: Hashable, compile_kind: Callable[[], None]) -> None:
        """Run `compile_kind()` on a background thread unless `kind` is ready or under way;
        an exception from it turns compilation off (`error`, one warning)."""
        with self._lock:
            if self.error is not None or kind in self._ready or kind in self._pending:
                return
            thread = threading.Thread(target=self._compile, args=(kind, compile_kind),
                                      name=f"{THREAD_PREFIX}{self.what}", daemon=True)
            self._pending[kind] = thread
            atexit.register(thread.join)
            thread.start()  # then the interval: a compilation ending now sees this one alive
            sys.setswitchinterval(min(sys.getswitchinterval(), COMPILING_SWITCH_INTERVAL_S))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compilations under way (benchmarks, before they time); True when none
        is left."""
        with self._lock:
            threads = list(self._pending.values())
        for thread in threads:
            thread.join(timeout)
        with self._lock:
            return not self._pending

    def turn_off(self, error: Exception) -> None:
        """Compile no more and run every call eagerly (a compilation or a compiled call
        failed)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = f"{type(error).__name__}: {error}"
        log.warning("compiled %s off (%s); running eagerly", self.what, self.error)

    def _compile(self, kind: Hashable, compile_kind: Callable[[], None]) -> None:
        try:
            import_compiler_quietly()
            compile_kind()
            with self._lock:
                self._ready.add(kind)
        except Exception as error:  # no C++ compiler, an unsupported platform
            if threading.main_thread().is_alive():
                self.turn_off(error)
            # else the interpreter is exiting and its executors refuse the compiler's work
            # ("cannot schedule new futures after shutdown"): nothing to warn about
        finally:
            with self._lock:
                self._pending.pop(kind, None)
            atexit.unregister(threading.current_thread().join)
            _restore_switch_interval()


def _restore_switch_interval() -> None:
    """CPython's switch interval again when no other compilation thread is alive (this
    one is ending; the threads are the record of what runs, so nothing else is kept)."""
    me = threading.current_thread()
    if not any(thread is not me and thread.name.startswith(THREAD_PREFIX) and
               thread.is_alive() for thread in threading.enumerate()):
        if sys.getswitchinterval() == COMPILING_SWITCH_INTERVAL_S:  # nobody else changed it
            sys.setswitchinterval(DEFAULT_SWITCH_INTERVAL_S)


class LazyCompile:
    """`torch.compile(function, **options)`, made on the first call: making it imports the
    compiler (dynamo and inductor, ~1400 modules and over 100 MB resident), which a process
    that never compiles (its decode steps native, say) should not carry."""

    def __init__(self, function: Callable, **options: object) -> None:
        self._function = function
        self._options = options
        self._compiled: Callable | None = None
        self._lock = threading.Lock()  # one torch.compile, whichever thread calls first

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = torch.compile(self._function, **self._options)
        return self._compiled(*args, **kwargs)


# ((grad enabled, inference mode), which inputs are inference tensors)
CallContext = tuple[tuple[bool, bool], tuple[bool, ...]]


def call_context(inputs: Iterable[torch.Tensor]) -> CallContext:
    """What dynamo's guards check of a call beyond its inputs' sizes and dtypes: this
    thread's autograd mode and which inputs are inference tensors (their dispatch keys
    differ). A graph compiled on a background thread (grad on, ordinary tensors, by default)
    fails those guards when called inside `inference_mode` and is compiled again on the
    caller's thread, stalling it (seconds). So the context is part of a compiled call's kind,
    and its compilation runs in it (`in_autograd_mode`, `stand_in`)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled()), \
        tuple(t.is_inference() for t in inputs)


@contextmanager
def in_autograd_mode(context: CallContext) -> Iterator[None]:
    """Run the block (a compilation on its stand-ins) in the call's autograd mode."""
    grad, inference = context[0]
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        yield


def stand_in(real: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()`, made an inference tensor where `real` is one: dynamo's guards tell the two
    apart (their dispatch keys differ), so a stand-in of the other kind would make the first
    real call compile again."""
    with torch.inference_mode(real.is_inference()):
        return make()


def import_compiler() -> None:
    """Import torch.compile's compiler (dynamo, inductor) now, on the calling thread. A
    process that will compile in the background while it serves should call this first: the
    first import on a compile thread (~1400 modules, seconds) holds the GIL and the import
    lock, and the steps of other threads stall behind it (`bench serve --weights q4`, 8
    sessions: TTFT p95 146 ms with the compiler imported up front, 1842-2496 without)."""
    import_compiler_quietly()
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


def import_compiler_quietly() -> None:
    """Import inductor's C++ toolchain module without its import-time warning on machines
    without CUDA ("No CUDA runtime is found"), which would land in the middle of a user's
    output; a CPU compile does not need CUDA."""
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    disabled, cpp_log.disabled = cpp_log.disabled, True
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        cpp_log.disabled = disabled
