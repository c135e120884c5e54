"""mdi-trace's data layer: the event schema, the recorder, the reader. Imports neither torch nor engine/,
so opening a trace never pays for a model library."""
from tracing.recorder import Recorder

__all__ = ["Recorder"]
