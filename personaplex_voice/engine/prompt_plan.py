"""The system prompt as generator steps, planned without the model.

A persona's prompt is: the voice (a `.pt` replays stored input embeddings then restores its token
cache; an audio voice forces its Mimi codes), 0.5 s of silence, one step per token of
`<system> … <system>`, 0.5 s of silence. Every stream of every step is forced, so the token ring
after the prompt, and the input column of every model run, are known before the model runs:
`PromptPlanner.plan` simulates them on a batch-1 CPU ring. The prefill (`engine/prefill.py`)
then only runs the transformer over those inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from personaplex_voice.engine.base import EngineError, PersonaError
from personaplex_voice.engine.prompts import PAD_ID
from personaplex_voice.engine.tokens import RingSlot, TokenRing
from personaplex_voice.model.config import ModelConfig

# Forced codes of the system prompt (published values for the 8-codebook Mimi).
SILENCE_TOKENS = [948, 243, 1178, 546, 1736, 1030, 1978, 2008]
SINE_TOKENS = [430, 1268, 381, 1611, 1095, 1495, 56, 472]
SILENCE_SECONDS = 0.5


@dataclass
class PromptPlan:
    """A persona's system prompt as generator steps, and the token ring after it.

    `step_values` [S, K]: the tokens forced at each step; `replay` [M, dim]: stored voice
    embeddings fed (instead of the embedded input column) to the first M model runs;
    `run_tokens` [R, K]: the input column of every other model run; `after_replay`: the token
    cache a `.pt` voice restores after its replay; `final`: the ring after the whole prompt.
    """

    step_values: torch.Tensor
    replay: torch.Tensor | None
    after_replay: torch.Tensor | None
    run_tokens: torch.Tensor
    final: RingSlot

    @property
    def steps(self) -> int:
        return int(self.step_values.shape[0])

    @property
    def model_runs(self) -> int:
        return self.final.offset - 1

    @property
    def replay_steps(self) -> int:
        return 0 if self.replay is None else int(self.replay.shape[0])


class PromptPlanner:
    """Plans prompts for one model configuration (thread-safe: every plan uses its own ring)."""

    def __init__(self, cfg: ModelConfig):
        lm = cfg.lm
        self.n_audio = cfg.mimi.num_codebooks
        if len(SILENCE_TOKENS) != self.n_audio:
            raise ValueError("the system prompt's forced codes are defined for 8 Mimi codebooks")
        self.card = lm.card
        self.delays = list(lm.delays)
        self.K = lm.num_streams
        self.dep_q = lm.dep_q
        self.dim = lm.dim
        self.initial = [lm.text_card] + [lm.card] * lm.n_q
        self.silence_steps = int(SILENCE_SECONDS * cfg.frame_rate)

    @property
    def ring_positions(self) -> int:
        return max(self.delays) + 3

    def new_ring(self) -> TokenRing:
        return TokenRing(1, self.delays, self.initial, self.dep_q, torch.device("cpu"))

    def values(self, voice_codes: torch.Tensor | None, n_replay: int, text_tokens: list[int]) -> torch.Tensor:
        """The forced tokens of every prompt step [S, K]."""
        rows: list[list[int]] = []
        if n_replay:
            # A stored voice replays embeddings; the steps force placeholder tokens (as published).
            rows += [[PAD_ID] + [self.card] * (2 * self.n_audio)] * (n_replay + 1)
        if voice_codes is not None:
            rows += [[PAD_ID, *c, *SINE_TOKENS] for c in voice_codes.tolist()]
        silence = [[PAD_ID, *SILENCE_TOKENS, *SINE_TOKENS]] * self.silence_steps
        rows += silence + [[t, *SILENCE_TOKENS, *SINE_TOKENS] for t in text_tokens] + silence
        return torch.tensor(rows, dtype=torch.long)

    def plan(
        self,
        voice_codes: torch.Tensor | None,
        replay: torch.Tensor | None,
        cache_after: torch.Tensor | None,
        text_tokens: list[int],
    ) -> PromptPlan:
        """Simulate the prompt on a batch-1 token ring (no model): forced tokens only."""
        n_replay = 0 if replay is None else int(replay.shape[0])
        values = self.values(voice_codes, n_replay, text_tokens)
        ring = self.new_ring()
        run_tokens = []
        for i, row in enumerate(values):
            column = self._forced_step(ring, row)
            if column is None:
                continue
            if i > n_replay:
                run_tokens.append(column)
            if n_replay and i == n_replay:
                assert cache_after is not None
                ring.cache[0] = cache_after[0]
        return PromptPlan(
            step_values=values,
            replay=replay,
            after_replay=None if cache_after is None else cache_after[0].clone(),
            run_tokens=torch.stack(run_tokens) if run_tokens else torch.zeros(0, self.K, dtype=torch.long),
            final=ring.read(0),
        )

    def voice_prompt(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For `voices make`: the input columns [N, K] of the voice-prompt steps of Mimi `codes`
        [frames, n_audio] and the token cache [1, K, C] after them (what a `.pt` voice stores)."""
        values = self.values(codes, 0, [])[: codes.shape[0]]
        ring = self.new_ring()
        columns = [c for c in (self._forced_step(ring, row) for row in values) if c is not None]
        if not columns:
            raise PersonaError("voice prompt audio is too short (needs at least two 80 ms frames)")
        return torch.stack(columns), ring.cache[0:1].clone()

    def _forced_step(self, ring: TokenRing, row: torch.Tensor) -> torch.Tensor | None:
        """One fully forced step on a batch-1 ring; the model's input column [K], or None for a
        slot's first step (no model run)."""
        ring.write_given(row[None], torch.ones(1, self.K, dtype=torch.bool), None)
        if int(ring.offset[0]) == 0:
            ring.first_step(0)
            return None
        inp, target, provided = ring.model_io()
        if not bool(provided.all()):
            raise EngineError("internal: a system prompt step left a stream unforced")
        ring.commit(target[:, 0], target[:, 1 : self.dep_q + 1], provided, None)
        return inp[0]
