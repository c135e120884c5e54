"""A request's state (mirrors DeepInfer's csrc/engine/sequence.hpp): `Sequence` (same id) and `SamplingParams`.

As nano-vllm's engine/sequence.py. A sequence has two
lengths: `len(token_ids)`, the tokens the CPU knows, and `get_len()`, which adds the tokens already
scheduled but not yet returned by the device (`num_inflight`, the reservations of ZOS).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from model.config import BLOCK_SIZE, cdiv


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0   # 0 is greedy
    seed: int | None = None    # None: derived from the engine seed and the request id
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def check(self) -> "SamplingParams":
        if self.temperature < 0 or self.max_tokens < 1:
            raise ValueError("SamplingParams needs temperature >= 0 and max_tokens >= 1.")
        return self


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params, self.seed = params, seed
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens = 0  # positions whose KV and state the device has (or will have, in FIFO order)
        self.num_inflight = 0       # scheduled tokens whose result is not processed yet (reservations)
        self.epoch = 0              # bumped by preemption and cancellation: older results are stale
        self.block_table: list[int] = []
        self.state_slot: int | None = None
        self.finish_reason: str | None = None  # "stop", "length" or "abort"

    def __len__(self) -> int:
        return len(self.token_ids)

    def get_len(self) -> int:
        return len(self.token_ids) + self.num_inflight

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def blocks_needed(self, num_positions: int) -> int:
        """KV blocks to cover positions [0, num_positions): block j holds positions [128j, 128j+128)."""
        need = cdiv(num_positions, BLOCK_SIZE) - len(self.block_table)
        return need if need > 0 else 0  # not max(): this runs twice per row and step
