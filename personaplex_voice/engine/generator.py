"""PersonaPlexEngine: the real speech-to-speech engine (Mimi + PersonaPlex LM), batched by slot.

One `step` is one 80 ms tick for every slot at once: Mimi-encode the user frames, force the user
codes into the token ring, run the temporal transformer on the ring's input column, sample the
text token and the depth transformer's audio tokens, read the output row (one step behind) and
Mimi-decode the agent codebooks. Inactive slots are computed (static shapes) but their state is
never touched (exec mask).

`start` runs a persona's system prompt into a slot. Every prompt token is forced, so the
transformer sees a fixed sequence of input embeddings: by default (`prefill="parallel"`) the
whole prompt is one transformer forward over all its positions; `prefill="stepwise"` replays it
step by step through the same code path as `step` (the published behaviour, kept for tests and
benchmarks). Greedy float32 outputs equal the published implementation token for token.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    EngineError,
    Persona,
    PersonaError,
    PreparedPersona,
    SlotError,
    SlotPrefill,
    StepOutput,
    VoiceInfo,
)
from personaplex_voice.engine.prompts import PAD_ID, TextTokenizer, wrap_system_prompt
from personaplex_voice.engine.sampling import SlotSampler
from personaplex_voice.engine.tokens import RingSlot, TokenRing
from personaplex_voice.engine.voices import VoiceLibrary, load_voice_audio, load_voice_pt, normalize_loudness
from personaplex_voice.errors import UserError
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.loaders import default_lm_dtype, load_lm, load_mimi
from personaplex_voice.model.mimi import Mimi
from personaplex_voice.model.streaming import StepContext, StreamState, reset_slot, state_nbytes

if TYPE_CHECKING:
    from personaplex_voice.model.sources import ModelFiles

log = logging.getLogger(__name__)

# Forced codes of the system prompt (published values for the 8-codebook Mimi).
SILENCE_TOKENS = [948, 243, 1178, 546, 1736, 1030, 1978, 2008]
SINE_TOKENS = [430, 1268, 381, 1611, 1095, 1495, 56, 472]
SILENCE_SECONDS = 0.5
DEFAULT_VOICE = "NATF2.pt"
PREFILL_MODES = ("parallel", "stepwise")
AUDIO_VOICE_CACHE = 32  # encoded audio voices kept
COMPACT_MAX_SLOT_BYTES = 64 * 2**20
# Prompt positions per prefill chunk (`begin_start`): the scheduler runs whole chunks between
# ticks while the next tick is not due, so a long prompt never holds up the running calls.
PREFILL_CHUNK = 64
PREFILL_CHUNK_STEPS = 4  # stepwise prefill: generator steps per chunk


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


@dataclass
class _Tick:
    """The state one tick reads and writes: all slots, or a compacted copy of the active ones."""

    lm_state: StreamState
    mimi_state: StreamState
    ring: TokenRing
    sampler: SlotSampler
    audio_logits: torch.Tensor | None


@dataclass
class EngineSnapshot:
    """One slot's state right after its system prompt (persona cache entry)."""

    lm: dict[str, torch.Tensor]
    ring: RingSlot
    used: int  # KV ring entries in use (the prompt's model runs)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        total = sum(t.numel() * t.element_size() for t in self.lm.values())
        total += self.ring.cache.numel() * 8 + self.ring.provided.numel()
        self.nbytes = total


