"""Timing and overlap plumbing of D3D decoding: the clock of one assisted-generation loop's rounds, and the worker that
runs a packed pass off the critical path (a side CUDA stream joined with an event, or a CPU worker thread with its own
torch thread count, which the library provides: `d3d_hf.experiments.cpu_worker`).

Part of the self-contained remote-code bundle: imports only the Python standard library and torch. The candidate
generator (`generation_d3d.py`) keeps the counters and the decoding policy; everything here only times and runs.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import torch


class RoundClock:
    """Times the rounds of transformers' assisted-generation loop: a round's *draft* span is its `get_candidates`
    call, its *verify* span runs from the end of that call to the round's `update_candidate_strategy` (the target
    forward plus transformers' acceptance bookkeeping; round 1 includes the prefills).

    The one clock of a round: `D3DCandidateGenerator` keeps one (its lists are `D3DGenerationStats.draft_seconds`
    and `verify_seconds`), and the benchmark harness reads it, or wraps another candidate generator in one.

    Attributes:
        draft_seconds (`list[float]`): seconds of each round's draft span.
        verify_seconds (`list[float]`): seconds of each round's verify span.
    """

    def __init__(self, draft_seconds: list[float] | None = None, verify_seconds: list[float] | None = None) -> None:
        self.draft_seconds = [] if draft_seconds is None else draft_seconds
        self.verify_seconds = [] if verify_seconds is None else verify_seconds
        self._draft_start: float | None = None
        self._draft_end: float | None = None

    def start_draft(self) -> None:
        """Marks the start of a round's `get_candidates`."""
        self._draft_start = time.perf_counter()

    def end_draft(self) -> float:
        """Marks its end; records and returns the draft span in seconds."""
        self._draft_end = time.perf_counter()
        seconds = self._draft_end - (self._draft_start if self._draft_start is not None else self._draft_end)
        self.draft_seconds.append(seconds)
        return seconds

    def end_verify(self) -> float | None:
        """Marks the round's `update_candidate_strategy`; records and returns the verify span in seconds (`None` when
        no draft span ended before it)."""
        if self._draft_end is None:
            return None
        seconds = time.perf_counter() - self._draft_end
        self.verify_seconds.append(seconds)
        return seconds


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`(fn(), seconds it took)` (wall clock; on CUDA the launch time unless `fn` synchronises)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def default_worker_threads() -> int:
    """The default `d3d_worker_threads`: half of the calling thread's `torch.get_num_threads()`, at least 1."""
    return max(1, torch.get_num_threads() // 2)


class PackedPassWorker:
    """Runs one packed pass at a time off the critical path and joins it.

    On CUDA the pass is enqueued on a side stream that first waits for the current stream, and joined with an event
    (the current stream waits for it; tensors made on the side stream are recorded on the current one). On CPU it
    runs on a worker thread with `worker_threads` torch intra-op threads (`cpu_worker(worker_threads)`, an
    experiment of the library: `d3d_hf.experiments.cpu_worker`).

    Args:
        device (`torch.device`): the drafter's device.
        worker_threads (`int`): torch intra-op threads of the CPU worker (ignored on CUDA).
        cpu_worker (`Callable[[int], concurrent.futures.Executor]`, *optional*): the CPU worker for a thread count
            (required off CUDA).
    """

    def __init__(self, device: torch.device, worker_threads: int, cpu_worker: Callable | None = None) -> None:
        self.device = device
        self.worker_threads = worker_threads
        self.cpu_worker = cpu_worker
        self._stream = None
        self._handle: Any = None

    @property
    def pending(self) -> bool:
        """Whether a launched pass has not been joined or cancelled yet."""
        return self._handle is not None

    @property
    def on_cpu_worker(self) -> bool:
        return self.device.type != "cuda"

    def launch(self, packed_pass: Callable[[], Any]) -> float | None:
        """Starts `packed_pass()`; returns the seconds it took to enqueue on CUDA, `None` on CPU (the pass's own time
        is returned by `join`)."""
        if self.device.type == "cuda":
            start = time.perf_counter()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                result = packed_pass()
            event = torch.cuda.Event()
            event.record(self._stream)
            self._handle = (result, event)
            return time.perf_counter() - start

        def timed_pass():
            begin = time.perf_counter()
            result = packed_pass()
            return result, time.perf_counter() - begin

        self._handle = self.cpu_worker(self.worker_threads).submit(timed_pass)
        return None

    def join(self, tensors_of: Callable[[Any], list[torch.Tensor]]) -> tuple[Any, float | None, float | None]:
        """Waits for the pending pass; returns `(result, pass_seconds, wait_seconds)`: on CPU the pass's time on the
        worker and how long this call waited for it, on CUDA `(result, None, None)` once the current stream waits for
        the pass (`tensors_of(result)` lists the tensors made on the side stream, recorded on the current one)."""
        handle, self._handle = self._handle, None
        if isinstance(handle, concurrent.futures.Future):
            start = time.perf_counter()
            result, seconds = handle.result()
            return result, seconds, time.perf_counter() - start
        result, event = handle
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in tensors_of(result):
            tensor.record_stream(current)  # allocated on the side stream, used and freed on this one
        return result, None, None

    def discard(self) -> None:
        """Cancels the pending pass, or waits for it when it already runs (nothing keeps running after the call)."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if isinstance(handle, concurrent.futures.Future):
            if not handle.cancel():
                handle.result()
        else:
            handle[1].synchronize()


__all__ = ["PackedPassWorker", "RoundClock", "default_worker_threads", "timed"]
