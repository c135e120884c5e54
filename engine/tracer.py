"""The tracer protocol the engine calls at every state transition (ARCHITECTURE.md §5).

engine/ never imports tracing/: it defines this narrow interface and a null object that costs nothing;
the recorder in tracing/ implements it (`LLM("tiny-68m", tracer=Recorder("run.mdt"))`). Each call sits
at the exact line where its transition happens, one line each. Times are time.perf_counter_ns() values.
`MemoryTracer` keeps the calls in a list, for tests.
"""
from __future__ import annotations


class NullTracer:
    """Every hook of the protocol, doing nothing."""
    enabled = False

    def start(self, header): pass                              # engine, model, checkpoint, device, versions
    def request_added(self, seq_id, prompt_token_ids, params, seed, arrival_ns=None): pass  # arrival: at the door
    def schedule(self, batch): pass                           # a ScheduledBatch: the step's explicit input
    def reservation(self, step, seq_id, epoch, output_position): pass  # num_inflight += 1
    def epoch_bump(self, seq_id, epoch, reason): pass          # reason: "preempt" or "cancel"
    def block_alloc(self, seq_id, block_ids): pass
    def block_free(self, seq_id, block_ids): pass
    def slot_alloc(self, seq_id, state_slot): pass
    def slot_free(self, seq_id, state_slot): pass
    def preempt(self, step, seq_id): pass
    def cancel(self, step, seq_id, cause="abort"): pass       # cause: "abort", "disconnect" or "shutdown"
    def token(self, step, seq_id, epoch, position, token_id, appended): pass  # appended=False: stale
    def finish(self, step, seq_id, reason): pass
    def cpu_span(self, step, phase, start_ns, end_ns): pass   # phase: "schedule", "execute", "process"
    def device_span(self, step, start_ns, end_ns): pass
    def step_digest(self, step, digest): pass                  # of block tables, state slots and epochs
    def step_end(self, step): pass                             # the engine's step() returns: flush
    def close(self): pass                                      # the engine shuts down: footer


class MemoryTracer(NullTracer):
    """Records every call as (hook name, *arguments)."""
    enabled = True

    def __init__(self):
        self.events: list[tuple] = []

    def kinds(self, *names: str) -> list[tuple]:
        return [e for e in self.events if e[0] in names]


def _recording(name: str):
    def hook(self, *args):
        self.events.append((name, *args))
    hook.__name__ = name
    return hook


for _name in [n for n in vars(NullTracer) if not n.startswith("_") and n != "enabled"]:
    setattr(MemoryTracer, _name, _recording(_name))