class PersonaPlexEngine:
    """The `Engine` of personaplex_voice.engine.base on the real model.

    Options: `prefill` "parallel" (default) or "stepwise"; `keep_prompt` pins the system prompt's
    KV entries past the context (opt-in, see docs/engine.md); `capture_logits` keeps the last
    step's text and depformer logits in `last_text_logits` / `last_audio_logits` (tests);
    `cuda_graphs` captures the batched step as CUDA graphs (CUDA only); `compile` wraps the LM
    step with torch.compile; `models` = (mimi, lm) reuses loaded modules instead of loading;
    `prefill_chunk` / `prefill_chunk_steps`: the size of one `begin_start` chunk.
    """

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(
        self,
        files: ModelFiles,
        num_slots: int = 1,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        *,
        prefill: str = "parallel",
        keep_prompt: bool = False,
        capture_logits: bool = False,
        cuda_graphs: bool = False,
        compile: bool = False,
        models: tuple[Mimi, LMModel] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_chunk_steps: int = PREFILL_CHUNK_STEPS,
    ):
        if num_slots < 1:
            raise UserError(f"num_slots must be at least 1, got {num_slots}")
        if prefill not in PREFILL_MODES:
            raise UserError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
        self.files = files
        self.name = files.name
        self.cfg = files.config
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype or default_lm_dtype(self.device)
        self.prefill = prefill
        self.prefill_chunk = prefill_chunk
        self.prefill_chunk_steps = prefill_chunk_steps
        self.keep_prompt = keep_prompt
        self.capture_logits = capture_logits
        if self.cfg.frame_size != FRAME_SIZE or self.cfg.sample_rate != SAMPLE_RATE:
            raise ValueError("the engine runs 24 kHz audio in 80 ms frames")

        if models is not None:  # share already loaded modules (several engines, benchmarks)
            self.mimi, self.lm = models
            self.dtype = next(self.lm.parameters()).dtype
        else:
            self.mimi = load_mimi(self.cfg, files.mimi_weights, self.device)
            self.lm = load_lm(self.cfg, files.lm_weights, self.device, self.dtype)
        self.tokenizer = TextTokenizer(files.tokenizer)
        self.voice_library = VoiceLibrary(list(files.voice_dirs), source="model")

        lm_cfg = self.cfg.lm
        self.n_audio = self.cfg.mimi.num_codebooks
        self.K = lm_cfg.num_streams
        self.dep_q = lm_cfg.dep_q
        if len(SILENCE_TOKENS) != self.n_audio:
            raise ValueError("the system prompt's forced codes are defined for 8 Mimi codebooks")
        self.silence_steps = int(SILENCE_SECONDS * self.cfg.frame_rate)
        initial = [lm_cfg.text_card] + [lm_cfg.card] * lm_cfg.n_q

        self.lm_state: StreamState = self.lm.init_state(num_slots)
        self.mimi_state: StreamState = self.mimi.init_state(num_slots)
        self._mimi_fresh: StreamState = self.mimi.init_state(1)
        self.ring = TokenRing(num_slots, list(lm_cfg.delays), initial, self.dep_q, self.device)
        self.sampler = SlotSampler(
            num_slots, self.lm.text_linear.out_features, lm_cfg.card, self.dep_q, self.device
        )
        self._initial_tokens = initial
        self._started = [False] * num_slots
        # Mimi codes of audio voices by (path, mtime, size): encoding one costs ~0.1 s on CPU.
        self._audio_voice_codes: dict[tuple[Any, ...], torch.Tensor] = {}
        self.last_text_logits: np.ndarray | None = None
        self.last_audio_logits: np.ndarray | None = None
        self._text_logits_dev: torch.Tensor | None = None
        self.last_tokens: np.ndarray | None = None  # [B, dep_q + 1] output rows of the last step
        self._audio_logits_buf = (
            torch.zeros(num_slots, self.dep_q, lm_cfg.card, device=self.device) if capture_logits else None
        )
        self._full = _Tick(self.lm_state, self.mimi_state, self.ring, self.sampler, self._audio_logits_buf)
        # CPU eager: a tick with idle slots runs only the active ones (copied out and back), so
        # its cost follows the active calls; not for big per-slot states (the 7B KV cache).
        slot_bytes = state_nbytes(self.lm_state) // num_slots
        self._compact = self.device.type == "cpu" and slot_bytes <= COMPACT_MAX_SLOT_BYTES and not compile
        self._graphs: Any = None
        if compile:
            self._lm_forward = torch.compile(self.lm.forward_embeddings, dynamic=False)
        else:
            self._lm_forward = self.lm.forward_embeddings
        if cuda_graphs:
            if self.device.type != "cuda":
                raise UserError("cuda_graphs needs a CUDA device")
            from personaplex_voice.engine.graphs import GraphedStep

            self._graphs = GraphedStep(self)

    # ---------------------------------------------------------------- personas

    def voices(self) -> list[VoiceInfo]:
        return self.voice_library.list()

    def _default_voice(self) -> str | None:
        names = [v.name for v in self.voice_library.list()]
        if DEFAULT_VOICE in names:
            return DEFAULT_VOICE
        return names[0] if names else None

    def prepare(self, persona: Persona) -> PreparedPersona:
        """Validate the persona and plan its system prompt (voice loaded and Mimi-encoded)."""
        voice = persona.voice if persona.voice is not None else self._default_voice()
        voice_key: tuple[Any, ...] = (None,)
        replay = cache_after = None
        voice_codes: torch.Tensor | None = None
        if voice is not None:
            path = self.voice_library.resolve(voice)
            stat = path.stat()
            voice_key = (str(path), stat.st_mtime_ns, stat.st_size)
            if path.suffix.lower() == ".pt":
                replay, cache_after = load_voice_pt(path)
                if replay.shape[-1] != self.cfg.lm.dim or tuple(cache_after.shape[1:]) != (
                    self.K,
                    self.ring.C,
                ):
                    raise PersonaError(f"voice {voice!r} was made for another model")
                replay = replay.reshape(replay.shape[0], -1)
            else:
                voice_codes = self._audio_voice_codes.get(voice_key)
                if voice_codes is None:
                    voice_codes = self.encode_audio(load_voice_audio(path))
                    while len(self._audio_voice_codes) >= AUDIO_VOICE_CACHE:
                        self._audio_voice_codes.pop(next(iter(self._audio_voice_codes)))
                    self._audio_voice_codes[voice_key] = voice_codes
        text = wrap_system_prompt(persona.text_prompt)
        text_tokens = self.tokenizer.encode(text) if text else []
        plan = self._plan(voice_codes, replay, cache_after, text_tokens)
        if plan.model_runs >= self.cfg.lm.context:
            raise PersonaError(
                f"system prompt too long: {plan.steps} steps, the model's context is {self.cfg.lm.context}"
            )
        return PreparedPersona(
            persona=persona,
            cache_key=(self.name, voice_key, persona.text_prompt),
            prompt_steps=plan.steps,
            payload=plan,
        )

    @torch.no_grad()
    def encode_audio(self, pcm: np.ndarray) -> torch.Tensor:
        """Streaming Mimi codes [frames, num_codebooks] of 24 kHz audio (last frame zero-padded)."""
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        frames = max(1, -(-pcm.size // FRAME_SIZE))
        padded = np.zeros(frames * FRAME_SIZE, dtype=np.float32)
        padded[: pcm.size] = pcm
        ctx = StepContext(self.mimi.init_state(1))
        x = torch.from_numpy(padded).to(self.device).view(frames, 1, FRAME_SIZE)
        codes = [self.mimi.encode(x[i : i + 1], ctx)[0, :, 0] for i in range(frames)]
        return torch.stack(codes).cpu()

    def _prompt_values(
        self, voice_codes: torch.Tensor | None, n_replay: int, text_tokens: list[int]
    ) -> torch.Tensor:
        card = self.cfg.lm.card
        rows: list[list[int]] = []
        if n_replay:
            # A stored voice replays embeddings; the steps force placeholder tokens (as published).
            rows += [[PAD_ID] + [card] * (2 * self.n_audio)] * (n_replay + 1)
        if voice_codes is not None:
            rows += [[PAD_ID, *c, *SINE_TOKENS] for c in voice_codes.tolist()]
        silence = [[PAD_ID, *SILENCE_TOKENS, *SINE_TOKENS]] * self.silence_steps
        rows += silence + [[t, *SILENCE_TOKENS, *SINE_TOKENS] for t in text_tokens] + silence
        return torch.tensor(rows, dtype=torch.long)

    def _plan(
        self,
        voice_codes: torch.Tensor | None,
        replay: torch.Tensor | None,
        cache_after: torch.Tensor | None,
        text_tokens: list[int],
    ) -> PromptPlan:
        """Simulate the prompt on a batch-1 token ring (no model): forced tokens only."""
        n_replay = 0 if replay is None else int(replay.shape[0])
        values = self._prompt_values(voice_codes, n_replay, text_tokens)
        ring = self._new_plan_ring()  # per call: prepare() may run in worker threads
        given = torch.ones(1, self.K, dtype=torch.bool)
        run_tokens = []
        for i, row in enumerate(values):
            ring.write_given(row[None], given, None)
            if int(ring.offset[0]) == 0:
                ring.first_step(0)
                continue
            inp, target, provided = ring.model_io()
            if not bool(provided.all()):
                raise EngineError("internal: a system prompt step left a stream unforced")
            if i > n_replay:
                run_tokens.append(inp[0])
            ring.commit(target[:, 0], target[:, 1 : self.dep_q + 1], provided, None)
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

    def _new_plan_ring(self) -> TokenRing:
        return TokenRing(1, list(self.cfg.lm.delays), self._initial_tokens, self.dep_q, torch.device("cpu"))

    # ---------------------------------------------------------------- slots

    def _reset_slot(self, slot: int) -> None:
        self.lm.reset_slot(self.lm_state, slot)
        reset_slot(self.mimi_state, self._mimi_fresh, slot)
        self.ring.reset(slot)
        self.sampler.release(slot)
        self._started[slot] = False

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise EngineError(f"slot {slot} out of range (0..{self.num_slots - 1})")

    def _seed(self, persona: Persona) -> int:
        return persona.seed if persona.seed is not None else secrets.randbelow(2**63)

    def start(self, slot: int, prepared: PreparedPersona) -> None:
        prefill = self.begin_start(slot, prepared)
        while not prefill.run_chunk():
            pass

    @torch.no_grad()
    def begin_start(self, slot: int, prepared: PreparedPersona) -> SlotPrefill:
        self._check_slot(slot)
        plan: PromptPlan = prepared.payload
        self._reset_slot(slot)
        if self.keep_prompt:
            self.lm_state["transformer:pin"][slot] = plan.model_runs
        if self.prefill == "parallel":
            return _ParallelPrefill(self, slot, prepared)
        return _StepwisePrefill(self, slot, prepared)

    def _finish_start(self, slot: int, prepared: PreparedPersona) -> None:
        self.sampler.configure(slot, prepared.persona.sampling, self._seed(prepared.persona))
        self._started[slot] = True

    def _slot_ctx(self, slot: int) -> StepContext:
        return StepContext({k: v[slot : slot + 1] for k, v in self.lm_state.items()})

    def _prompt_inputs(self, plan: PromptPlan) -> torch.Tensor | None:
        """The input embeddings of every model run of the prompt [P, dim] (None for none)."""
        parts = []
        if plan.replay is not None:
            parts.append(plan.replay.to(self.device, self.dtype))
        if plan.run_tokens.shape[0]:
            tokens = plan.run_tokens.to(self.device).T[None]  # [1, K, R]
            parts.append(self.lm.embed_codes(tokens)[0])
        return torch.cat(parts) if parts else None

    def _prompt_step(self, slot: int, plan: PromptPlan, i: int) -> None:
        """Step `i` of the prompt, replayed through the same code path as `step` (stepwise)."""
        B = self.num_slots
        active = torch.zeros(B, dtype=torch.bool, device=self.device)
        active[slot] = True
        given = active[:, None].expand(B, self.K)
        row = plan.step_values[i].to(self.device)
        self.ring.write_given(row[None].expand(B, self.K), given, active)
        if int(self.ring.offset[slot]) == 0:
            self.ring.first_step(slot)
            return
        n_replay = 0 if plan.replay is None else plan.replay.shape[0]
        replaying = plan.replay is not None and i <= n_replay
        override = None
        if replaying:
            assert plan.replay is not None
            override = torch.zeros(B, self.cfg.lm.dim, device=self.device, dtype=self.dtype)
            override[slot] = plan.replay[i - 1].to(self.device, self.dtype)
        sampling = self.sampler.draw_noise([b == slot for b in range(B)])
        self._lm_step(self._full, active, sampling, override)
        if replaying and i == n_replay:
            assert plan.after_replay is not None
            self.ring.cache[slot] = plan.after_replay.to(self.device)

    def snapshot(self, slot: int) -> EngineSnapshot:
        self._check_slot(slot)
        used = int(self.lm_state["transformer:pos"][slot])
        lm = {}
        for key, value in self.lm_state.items():
            row = value[slot]
            if key.endswith((":k", ":v")):
                row = row[:, :used]
            lm[key] = row.clone()
        return EngineSnapshot(lm=lm, ring=self.ring.read(slot), used=used)

    @torch.no_grad()
    def restore(self, slot: int, snapshot: EngineSnapshot, prepared: PreparedPersona) -> None:
        self._check_slot(slot)
        self._reset_slot(slot)
        for key, value in self.lm_state.items():
            saved = snapshot.lm[key]
            if key.endswith((":k", ":v")):
                value[slot, :, : snapshot.used] = saved
            else:
                value[slot] = saved
        self.ring.load(slot, snapshot.ring)
        self._finish_start(slot, prepared)

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        self.sampler.release(slot)
        self._started[slot] = False

    # ---------------------------------------------------------------- the tick

    def _lm_step(
        self, tick: _Tick, active: torch.Tensor | None, sampling: bool, override: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Model run on the ring's current column for every slot; returns the output rows.

        No host synchronisation and no data-dependent Python branches: CUDA graphs capture it.
        `sampling` False skips the sampling math (every active slot greedy); the noise of sampling
        slots must have been drawn (`sampler.draw_noise`) before.
        """
        inp, target, provided = tick.ring.model_io()
        emb = self.lm.embed_codes(inp[:, :, None])
        if override is not None and active is not None:
            emb = torch.where(active[:, None, None], override[:, None].to(emb.dtype), emb)
        hidden, text_logits = self._lm_forward(emb, StepContext(tick.lm_state, active))
        text_logits = text_logits[:, 0].float()
        text = tick.sampler.text(text_logits, sampling)
        next_text = torch.where(provided[:, 0], target[:, 0], text)
        dq = self.dep_q
        audio = self.lm.depformer_tokens(
            hidden[:, 0],
            next_text,
            target[:, 1 : dq + 1],
            provided[:, 1 : dq + 1],
            lambda logits, cb: tick.sampler.audio(logits, cb, sampling),
            tick.audio_logits,
        )
        if self.capture_logits:
            self._text_logits_dev = text_logits
        return tick.ring.commit(text, audio, provided, active)

    def _publish_logits(self) -> None:
        if self.capture_logits:
            assert self._audio_logits_buf is not None and self._text_logits_dev is not None
            self.last_text_logits = self._text_logits_dev.cpu().numpy().copy()
            self.last_audio_logits = self._audio_logits_buf.cpu().numpy().copy()

    @torch.no_grad()
    def step(self, pcm: np.ndarray, active: np.ndarray) -> StepOutput:
        active_np = np.asarray(active, dtype=bool).reshape(self.num_slots)
        B = self.num_slots
        unstarted = [int(slot) for slot in np.flatnonzero(active_np) if not self._started[slot]]
        if unstarted:  # checked before any state changes: the scheduler steps the others again
            raise SlotError(f"slot(s) {unstarted} active but never started", unstarted)
        if not active_np.any():
            return StepOutput(pcm=np.zeros((B, FRAME_SIZE), np.float32), text=[None] * B)
        pcm = np.ascontiguousarray(pcm, dtype=np.float32).reshape(B, FRAME_SIZE)
        if not np.isfinite(pcm).all():  # a bad client must not poison its slot's state with NaN
            pcm = np.nan_to_num(pcm, nan=0.0, posinf=1.0, neginf=-1.0)
        sampling = self.sampler.draw_noise(active_np.tolist())
        if self._graphs is not None:
            out, pcm_out = self._graphs.run(pcm, active_np)
        elif self._compact and not active_np.all():
            out, pcm_out = self._step_compacted(pcm, np.flatnonzero(active_np), sampling)
        else:
            out, pcm_out = self._step_tensors(
                self._full,
                torch.from_numpy(pcm).to(self.device),
                None if active_np.all() else torch.from_numpy(active_np).to(self.device),
                sampling,
            )
        self._publish_logits()
        tokens = out.cpu().numpy()
        self.last_tokens = tokens
        text = [self.tokenizer.display_piece(int(tokens[b, 0])) if active_np[b] else None for b in range(B)]
        return StepOutput(
            pcm=pcm_out.cpu().numpy().astype(np.float32, copy=False),
            text=text,
            text_tokens=tokens[:, 0].copy(),
            audio_tokens=tokens[:, 1 : 1 + self.n_audio].copy(),
        )

    def _step_tensors(
        self, tick: _Tick, pcm: torch.Tensor, active: torch.Tensor | None, sampling: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batched tick on device tensors: pcm [B, FRAME] -> (output rows [B, dq+1], pcm [B, FRAME])."""
        B = pcm.shape[0]
        mimi_ctx = StepContext(tick.mimi_state, active)
        codes = self.mimi.encode(pcm[:, None], mimi_ctx)[:, :, 0]
        values = torch.zeros(B, self.K, dtype=torch.long, device=self.device)
        values[:, 1 + self.n_audio :] = codes
        given = torch.zeros(B, self.K, dtype=torch.bool, device=self.device)
        given[:, 1 + self.n_audio :] = True
        tick.ring.write_given(values, given, active)
        out = self._lm_step(tick, active, sampling)
        pcm_out = self.mimi.decode(out[:, 1 : 1 + self.n_audio, None], mimi_ctx)
        return out, pcm_out[:, 0]

    def _step_compacted(
        self, pcm: np.ndarray, rows: np.ndarray, sampling: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tick on a copy of the active slots' state, written back afterwards (CPU)."""
        idx = torch.from_numpy(rows).to(self.device)
        full = self._full
        tick = _Tick(
            {k: v.index_select(0, idx) for k, v in full.lm_state.items()},
            {k: v.index_select(0, idx) for k, v in full.mimi_state.items()},
            full.ring.subset(idx),
            full.sampler.subset(idx),
            None if full.audio_logits is None else full.audio_logits.index_select(0, idx),
        )
        sub_out, sub_pcm = self._step_tensors(
            tick, torch.from_numpy(pcm[rows]).to(self.device), None, sampling
        )
        for key, value in full.lm_state.items():
            value.index_copy_(0, idx, tick.lm_state[key])
        for key, value in full.mimi_state.items():
            value.index_copy_(0, idx, tick.mimi_state[key])
        full.ring.store(idx, tick.ring)
        if self.capture_logits:
            assert full.audio_logits is not None and tick.audio_logits is not None
            assert self._text_logits_dev is not None
            full.audio_logits.index_copy_(0, idx, tick.audio_logits)
            text_logits = torch.zeros(self.num_slots, self._text_logits_dev.shape[-1], device=self.device)
            self._text_logits_dev = text_logits.index_copy_(0, idx, self._text_logits_dev)
        out = torch.zeros(self.num_slots, sub_out.shape[1], dtype=sub_out.dtype, device=self.device)
        pcm_out = torch.zeros(self.num_slots, FRAME_SIZE, device=self.device)
        return out.index_copy_(0, idx, sub_out), pcm_out.index_copy_(0, idx, sub_pcm)

    # ---------------------------------------------------------------- voices

    @torch.no_grad()
    def make_voice(self, audio_24k: np.ndarray, normalized: bool = False) -> dict[str, torch.Tensor]:
        """The published `.pt` voice of an audio prompt: {"embeddings" [N, 1, 1, dim], "cache" [1, K, C]}.

        `audio_24k` is mono 24 kHz; it is normalised to -24 LUFS here unless `normalized` says the
        caller already did (e.g. with `voices.load_voice_audio`).
        """
        pcm = np.asarray(audio_24k, dtype=np.float32).reshape(-1)
        if not normalized:
            pcm = normalize_loudness(pcm)
        codes = self.encode_audio(pcm)
        values = self._prompt_values(codes, 0, [])[: codes.shape[0]]
        ring = self._new_plan_ring()  # per call: prepare() may run in worker threads
        given = torch.ones(1, self.K, dtype=torch.bool)
        inputs = []
        for row in values:
            ring.write_given(row[None], given, None)
            if int(ring.offset[0]) == 0:
                ring.first_step(0)
                continue
            inp, target, provided = ring.model_io()
            inputs.append(inp[0])
            ring.commit(target[:, 0], target[:, 1 : self.dep_q + 1], provided, None)
        if not inputs:
            raise PersonaError("voice prompt audio is too short (needs at least two 80 ms frames)")
        tokens = torch.stack(inputs).T[None].to(self.device)  # [1, K, N]
        emb = self.lm.embed_codes(tokens)[0].float().cpu()  # [N, dim]
        return {"embeddings": emb[:, None, None, :].contiguous(), "cache": ring.cache[0:1].clone()}


def golden_like_files(root: Path, name: str | None = None) -> Any:
    """A ModelFiles for a model directory with the golden layout (used by tests and benches)."""
    from personaplex_voice.model.config import ModelConfig
    from personaplex_voice.model.sources import ModelFiles

    cfg = ModelConfig.from_json(root / "config.json")
    return ModelFiles(
        name=name or str(root),
        config=cfg,
        lm_weights=root / "model.safetensors",
        mimi_weights=root / "mimi.safetensors",
        tokenizer=root / cfg.text_tokenizer,
        voice_dirs=(root / "voices",),
        lm_dtype_in_file=cfg.lm_dtype_in_file,
    )


class _ParallelPrefill:
    """The prompt as transformer forwards over `prefill_chunk` positions at a time."""

    def __init__(self, engine: PersonaPlexEngine, slot: int, prepared: PreparedPersona):
        self._engine, self._slot, self._prepared = engine, slot, prepared
        self._plan: PromptPlan = prepared.payload
        with torch.no_grad():
            self._inputs = engine._prompt_inputs(self._plan)
        self._done = 0  # positions run
        self._total = 0 if self._inputs is None else int(self._inputs.shape[0])
        self._chunk = max(1, engine.prefill_chunk)

    @property
    def remaining(self) -> int:
        return -(-(self._total - self._done) // self._chunk) if self._inputs is not None else 0

    @torch.no_grad()
    def run_chunk(self) -> bool:
        engine = self._engine
        if self._inputs is not None and self._done < self._total:
            end = min(self._total, self._done + self._chunk)
            engine.lm.transformer(self._inputs[None, self._done : end], engine._slot_ctx(self._slot))
            self._done = end
            if end < self._total:
                return False
        self._inputs = None
        engine.ring.load(self._slot, self._plan.final)
        engine._finish_start(self._slot, self._prepared)
        return True


class _StepwisePrefill:
    """The prompt replayed step by step (the published behaviour), `prefill_chunk_steps` a time."""

    def __init__(self, engine: PersonaPlexEngine, slot: int, prepared: PreparedPersona):
        self._engine, self._slot, self._prepared = engine, slot, prepared
        self._plan: PromptPlan = prepared.payload
        self._next = 0
        self._chunk = max(1, engine.prefill_chunk_steps)

    @property
    def remaining(self) -> int:
        return -(-(self._plan.steps - self._next) // self._chunk)

    @torch.no_grad()
    def run_chunk(self) -> bool:
        end = min(self._plan.steps, self._next + self._chunk)
        for i in range(self._next, end):
            self._engine._prompt_step(self._slot, self._plan, i)
        self._next = end
        if end < self._plan.steps:
            return False
        self._engine._finish_start(self._slot, self._prepared)
        return True
