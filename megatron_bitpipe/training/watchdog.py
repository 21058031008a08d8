"""Ending a multi-rank job whose rank hung or died, with one line that says what happened.

A :class:`Watchdog` runs beside the training loop on every rank of a job of more than one
rank (a daemon thread that looks at the main thread's Python stack every
:attr:`Watchdog.poll_s` seconds; nothing in the step is instrumented). The main thread is
*waiting* when its innermost Python frame is inside ``torch.distributed`` (a collective or a
p2p call) or on a line that calls ``.wait(`` (a request's wait, a C call that leaves no frame
of its own) or waits for the device (``.item(``, ``synchronize(``...: with NCCL the
communication is queued on the GPU and the host blocks where it next needs a result), and
*stalled* while that frame and its position do not change.

Two things raise the alarm on a rank:

* its main thread has stood at the same place for ``timeout_s`` (``--distributed-timeout-minutes``),
  waiting or not: a rank stalled outside any communication is hung itself, and with NCCL a
  waiting host may block anywhere its next kernel launch or host copy has to wait for the
  device, at a line that names no wait;
* a communication raised in its main thread (gloo reports a peer that has exited at once;
  :meth:`Watchdog.failed`), unless the job's output reader has gone (``| head``), which the
  scripts end quietly.

The alarm goes through the job's key-value store (the default process group's, alive as long
as the job's launcher is): the rank posts where it is, and every other rank's watchdog posts
its own state within one poll. The first rank to raise it (the store's counter decides)
collects the answers for two polls and a second, prints **one line** on stderr — which ranks
did not answer (exited, or frozen with the interpreter lock held), which answered outside any
communication (hung: stalled where it is), and where each waiting rank waited and since
when — hands it to torchrun's error file, and exits with :data:`FAULT_EXIT_STATUS`; every other
rank exits with the same status once the line is out (so a job ends even without a launcher
that stops the rest). A hang thus ends the job ``timeout_s`` plus at most two polls and a
second after the last rank started waiting; a crash that gloo reports, about two polls after it.
Until an alarm, each rank looks at the store once per poll.

The process group's own timeout (:func:`process_group_timeout`) is a little longer than
``timeout_s``, so that the watchdog, not a backend's timeout error, reports.

torchrun stops the other ranks with SIGTERM as soon as one exits, often before they have met
the closed connection and reported. So while it runs, a watchdog whose rank has no SIGTERM
handler of its own (``--exit-signal-handler`` with SIGTERM installs one) takes SIGTERM as a
notice: the rank goes on for at most :data:`TERM_GRACE_S` seconds, time for its communication
error and the one line, and then ends as SIGTERM would (status ``128 + 15``).
"""

from __future__ import annotations

import json
import linecache
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from types import FrameType
from typing import Dict, NoReturn, Optional

from ..usage import hand_to_torchrun

__all__ = ["FAULT_EXIT_STATUS", "RankState", "Watchdog", "describe_stack", "fault_line", "process_group_timeout"]

#: exit status of every rank of a job the watchdog ended
FAULT_EXIT_STATUS = 3
#: the longest poll (seconds); shorter timeouts poll ten times per timeout
MAX_POLL_S = 1.0
#: seconds a rank given SIGTERM by its launcher has left to report (see the module docstring)
TERM_GRACE_S = 5.0
#: store keys' prefix
_PREFIX = "bitpipe-watchdog"


def process_group_timeout(timeout_s: float) -> timedelta:
    """The process group's timeout for a watchdog timeout of ``timeout_s`` seconds: later than
    the watchdog's report (two polls and a second) by a margin, so that it is only a backstop."""
    return timedelta(seconds=timeout_s + 3 * min(MAX_POLL_S, timeout_s / 10) + 10.0)


@dataclass
class RankState:
    """Where one rank was when the alarm went (posted to the store as JSON).

    Attributes:
        rank: global rank.
        iteration: the iteration it was running (from 1; 0 before the first).
        phase: what the loop was doing (``training step``, ``evaluation``, ``checkpoint save``...).
        waiting: whether its main thread was in a communication.
        where: the operation and its place, e.g. ``all_reduce in reduce_losses (megatron_bitpipe/training/mode.py:114)``.
        stalled_s: seconds its main thread had been at that place.
        error: the communication error that raised the alarm on this rank, if one did.
    """

    rank: int
    iteration: int
    phase: str
    waiting: bool
    where: str
    stalled_s: float
    error: Optional[str] = None


