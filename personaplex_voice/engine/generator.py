"""PersonaPlexEngine: the real speech-to-speech engine (Mimi + PersonaPlex LM), batched by slot.

One `step` is one 80 ms tick for every slot at once: Mimi-encode the user frames, force the user
codes into the token ring, run the temporal transformer on the ring's input column, sample the
text token and the depth transformer's audio tokens, read the output row (one step behind) and
Mimi-decode the agent codebooks. Inactive slots are computed (static shapes) but their state is
never touched (exec mask).

`start` / `begin_start` run a persona's system prompt into a slot (planned by
`engine/prompt_plan.py`, run chunk by chunk by `engine/prefill.py`): by default
(`prefill="parallel"`) as transformer forwards over many prompt positions at once;
`prefill="stepwise"` replays it step by step through the same code path as `step`, the
published behaviour (bit for bit the published bfloat16 run too). Greedy float32 outputs equal
the published implementation token for token either way. `warmup()` runs all of it once before
the first caller. Voices are made by `engine/voice_maker.py`.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field, replace
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
    Sampling,
    SlotError,
    SlotPrefill,
    StepOutput,
    VoiceInfo,
)
from personaplex_voice.engine.gpu_tuning import GpuTuning
from personaplex_voice.engine.graphs import CaptureInfo, CUDAGraphed, GraphBackend, GraphCaptureError
from personaplex_voice.engine.prefill import ParallelPrefill, StepwisePrefill
from personaplex_voice.engine.prompt_plan import PromptPlan, PromptPlanner
from personaplex_voice.engine.prompts import TextTokenizer, wrap_system_prompt
from personaplex_voice.engine.sampling import SlotSampler
from personaplex_voice.engine.tokens import RingSlot, TokenRing
from personaplex_voice.engine.voice_maker import encode_audio, make_voice
from personaplex_voice.engine.voices import VoiceLibrary, load_voice_audio, load_voice_pt
from personaplex_voice.errors import UserError
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.loaders import LoadStats, default_lm_dtype, load_models
from personaplex_voice.model.mimi import Mimi
from personaplex_voice.model.streaming import StepContext, StreamState, reset_slot, state_nbytes

if TYPE_CHECKING:
    from personaplex_voice.model.sources import ModelFiles

log = logging.getLogger(__name__)

DEFAULT_VOICE = "NATF2.pt"
PREFILL_MODES = ("parallel", "stepwise")
AUDIO_VOICE_CACHE = 32  # encoded audio voices kept
COMPACT_MAX_SLOT_BYTES = 64 * 2**20
# Prompt positions per prefill chunk (`begin_start`): the scheduler runs whole chunks between
# ticks while the next tick is not due, so a long prompt never holds up the running calls.
PREFILL_CHUNK = 64
PREFILL_CHUNK_STEPS = 4  # stepwise prefill: generator steps per chunk
# What `warmup` runs: a prompt of a few chunks, then ticks with one caller (sampling, then greedy).
WARMUP_PROMPT = (
    "You are a friendly assistant on a phone line. Greet the caller, listen, and answer their "
    "questions briefly and clearly. This prompt only warms the engine up before the first call."
)
WARMUP_TICKS = 3


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

    Options: `prefill` "parallel" (default) or "stepwise"; `quantize` "int8" keeps the LM's linear
    weights as int8 rows (`model/quant.py`); `kv_dtype` the LM's KV-cache dtype (default: the LM
    dtype; `torch.float8_e4m3fn` halves it); `keep_prompt` pins the system prompt's KV entries
    past the context (opt-in, see docs/engine.md); `capture_logits` keeps the last step's text and
    depformer logits in `last_text_logits` / `last_audio_logits` (tests); `cuda_graphs` replays
    the batched step as a CUDA graph (None = on CUDA, unless `compile`); `compile` wraps the LM
    step with torch.compile; `models` = (mimi, lm) reuses loaded modules instead of loading;
    `prefill_chunk` / `prefill_chunk_steps`: the size of one `begin_start` chunk (the last chunk
    of a parallel prefill is padded to it, so its shape never changes); `graph_backend`: what
    captures the graph (tests inject fakes; with one given, `cuda_graphs` runs on any device);
    `attention`: the SDPA backends on a GPU, "auto" (measured and pinned at warm-up), "default"
    (torch's choice) or a backend name; `kv_read`: the tick's attention by the length-aware
    kernel where it runs ("auto") or always SDPA over the whole ring ("convert"); `fused`: the
    fused kernels (norms, silu-gating, RoPE, the two attentions) where they check out ("auto")
    or never ("off"). See docs/engine.md.
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
        quantize: str | None = None,
        kv_dtype: torch.dtype | None = None,
        keep_prompt: bool = False,
        capture_logits: bool = False,
        cuda_graphs: bool | None = None,
        compile: bool = False,
        models: tuple[Mimi, LMModel] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_chunk_steps: int = PREFILL_CHUNK_STEPS,
        graph_backend: GraphBackend | None = None,
        attention: str = "auto",
        kv_read: str = "auto",
        fused: str = "auto",
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
        self.prefill = prefill
        self.prefill_chunk = prefill_chunk
        self.prefill_chunk_steps = prefill_chunk_steps
        self.keep_prompt = keep_prompt
        self.capture_logits = capture_logits
        self.tuning = GpuTuning(attention=attention, kv_read=kv_read, fused=fused)
        if self.cfg.frame_size != FRAME_SIZE or self.cfg.sample_rate != SAMPLE_RATE:
            raise ValueError("the engine runs 24 kHz audio in 80 ms frames")

        self.load_stats: LoadStats | None = None
        # --cpu-offload: the plan and streamer it loaded with (engine/offload.py), set by the factory
        self.offload: Any = None
        if models is not None:  # share already loaded modules (several engines, benchmarks)
            self.mimi, self.lm = models
        else:
            dtype = dtype or default_lm_dtype(self.device)
            self.mimi, self.lm, self.load_stats = load_models(files, self.device, dtype, quantize=quantize)
        self.dtype = self.lm.dtype
        # Shared models may carry another engine's kernels and pins: this one starts from the
        # references; warmup() checks and turns on what runs here.
        GpuTuning.reset(self.lm, self.mimi)
        self.tokenizer = TextTokenizer(files.tokenizer)
        self.voice_library = VoiceLibrary(list(files.voice_dirs), source=files.voice_source)
        self.planner = PromptPlanner(self.cfg)

        lm_cfg = self.cfg.lm
        self.n_audio = self.cfg.mimi.num_codebooks
        self.K = lm_cfg.num_streams
        self.dep_q = lm_cfg.dep_q
        self.lm.set_kv_dtype(kv_dtype)
        self.lm_state: StreamState = self.lm.init_state(num_slots, self.device)
        self.mimi_state: StreamState = self.mimi.init_state(num_slots)
        self._mimi_fresh: StreamState = self.mimi.init_state(1)
        self.ring = TokenRing(num_slots, list(lm_cfg.delays), self.planner.initial, self.dep_q, self.device)
        self.sampler = SlotSampler(
            num_slots, self.lm.text_linear.out_features, lm_cfg.card, self.dep_q, self.device
        )
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
        if compile:
            self._lm_forward = torch.compile(self.lm.forward_embeddings, dynamic=False)
        else:
            self._lm_forward = self.lm.forward_embeddings
        self._graphs: dict[bool, CUDAGraphed] = {}  # by `wide` (see use_static_tick)
        self._graph_backend = graph_backend
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and not compile
        self.cuda_graphs = bool(cuda_graphs)
        if cuda_graphs:
            if self.device.type != "cuda" and graph_backend is None:
                raise UserError("cuda_graphs needs a CUDA device")
            self.use_static_tick(cuda_graph=True)
        # The GPU stream voices are encoded on (`prepare`, another thread): never the tick's.
        self._voice_stream: Any = None
        self.last_prefill_chunk_ms: list[float] = []  # of the last prompt run (benchmarks)

    def use_static_tick(self, cuda_graph: bool) -> None:
        """Run every tick from static buffers with the sampling math always on (what a CUDA
        graph needs); `cuda_graph=False` runs that path eagerly (CPU tests).

        Two variants of the tick, each its own graph sharing one memory pool: candidate widths
        capped (`sampling.STATIC_TEXT_WIDTH` / `STATIC_AUDIO_WIDTH`: no sort of the whole
        vocabularies), and the full vocabularies, replayed only on ticks where an active slot
        asks for a top-k above the caps."""
        self.sampler.static = True
        B, device = self.num_slots, self.device

        def idle() -> tuple[torch.Tensor, torch.Tensor]:  # no slot active: the capture changes nothing
            return torch.zeros(B, FRAME_SIZE, device=device), torch.zeros(B, dtype=torch.bool, device=device)

        def tick(wide: bool) -> Any:
            def run(pcm: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                self.sampler.use_static_widths(wide)
                return self._step_tensors(self._full, pcm, active, True)

            return run

        narrow = CUDAGraphed(tick(False), idle_args=idle, enabled=cuda_graph, backend=self._graph_backend)
        wide = CUDAGraphed(
            tick(True), idle_args=idle, enabled=cuda_graph, backend=self._graph_backend, pool_of=narrow
        )
        self._graphs = {False: narrow, True: wide}

    @property
    def fallbacks(self) -> list[dict[str, str]]:
        """Every fallback the warm-up took, with its reason (a kernel that failed its check, an
        attention pin dropped for the capture, `_int_mm` not usable): what a report must show."""
        return list(self.tuning.fallbacks)

    @property
    def graph_info(self) -> dict[str, Any]:
        """Whether the tick runs as a captured CUDA graph, and what the capture took (the capped
        widths' graph; `wide_*`: the full vocabularies' one)."""
        if not self._graphs or not self._graphs[False].enabled:
            none = CaptureInfo().as_dict()
            return {"mode": "eager", **none, **{f"wide_{k}": v for k, v in none.items()}}
        wide = {f"wide_{k}": v for k, v in self._graphs[True].info.as_dict().items()}
        return {"mode": "cuda_graph", **self._graphs[False].info.as_dict(), **wide}

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
                expected = (self.K, self.planner.ring_positions)
                if replay.shape[-1] != self.cfg.lm.dim or tuple(cache_after.shape[1:]) != expected:
                    raise PersonaError(f"voice {voice!r} was made for another model")
                # the model reads these ids: -1 (the published zero token) up to each stream's
                # initial token (model/embedding_tables.py: a lookup trusts them)
                cards = torch.tensor([self.cfg.lm.text_card] + [self.cfg.lm.card] * (self.K - 1))
                if (cache_after < -1).any() or (cache_after[0] > cards[:, None]).any():
                    raise PersonaError(f"voice {voice!r} holds token ids outside the model's vocabularies")
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
        plan = self.planner.plan(voice_codes, replay, cache_after, text_tokens)
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

    def encode_audio(self, pcm: np.ndarray) -> torch.Tensor:
        """Streaming Mimi codes [frames, num_codebooks] of 24 kHz audio (last frame zero-padded).

        Runs from `prepare`'s thread: on a GPU on a stream of its own (torch's streams do not
        wait for the default one), so the ticks never queue behind a voice's kernels.
        """
        if self.device.type != "cuda":
            return encode_audio(self.mimi, pcm)
        if self._voice_stream is None:
            self._voice_stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(self._voice_stream):
            return encode_audio(self.mimi, pcm)  # ends with a copy to the host: synchronised

    def make_voice(self, audio_24k: np.ndarray, normalized: bool = False) -> dict[str, torch.Tensor]:
        """The published `.pt` voice of an audio prompt (see `voice_maker.make_voice`)."""
        return make_voice(self.mimi, self.lm, self.planner, audio_24k, normalized)

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
        job: ParallelPrefill | StepwisePrefill
        if self.prefill == "parallel":

            def run_positions(inputs: torch.Tensor, real: int) -> None:
                ctx = StepContext({k: v[slot : slot + 1] for k, v in self.lm_state.items()})
                self.lm.transformer(inputs[None], ctx, real=real)

            def finish_parallel() -> None:
                self.ring.load(slot, plan.final)
                self._finish_start(slot, prepared)

            # One chunk shape for every prompt (the last chunk padded), at most the ring.
            chunk = min(self.prefill_chunk, self.lm.transformer.context)
            job = ParallelPrefill(
                self._prompt_inputs(plan), run_positions, finish_parallel, chunk, sync=self._sync
            )
        else:
            view = self._slot_view(slot)
            job = StepwisePrefill(
                plan.steps,
                lambda i: self._prompt_step(view, slot, plan, i),
                lambda: self._finish_start(slot, prepared),
                self.prefill_chunk_steps,
                sync=self._sync,
            )
        self.last_prefill_chunk_ms = job.chunk_ms
        return job

    def _sync(self) -> None:
        """Wait for the device (prefill chunks: their measured time is then their real cost)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _slot_view(self, slot: int) -> _Tick:
        """One slot's state as a batch of one (views: writes land in the engine's state)."""
        return _Tick(
            {k: v[slot : slot + 1] for k, v in self.lm_state.items()},
            {k: v[slot : slot + 1] for k, v in self.mimi_state.items()},
            self.ring.view(slot),
            self.sampler.view(slot),
            None,
        )

    def _finish_start(self, slot: int, prepared: PreparedPersona) -> None:
        self.sampler.configure(slot, prepared.persona.sampling, self._seed(prepared.persona))
        self._started[slot] = True

    def _prompt_inputs(self, plan: PromptPlan) -> torch.Tensor | None:
        """The input embeddings of every model run of the prompt [P, dim] (None for none)."""
        parts = []
        if plan.replay is not None:
            parts.append(plan.replay.to(self.device, self.dtype))
        if plan.run_tokens.shape[0]:
            tokens = plan.run_tokens.to(self.device).T[None]  # [1, K, R]
            parts.append(self.lm.embed_codes(tokens)[0])
        return torch.cat(parts) if parts else None

    def _prompt_step(self, view: _Tick, slot: int, plan: PromptPlan, i: int) -> None:
        """Step `i` of the prompt, replayed through the same code path as `step` (stepwise), on
        the slot's own batch-1 view: the other slots cost nothing. Every token is forced, so
        nothing is sampled."""
        row = plan.step_values[i].to(self.device)
        view.ring.write_given(row[None], torch.ones(1, self.K, dtype=torch.bool, device=self.device), None)
        if i == 0:  # the slot was reset by begin_start: its first step only writes tokens
            self.ring.first_step(slot)
            return
        n_replay = plan.replay_steps
        replaying = plan.replay is not None and i <= n_replay
        override = None
        if replaying:
            assert plan.replay is not None
            override = plan.replay[i - 1 : i].to(self.device, self.dtype)
        self._lm_step(view, None, False, override)
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

    # ---------------------------------------------------------------- warm-up

    @torch.no_grad()
    def warmup(self) -> None:
        """Run once everything the first call's prefill and ticks would run (kernel selection,
        allocator growth, CUDA-graph capture), then leave every slot as fresh as before.

        A chunked prefill of a text prompt into slot 0, then ticks with slot 0 the only caller,
        first sampling, then greedy (the two tick paths).
        """
        started = time.perf_counter()
        self.tuning.apply(self.lm, self.lm_state, self.prefill_chunk, self.mimi)  # GPU: what runs
        for graph in self._graphs.values():  # capture first, before any slot runs
            try:
                graph.warm(*self._idle_inputs())
            except GraphCaptureError as exc:
                if not self.tuning.unpin(self.lm):
                    raise _capture_refused(exc) from exc
                # A pinned attention kernel may be what cannot be captured: torch's choice instead.
                log.warning("%s with the pinned attention; trying torch's own choice", exc)
                try:
                    graph.warm(*self._idle_inputs())
                except GraphCaptureError as again:
                    raise _capture_refused(again) from again
        plan = self.planner.plan(None, None, None, self.tokenizer.encode(wrap_system_prompt(WARMUP_PROMPT)))
        persona = Persona(text_prompt=WARMUP_PROMPT, sampling=Sampling(), seed=0)
        prepared = PreparedPersona(
            persona=persona, cache_key=("warmup",), prompt_steps=plan.steps, payload=plan
        )
        slot = 0
        job = self.begin_start(slot, prepared)
        while not job.run_chunk():
            pass
        pcm = np.zeros((self.num_slots, FRAME_SIZE), np.float32)
        pcm[slot] = 0.05 * np.sin(np.arange(FRAME_SIZE) * (2 * np.pi * 220 / SAMPLE_RATE))
        active = np.zeros(self.num_slots, dtype=bool)
        active[slot] = True
        for sampling in (persona.sampling, replace(persona.sampling, greedy=True)):
            self.sampler.configure(slot, sampling, 0)
            for _ in range(WARMUP_TICKS):
                self.step(pcm, active)
        self._reset_slot(slot)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("engine warmed up in %.2f s (%d slots)", time.perf_counter() - started, self.num_slots)
        if self.offload is not None:  # --cpu-offload: does a tick with the plan keep real time?
            self.offload.report_realtime(self)

    def _idle_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        B = self.num_slots
        return (
            torch.zeros(B, FRAME_SIZE, device=self.device),
            torch.zeros(B, dtype=torch.bool, device=self.device),
        )

    # ---------------------------------------------------------------- the tick

    def _lm_step(
        self, tick: _Tick, active: torch.Tensor | None, sampling: bool, override: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Model run on the ring's current column for every slot; returns the output rows.

        No host synchronisation and no data-dependent Python branches: CUDA graphs capture it.
        `sampling` False skips the sampling math (every active slot greedy); `sampler.prepare_tick`
        must have run before (host-side widths and constants; the noise is drawn here).
        """
        inp, target, provided = tick.ring.model_io()
        emb = self.lm.embed_codes(inp[:, :, None])
        if override is not None:  # replayed voice embeddings (a batch-1 prompt step)
            emb = override[:, None].to(emb.dtype)
        hidden, text_logits = self._lm_forward(emb, StepContext(tick.lm_state, active))
        text_logits = text_logits[:, 0].float()
        if sampling:
            tick.sampler.draw()  # this tick's noise, every slot at once
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
        tick.sampler.advance(active)
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
        sampling = self.sampler.prepare_tick(active_np.tolist())
        if self._graphs:
            try:
                out, pcm_out = self._graphs[self.sampler.wide](
                    torch.from_numpy(pcm).to(self.device), torch.from_numpy(active_np).to(self.device)
                )
            except GraphCaptureError as exc:  # no warmup() before: the first tick captured
                raise _capture_refused(exc) from exc
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
            tokens=tokens[:, : 1 + self.n_audio].astype(np.int64, copy=True),
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
            {k: _rows(v, idx) for k, v in full.lm_state.items()},
            {k: _rows(v, idx) for k, v in full.mimi_state.items()},
            full.ring.subset(idx),
            full.sampler.subset(idx),
            None if full.audio_logits is None else full.audio_logits.index_select(0, idx),
        )
        sub_out, sub_pcm = self._step_tensors(
            tick, torch.from_numpy(pcm[rows]).to(self.device), None, sampling
        )
        for key, value in full.lm_state.items():
            _store_rows(value, idx, tick.lm_state[key])
        for key, value in full.mimi_state.items():
            _store_rows(value, idx, tick.mimi_state[key])
        full.ring.store(idx, tick.ring)
        full.sampler.store(idx, tick.sampler)
        if self.capture_logits:
            assert full.audio_logits is not None and tick.audio_logits is not None
            assert self._text_logits_dev is not None
            full.audio_logits.index_copy_(0, idx, tick.audio_logits)
            text_logits = torch.zeros(self.num_slots, self._text_logits_dev.shape[-1], device=self.device)
            self._text_logits_dev = text_logits.index_copy_(0, idx, self._text_logits_dev)
        out = torch.zeros(self.num_slots, sub_out.shape[1], dtype=sub_out.dtype, device=self.device)
        pcm_out = torch.zeros(self.num_slots, FRAME_SIZE, device=self.device)
        return out.index_copy_(0, idx, sub_out), pcm_out.index_copy_(0, idx, sub_pcm)


def _capture_refused(exc: GraphCaptureError) -> UserError:
    """The one line a failed capture gives whoever asked for CUDA graphs."""
    return UserError(
        f"{exc}: refusing to run every tick eagerly (tens of ms of kernel launches per 80 ms "
        "frame); fix the cause, or start with --no-cuda-graphs to run eagerly knowingly"
    )


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors have no index_select / index_copy kernels: move their bytes instead."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _bytes_view(t).index_select(0, index).view(t.dtype)


def _store_rows(t: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    _bytes_view(t).index_copy_(0, index, _bytes_view(rows))


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
