"""The six views of `mdi-trace view` (ARCHITECTURE.md §7), one module each, over the same base: Overview,
Timeline, Steps, Requests, Resources, Events."""
