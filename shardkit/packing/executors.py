"""Where pack jobs run: a local process pool (the default) or a Ray cluster. Both run the
same job function on the same jobs, so the output is the same; only the place differs.

A runner calls `on_done` with each job's result in job order, keeps a bounded number of
jobs in flight (results can be large), and reports how many images are done.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from typing import Any, TypeVar

from .. import storage

J = TypeVar("J")
R = TypeVar("R")
Runner = Callable[[Callable[[J], R], Sequence[J], Callable[[R], None], Callable[[int], None]], None]

_counter: Any = None  # multiprocessing.Value shared with pool workers, for the progress bar
_stop: Any = None  # a shared flag, raised by the pack process when it gives up
_workers, _processes = 1, 1  # the run's workers (the cores its jobs share) and its pool's processes
_load: Any = None  # multiprocessing.Array: [the run's jobs running now, those not started yet] (None: inline, Ray)
_job = threading.local()  # .stop: the stop event of the job a pool thread works for


class Stopped(Exception):
    """A job ended early: the pack was given up (Ctrl-C, or another job failed)."""


def init_worker(counter: Any, stop: Any = None, workers: int = 1, processes: int = 1, load: Any = None) -> None:
    global _counter, _stop, _workers, _processes, _load
    _counter, _stop, _workers, _processes, _load = counter, stop, workers, processes, load
    storage.stop_when(stop_point)  # retries give up with the pack
    storage.share_uploads(processes)  # the pool's uploads share one budget of parts in flight


def threads() -> int:
    """Threads a job in this process may keep busy with its images now: the run's workers
    shared among its processes while jobs wait to start, then among the jobs still running,
    so that the cores a small pack (one shard) or the last jobs of a pack would leave idle
    are lent to the jobs still going."""
    if _load is None:
        return _workers
    with _load.get_lock():
        running, waiting = _load[0], _load[1]
    return -(-_workers // (_processes if waiting else max(1, running)))


def most_threads() -> int:
    """The most `threads()` can give in this process (with one job left running)."""
    return _workers


def _as_running(fn: Callable[[J], R], job: J) -> R:
    """`fn(job)` on a pool worker, counted among the run's jobs running (see `threads`)."""
    with _load.get_lock():
        _load[0] += 1
        _load[1] -= 1
    try:
        return fn(job)
    finally:
        with _load.get_lock():
            _load[0] -= 1


