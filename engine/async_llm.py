"""The engine stepping in its own thread, for a server (vLLM's AsyncLLM): requests enter and leave between steps.

    llm = LLM("micro")
    engine = AsyncLLM(llm)              # starts the engine thread
    stream = engine.submit(prompt_ids, SamplingParams(max_tokens=8), on_output)  # from any thread
    stream.cancel("disconnect")         # its client went away: cancelled between two steps
    engine.shutdown(drain=True)         # finish what is running (or cancel it), then the tracer's footer

The engine is not thread-safe and is never touched outside its thread: `submit` and `cancel` only put a
message in the inbox, which the engine thread takes between two steps (`LLMEngine.add_request`, `abort`), in
the order they came. After every step it hands each request its new output tokens, and a finish, through the
request's `on_output(Output)`, called in the engine thread (a server passes them on to its event loop). The
tracer, if any, is called in the engine thread only, as in `LLM.generate`.

A request is checked (`LLMEngine.check_request`) in the caller's thread before it is queued, so a server can
refuse it at once; a request cancelled before the engine thread took it in still enters the engine and is
cancelled at once, so that the trace holds every request the server accepted and every cancellation.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from engine.sequence import SamplingParams


@dataclass(slots=True)
class Output:
    """What a request produced in one step: its new output tokens, and its finish reason once it finished
    ("stop", "length", or "abort" for a cancelled one)."""
    token_ids: list[int]
    finish_reason: str | None = None


class Stream:
    """One submitted request, as its caller holds it: `seq_id` once the engine took it in (None before),
    `cancel(cause)`."""

    def __init__(self, engine: "AsyncLLM", prompt_token_ids: list[int], params: SamplingParams,
                 on_output: Callable[[Output], None], arrival_ns: int):
        self.engine, self.prompt_token_ids, self.params = engine, prompt_token_ids, params
        self.on_output, self.arrival_ns = on_output, arrival_ns
        self.seq_id: int | None = None
        self.sent = 0               # output tokens handed to on_output so far (engine thread)
        self.finished = False       # its finish was handed on (engine thread)

    def cancel(self, cause: str = "abort") -> None:
        """Cancel it between two steps (`LLMEngine.abort`), if it has not finished: `cause` "abort", "disconnect"
        or "shutdown"."""
        self.engine._put(("cancel", self, cause))


class AsyncLLM:
    """An `engine.LLM`'s engine stepped by one thread of its own. `error` is set if a step raised (every
    request then finishes with reason "abort" and the thread stops)."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine
        self.inbox: list[tuple] = []
        self.wake = threading.Condition()
        self.streams: dict[int, Stream] = {}     # seq_id -> its stream, while unfinished (engine thread)
        self.stopping: str | None = None         # None, "drain" or "cancel"
        self.accepting = True
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="mdi-engine", daemon=True)
        self.thread.start()

    # ---- any thread ---------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_output: Callable[[Output], None],
               arrival_ns: int | None = None) -> Stream:
        """Queue a request (checked here: ValueError in one sentence if it cannot run, or if the engine is
        shutting down); `on_output` gets its outputs, in the engine thread."""
        params = self.engine.check_request(prompt_token_ids, params)
        stream = Stream(self, list(prompt_token_ids), params, on_output,
                        time.perf_counter_ns() if arrival_ns is None else arrival_ns)
        with self.wake:
            if not self.accepting or self.error is not None:
                raise ValueError("the engine is shutting down and takes no new requests.")
            self.inbox.append(("add", stream))
            self.wake.notify()
        return stream

    def _put(self, message: tuple) -> None:
        with self.wake:
            self.inbox.append(message)
            self.wake.notify()

    def stop_accepting(self) -> None:
        """Take no new request (a shutdown's "drain": those in the engine go on)."""
        with self.wake:
            self.accepting = False

    def cancel_all(self, cause: str = "shutdown") -> None:
        """Stop taking requests and cancel every one in the engine or queued (a shutdown's "cancel")."""
        with self.wake:
            self.accepting = False
            self.inbox.append(("cancel_all", cause))
            self.wake.notify()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; let those in the engine finish (`drain`) or cancel them (cause "shutdown");
        then the engine thread shuts the engine down (the step in flight, the device worker, the tracer's
        footer) and ends. Waits for it (`timeout` seconds at most)."""
        with self.wake:
            self.accepting = False
            self.stopping = "drain" if drain else "cancel"
            self.wake.notify()
        self.thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        engine, cancelled = self.engine, False
        try:
            while True:
                with self.wake:
                    while not self.inbox and self.stopping is None and not engine.has_unfinished():
                        self.wake.wait()
                    inbox, self.inbox, stopping = self.inbox, [], self.stopping
                self._take(inbox)
                if stopping == "cancel" and not cancelled:
                    self._cancel_every("shutdown")
                    cancelled = True
                if engine.has_unfinished():
                    self._deliver(engine.step())
                elif stopping is not None:
                    break
        except Exception as e:  # a step that raised: kept for the server to report; no request waits for ever
            self.error = e
            for stream in list(self.streams.values()):
                self._finish(stream, "abort")
        with self.wake:
            self.accepting = False
            leftover, self.inbox = self.inbox, []
        for message in leftover:  # requests queued while the engine stopped: never started
            if message[0] == "add":
                self._hand(message[1], Output([], "abort"))
        try:
            engine.shutdown()
        except Exception as e:
            self.error = self.error or e

    def _take(self, inbox: list[tuple]) -> None:
        """The inbox's messages, in order: requests added, cancellations."""
        for message in inbox:
            if message[0] == "add":
                stream = message[1]
                stream.seq_id = self.engine.add_request(stream.prompt_token_ids, stream.params, stream.arrival_ns)
                self.streams[stream.seq_id] = stream
            elif message[0] == "cancel":
                _, stream, cause = message
                if not stream.finished and stream.seq_id in self.streams:
                    self.engine.abort(stream.seq_id, cause)
            else:
                self._cancel_every(message[1])

    def _cancel_every(self, cause: str) -> None:
        for seq_id in self.streams:
            self.engine.abort(seq_id, cause)

    def _deliver(self, finished: list) -> None:
        """Each request's new output tokens; a finish for those that finished in this step."""
        done = {seq.seq_id: seq for seq in finished}
        seqs = self.engine.scheduler.seqs
        for seq_id, stream in list(self.streams.items()):
            seq = done.get(seq_id) or seqs.get(seq_id)
            if seq is None:
                continue
            new = seq.token_ids[seq.num_prompt_tokens + stream.sent:]
            if new or seq_id in done:
                stream.sent += len(new)
                if seq_id in done:
                    self._finish(stream, seq.finish_reason, new)
                elif not self._hand(stream, Output(new)):
                    self.engine.abort(seq_id, "disconnect")  # nobody takes its tokens any more

    def _finish(self, stream: Stream, reason: str, new: list[int] | None = None) -> None:
        stream.finished = True
        del self.streams[stream.seq_id]
        self._hand(stream, Output(new or [], reason))

    @staticmethod
    def _hand(stream: Stream, out: Output) -> bool:
        """`on_output(out)`; False if it raised (its receiver is gone: a server's closed event loop), which
        never stops the engine."""
        try:
            stream.on_output(out)
            return True
        except Exception:
            return False