#: calls that wait for other ranks without a Python frame of their own: a request's wait, and
#: the host waiting for the device (with NCCL the communication is queued on the GPU, and the
#: host blocks where it next needs a result: a copy to the host, a synchronisation)
_WAITING_CALLS = (".wait(", ".item(", ".tolist(", ".cpu(", "synchronize(")


def _short_path(path: str) -> str:
    """``path`` from the package it belongs to (``megatron_bitpipe/...``, ``megatron/...``, ``torch/...``)."""
    parts = path.replace(os.sep, "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("megatron_bitpipe", "megatron", "torch", "scripts", "tests"):
            return "/".join(parts[i:])
    return os.path.basename(path)


def _place(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({_short_path(frame.f_code.co_filename)}:{frame.f_lineno})"


def _in_torch_distributed(frame: FrameType) -> bool:
    return "/torch/distributed/" in frame.f_code.co_filename.replace(os.sep, "/")


def describe_stack(frame: Optional[FrameType]) -> tuple:
    """``(waiting, where)`` of a thread whose innermost Python frame is ``frame``: in a
    ``torch.distributed`` call (its innermost ``torch.distributed`` function, and the first
    frame outside torch that called it) or on a line with one of :data:`_WAITING_CALLS`;
    else not waiting, at that frame."""
    if frame is None:
        return False, "no Python frame"
    if _in_torch_distributed(frame):
        op = frame
        caller = frame
        while caller is not None and "/torch/" in caller.f_code.co_filename.replace(os.sep, "/"):
            if _in_torch_distributed(caller) and "distributed_c10d" in caller.f_code.co_filename:
                op = caller
            caller = caller.f_back
        name = op.f_code.co_name
        return True, f"torch.distributed {name} called from {_place(caller)}" if caller is not None else name
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    if any(call in line for call in _WAITING_CALLS):
        return True, f"`{line}` in {_place(frame)}"
    return False, _place(frame)


def fault_line(states: Dict[int, RankState], world_size: int, timeout_s: float) -> str:
    """The one line of an alarm from the ``states`` that answered out of ``world_size`` ranks."""
    missing = [r for r in range(world_size) if r not in states]
    waiting = [s for s in states.values() if s.waiting]
    elsewhere = [s for s in states.values() if not s.waiting]
    iteration = max((s.iteration for s in states.values()), default=0)
    parts = []
    if missing:
        ranks = ", ".join(map(str, missing))
        parts.append(f"rank{'s' if len(missing) > 1 else ''} {ranks} did not answer (exited, or frozen holding the interpreter lock)")
    for s in elsewhere:
        parts.append(f"rank {s.rank} hung at iteration {s.iteration} ({s.phase}): {s.stalled_s:.1f} s outside any communication, in {s.where}")
    if not (missing or elsewhere):
        parts.append("every rank waits in a communication (a deadlock: they wait in different operations or groups)")
    waits = []
    for s in sorted(waiting, key=lambda s: s.rank):
        why = f" ({s.error})" if s.error else f" for {s.stalled_s:.1f} s"
        waits.append(f"rank {s.rank} at iteration {s.iteration} ({s.phase}) waited in {s.where}{why}")
    head = f"watchdog: job ended at iteration {iteration}: "
    tail = f"; --distributed-timeout-minutes {timeout_s / 60:g} ({timeout_s:g} s)"
    return head + "; ".join(parts) + ("; " + "; ".join(waits) if waits else "") + tail


class Watchdog:
    """The watchdog of this rank (see the module docstring); a context manager that runs its
    thread. ``store``: the job's key-value store; ``run``: a name that tells this run's keys
    from an earlier run's in the same store."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, run: str = "0"):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.poll_s = min(MAX_POLL_S, timeout_s / 10)
        self.prefix = f"{_PREFIX}/{run}"
        #: the iteration and phase the loop is in (set by the main thread with :meth:`at`)
        self.iteration, self.phase = 0, "set-up"
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bitpipe-watchdog", daemon=True)
        self._last = None
        self._since = time.monotonic()
        self._answered = False
        self._previous_sigterm = None

    @classmethod
    def for_job(cls, rank: int, world_size: int, timeout_s: float) -> Optional["Watchdog"]:
        """The watchdog of this rank of the default process group's job (None for one rank).
        Collective in the sense that every rank must call it once per run (it counts runs in the store)."""
        if world_size < 2:
            return None
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        run = (store.add(f"{_PREFIX}/starts", 1) - 1) // world_size
        return cls(store, rank, world_size, timeout_s, run=str(run))

    def __enter__(self) -> "Watchdog":
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s + 1)
        if self._previous_sigterm is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        """The launcher's SIGTERM: end :data:`TERM_GRACE_S` seconds from now, reporting first if
        this rank's communication fails meanwhile (a peer has exited)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one notice is enough
        timer = threading.Timer(TERM_GRACE_S, os._exit, args=(128 + signal.SIGTERM,))
        timer.daemon = True
        timer.start()

    def at(self, iteration: int, phase: str) -> None:
        """The loop is now in ``phase`` of ``iteration`` (main thread)."""
        self.iteration, self.phase = iteration, phase

    # -- the thread -------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                state = self._state()
                if self._key_set("alarm"):  # one look at the store per poll until an alarm
                    self._answer(state)
                    if self._key_set("done"):
                        os._exit(FAULT_EXIT_STATUS)
                elif state.stalled_s >= self.timeout_s:
                    self._alarm(state)
            except Exception:  # noqa: BLE001 - the store is gone: the launcher is ending the job
                return

    def _state(self, error: Optional[str] = None, where: Optional[str] = None) -> RankState:
        frame = sys._current_frames().get(self._main)
        key = None if frame is None else (id(frame), frame.f_lasti, frame.f_lineno)
        now = time.monotonic()
        if key != self._last:
            self._last, self._since = key, now
        waiting, place = describe_stack(frame)
        if where is not None:
            waiting, place = True, where
        return RankState(self.rank, self.iteration, self.phase, waiting, place, now - self._since, error)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _key_set(self, name: str) -> bool:
        return self.store.check([self._key(name)])

    def _answer(self, state: RankState) -> None:
        if not self._answered:
            self._answered = True
            self.store.set(self._key(f"state/{self.rank}"), json.dumps(asdict(state)))

    def _alarm(self, state: RankState) -> NoReturn:
        """Post this rank's state and raise the alarm; report if first, else wait for the line."""
        self._answer(state)
        self.store.set(self._key("alarm"), "1")
        if self.store.add(self._key("reporter"), 1) == 1:
            self._report()
        deadline = time.monotonic() + 4 * self.poll_s + 5.0
        while time.monotonic() < deadline and not self._key_set("done"):
            time.sleep(self.poll_s)
        os._exit(FAULT_EXIT_STATUS)

    def _report(self) -> None:
        keys = {r: self._key(f"state/{r}") for r in range(self.world_size)}
        deadline = time.monotonic() + 2 * self.poll_s + 1.0
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(self.poll_s / 4)
        states = {}
        for r, key in keys.items():
            if self.store.check([key]):
                states[r] = RankState(**json.loads(self.store.get(key)))
        line = fault_line(states, self.world_size, self.timeout_s)
        print(line, file=sys.stderr, flush=True)
        hand_to_torchrun(line)
        self.store.set(self._key("done"), "1")

    # -- a communication error in the main thread ---------------------------------------------

    def failed(self, error: BaseException) -> None:
        """Called by the main thread with an exception out of the training loop: a
        communication error (raised inside ``torch.distributed`` or by a request's wait) raises
        the alarm and never returns; anything else returns (the caller re-raises it)."""
        frame = _innermost(error.__traceback__)
        waiting, where = describe_stack(frame)
        if not (isinstance(error, RuntimeError) and waiting):
            return
        self._stop.set()  # the thread must not post a second state
        message = _short_error(error)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun stops the others once a rank exits: report first
        try:
            self._alarm(self._state(error=message, where=where))
        except Exception:  # noqa: BLE001 - the store is gone: the launcher is ending the job
            print(f"[rank {self.rank}] at iteration {self.iteration} ({self.phase}): {where}: {message}", file=sys.stderr, flush=True)
            os._exit(FAULT_EXIT_STATUS)


def _short_error(error: BaseException) -> str:
    """The first sentence of ``error``'s message, without a backend's source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(error).split()))
    return text.split(". ")[0][:200]


def _innermost(tb) -> Optional[FrameType]:
    frame = None
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    return frame