def _init_pool_worker(counter: Any, stop: Any, workers: int, processes: int, load: Any) -> None:
    """A pool worker leaves Ctrl-C to the pack process, which raises `stop` instead: the
    terminal sends SIGINT to the whole process group, and a worker interrupted (or killed)
    while it sends a result leaves half a message in the pool's pipe, on which the pool's
    shutdown waits forever. It starts with SIGINT held (`_sigint_held`): one that came
    since is dropped here."""
    init_worker(counter, stop, workers, processes, load)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold Ctrl-C back while the pool starts workers (a submit forks them): interrupted
    there, the pool has workers but not yet the thread that would tell them to stop, and
    they would wait for work forever; and a worker forked meanwhile must not take it before
    it ignores it (it starts with SIGINT blocked). The kernel may deliver SIGINT to any
    thread that does not block it (tqdm's monitor thread, say), and Python then runs the
    handler in the main thread all the same, so the handler is swapped too: a Ctrl-C that
    came meanwhile is raised again as the block ends."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    came: list[int] = []
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        if came:
            signal.raise_signal(signal.SIGINT)


def stop_point() -> None:
    """Where a job may end early: raises Stopped once the pack process has given up, or the
    job this thread works for has (`working_for`)."""
    given_up: threading.Event | None = getattr(_job, "stop", None)
    if (_stop is not None and _stop.value) or (given_up is not None and given_up.is_set()):
        raise Stopped


def working_for(stop: threading.Event, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` on a thread of a job's own pool: its storage retries end once `stop` is set
    (the job was given up), whoever else is still packing."""
    _job.stop = stop
    try:
        return fn(*args)
    finally:
        _job.stop = None


def _die_with_parent() -> None:
    """Linux: have the kernel send this pool worker SIGTERM when the pack process dies, so
    killing `shardkit pack` (even with SIGKILL, where no cleanup runs) leaves no workers behind.
    A parent that died before that (between the fork and here) is not waited for."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():
        os._exit(1)


def _apply(fn: Callable[[J], R], job: J) -> R:
    return fn(job)


def tick(n: int) -> None:
    if _counter is not None and n:
        with _counter.get_lock():
            _counter.value += n


UPLOADING = 4  # processes a core where the jobs write into an object store...
ALL_AT_ONCE = 8  # ...or as many as the jobs, up to this many a core: a pack's every shard at once
MOST_UPLOADING = 64  # ...and no more than this many in all (their uploads share a budget of parts in flight)


def local(workers: int, uploading: bool = False) -> Runner[Any, Any]:
    """A process pool of `workers` (inline, without a pool, for one); `uploading` (the
    shards go to an object store) and more than one, more processes (`uploading_processes`):
    a job there spends most of its time waiting on the network (its parts going up at a
    connection's capped rate, the upload's start and end, its progress record), which other
    jobs' CPU fills; their uploads share one budget of parts in flight
    (storage.share_uploads), so more processes cost no more memory."""
    return functools.partial(_run_local, workers=workers, uploading=uploading and workers > 1)


def uploading_processes(workers: int, jobs: int) -> int:
    """A pack's processes into an object store: every job at once where they are at most
    `ALL_AT_ONCE` a core (a last wave of one or two shards would leave the link to them),
    else `UPLOADING` a core; `MOST_UPLOADING` at most. Measured with `python -m bench.upload`
    into SeaweedFS behind 50 ms and 20 MB/s a connection, 2 cores (2026-12-03, medians): 1
    GB in 42 shards, 47 / 73 / 92 / 73 MB/s with 1 / 2 / 4 / 8 processes a core (8 cost the
    uploader 9-13 CPU s, 4 cost 5-6: 16 processes on 2 cores, 64 parts at once, contend
    with one another and with the server); 201 MB in 9 shards, 41 / 56 / 59 / 64 MB/s (all
    nine at once with 8)."""
    every = jobs if jobs <= workers * ALL_AT_ONCE else workers * UPLOADING
    return max(1, min(workers, jobs), min(every, MOST_UPLOADING))  # never fewer than a local pack's


def _run_local(
    fn: Callable[[Any], R],
    jobs: Sequence[Any],
    on_done: Callable[[R], None],
    on_progress: Callable[[int], None],
    *,
    workers: int,
    uploading: bool = False,
) -> None:
    """Run `fn` over jobs on a pool of `workers` processes (`uploading`: of
    `uploading_processes`; inline for one), handing results to `on_done` in job order as
    they complete, with at most 2 x processes jobs in flight (their results can be large);
    report images done so far. Cores that no job keeps busy (fewer jobs than workers, or the
    last jobs of a run) are lent to the jobs running (`threads`)."""
    counter = multiprocessing.Value("q", 0)
    processes = max(1, min(uploading_processes(workers, len(jobs)) if uploading else workers, len(jobs)))
    if processes == 1:
        init_worker(counter, workers=workers)
        try:
            for job in jobs:
                on_done(fn(job))
                on_progress(counter.value)
        finally:
            init_worker(None)
        return
    stop, load = multiprocessing.RawValue("b", 0), multiprocessing.Array("i", [0, len(jobs)])
    with ProcessPoolExecutor(
        max_workers=processes, initializer=_init_pool_worker, initargs=(counter, stop, workers, processes, load)
    ) as pool:
        queued = iter(jobs)
        running: deque[Future[R]] = deque()
        try:
            while True:
                while len(running) < 2 * processes and (job := next(queued, None)) is not None:
                    with _sigint_held():
                        running.append(pool.submit(_as_running, fn, job))
                if not running:
                    return
                wait(running, timeout=0.2, return_when=FIRST_EXCEPTION)
                for fut in running:
                    error = fut.exception() if fut.done() else None
                    if error is not None:
                        raise error
                while running and running[0].done():
                    on_done(running.popleft().result())
                on_progress(counter.value)
        except BaseException:  # the jobs in flight end at their next sample; the rest never start
            stop.value = 1
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def ray(address: str | None = None, sizes: Callable[[Any], int] = lambda job: 1) -> Runner[Any, Any]:
    """Ray tasks on the cluster at `address` (None: start or join a local one). Results come
    back in job order; progress counts the images of finished jobs (`sizes(job)`)."""

    def run(
        fn: Callable[[Any], R], jobs: Sequence[Any], on_done: Callable[[R], None], on_progress: Callable[[int], None]
    ) -> None:
        try:
            import ray as ray_module
        except ImportError:
            from ..errors import ShardkitError

            raise ShardkitError("the Ray executor needs Ray (pip install ray)") from None
        if not ray_module.is_initialized():
            ray_module.init(address=address, include_dashboard=False, log_to_driver=False)
        task: Any = ray_module.remote(_apply)  # `fn` may be a partial, which ray.remote refuses
        slots = max(2, 2 * int(ray_module.cluster_resources().get("CPU", 1)))  # type: ignore[no-untyped-call]  # ray's own hints lack it
        queued = iter(jobs)
        running: deque[tuple[Any, Any]] = deque()
        done = 0
        try:
            while True:
                while len(running) < slots and (job := next(queued, None)) is not None:
                    running.append((job, task.remote(fn, job)))
                if not running:
                    return
                job, ref = running.popleft()
                on_done(ray_module.get(ref))  # in order; later jobs keep running meanwhile
                done += sizes(job)
                on_progress(done)
        except BaseException:
            for _, ref in running:
                ray_module.cancel(ref)
            raise

    return run
