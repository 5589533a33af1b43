"""Server settings: one object, filled from CLI flags, `PERSONAPLEX_*` environment variables or code.

Precedence (pydantic-settings): values passed to the constructor (the CLI passes only the flags a
user actually gave) > environment variables > the defaults below.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from personaplex_voice.engine.arrivals import ArrivalConfig
from personaplex_voice.engine.headroom import HeadroomConfig
from personaplex_voice.process.http_guard import HttpLimits


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PERSONAPLEX_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8998, ge=0, le=65535)
    # `demo` (tiny random model), a Hugging Face repo id, or a local model dir (layout of golden/).
    model: str = "nvidia/personaplex-7b-v1"
    # `auto` picks cuda when available; resolved by the engine factory (never imports torch for echo).
    device: str = "auto"
    # `model` runs PersonaPlex; `echo` runs the LoopbackEngine (no torch) for wiring and load tests.
    engine: Literal["model", "echo"] = "model"
    max_sessions: int = Field(4, ge=1, le=256, description="batch slots = concurrent conversations")
    max_queue: int = Field(0, ge=0, le=10_000, description="callers allowed to wait for a slot")
    ssl: Path | None = Field(None, description="directory holding cert.pem and key.pem")
    voice_dir: Path | None = Field(
        None, description="directory of voice prompts (.pt or audio) used instead of the model's"
    )
    # Per-file replacements of the model's own files (as in `offline` and `voices`).
    moshi_weight: Path | None = None
    mimi_weight: Path | None = None
    tokenizer: Path | None = None
    # `auto` = float32 on CPU, bfloat16 on CUDA; or float32, bfloat16, float16.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # How system prompts are run: `parallel` (fast) or `stepwise` (bit for bit the published run).
    prefill: Literal["parallel", "stepwise"] = "parallel"
    # `int8`: the LM's linear weights as int8 rows (for GPUs where bfloat16 weights do not fit).
    quantize: Literal["none", "int8"] = "none"
    # The LM's KV cache dtype; `auto` = the LM dtype; `float8` halves the memory per call.
    kv_dtype: Literal["auto", "bfloat16", "float16", "float32", "float8"] = "auto"
    # On a GPU every tick is one captured CUDA graph; a failed capture refuses readiness.
    # False (`--no-cuda-graphs`) runs the ticks eagerly, knowingly.
    cuda_graphs: bool = True
    # As the published server's flag: on a GPU, plan its free memory (int8, fp8 KV, then layers
    # streamed from host memory; engine/offload.py); on the CPU it changes nothing.
    cpu_offload: bool = False
    # torch intra-op threads; 0 = auto (1 for tiny models, torch's default otherwise). Set it on a
    # shared CPU so the server does not take every core from its neighbours.
    threads: int = Field(0, ge=0, le=1024)
    # Session limits: a call ends after this long, or after this long without audio (0 = never).
    max_call_s: float = Field(3600.0, ge=0)
    idle_timeout_s: float = Field(60.0, ge=0)
    # Input a session keeps from its start beyond real time and catches up instead of trimming
    # (docs/sessions.md); None = the default (5 s), 0 = trim it like late input.
    start_burst_s: float | None = Field(None, ge=0)
    # Persona cache: slot snapshots after the system prompt, so a repeated persona skips the
    # prefill. 0 disables it.
    persona_cache_mb: float = Field(1024.0, ge=0)
    # gc.freeze and a 1 ms GIL switch interval once the engine is loaded (process/runtime.py).
    tune_runtime: bool = True
    api_key: SecretStr | None = None
    # Comma-separated list of allowed browser origins; empty or "*" allows every origin.
    allowed_origins: str = "*"
    twilio: bool = False  # the same as "twilio" in `carriers`
    # Phone carriers to mount (personaplex_phone): "twilio,telnyx,plivo,vonage,exotel,asterisk".
    carriers: str = ""
    # Asterisk AudioSocket listener, HOST:PORT (mounts the asterisk carrier too). Keep it private.
    audiosocket: str = ""
    # Call records (the Twilio bridge's transcripts, recordings, JSON records) are kept here.
    records_dir: Path | None = None
    # Largest WebSocket message accepted on /api/chat (an Ogg page is at most ~64 KiB).
    max_message_bytes: int = Field(256 * 1024, ge=1024, le=16 * 1024 * 1024)
    max_prompt_chars: int = Field(4000, ge=1)
    # A client that does not read for this long is disconnected (its slot is needed by others).
    send_timeout_s: float = Field(10.0, gt=0)
    log_level: str = "info"
    # -- saturation (docs/capacity.md): a process without real-time headroom refuses new calls
    # (busy, 503) before the calls it carries degrade. Enter levels; each exit level is below.
    saturation: bool = True
    saturation_loop_load: float = Field(0.70, gt=0, le=1.0)  # share of the wall clock the loop works
    saturation_loop_lag_ms: float = Field(20.0, gt=0)  # the loop's timer lag, median of a second
    saturation_step_load: float = Field(0.85, gt=0)  # engine step over the frame period, p90
    saturation_exit_hold_s: float = Field(3.0, ge=0)  # every signal back under its exit level this long
    # Call set-up takes turns on the event loop behind the calls in progress (engine/arrivals.py):
    # a burst of arrivals waits rather than stalls every call talking. `False` only to measure it.
    arrival_pacing: bool = True
    # -- cluster (docs/cluster.md): front-end processes and engine workers; all 0/empty = one process
    # Front-end processes on the one port, each with every transport (0 = the embedded server).
    workers: int = Field(0, ge=0, le=256)
    # Engine worker processes on this host (CPU or `device`); `gpus` starts one per listed GPU instead.
    engine_workers: int = Field(0, ge=0, le=256)
    gpus: str = Field("", pattern=r"^[0-9]*(,[0-9]+)*$")
    # Join a Ray cluster (`auto` or HOST:PORT): engine workers are Ray actors, found through Ray.
    ray: str | None = None
    # SIGTERM on a cluster: stop admitting, let running calls go on up to this long, then end them.
    drain_s: float = Field(30.0, ge=0)

    # HTTP limits (process/http_guard.py): a longer request line gets 414, more or larger headers
    # 431; a request whose head is not complete this long after connecting (or after the last
    # response) gets 408, an idle connection is closed. Keep-alive: idle time between requests.
    max_request_line_bytes: int = Field(16 * 1024, ge=1024, le=1 << 20)
    max_header_bytes: int = Field(16 * 1024, ge=1024, le=1 << 20)
    max_headers: int = Field(100, ge=8, le=1000)
    http_request_timeout_s: float = Field(10.0, gt=0)
    http_keepalive_timeout_s: float = Field(5.0, gt=0)
    # Prompts stored with POST /api/prompts (for ?prompt_id=) live this long.
    prompt_ttl_s: float = Field(600.0, gt=0)
    # The 0x04 metadata's `instance_name` (the reference client shows it); empty = the host name.
    instance_name: str = ""
    # Another client build to serve at / instead of web/ (e.g. the reference client's dist/).
    static: Path | None = None
    # -- WebRTC (docs/webrtc.md): WHIP and Pipecat's small-WebRTC offer API beside /api/chat; needs
    # the `webrtc` extra (aiortc). STUN/TURN servers for the server and its browsers: a JSON list
    # of RTCIceServer objects, or comma-separated URLs (`turn:user:pass@host:3478` carries its
    # credentials). A peer that sends nothing for `webrtc_peer_timeout_s` (no RTP, RTCP, data or
    # consent checks) has vanished: its call ends and its slot is freed; one that never connects
    # after its answer ends after `webrtc_connect_timeout_s`.
    webrtc: bool = True
    webrtc_ice_servers: str = ""
    webrtc_peer_timeout_s: float = Field(10.0, gt=0, le=300)
    webrtc_connect_timeout_s: float = Field(20.0, gt=0, le=300)

    @field_validator("records_dir", mode="before")
    @classmethod
    def _empty_records_dir_is_none(cls, value: object) -> object:
        return None if value in ("", None) else value

    @field_validator("static", mode="before")
    @classmethod
    def _empty_static_is_none(cls, value: object) -> object:
        return None if value in ("", None) else value

    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            max_request_line_bytes=self.max_request_line_bytes,
            max_header_bytes=self.max_header_bytes,
            max_headers=self.max_headers,
            request_timeout_s=self.http_request_timeout_s,
        )

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        return None if value in ("", None) else value

    @field_validator("ssl", "voice_dir", "moshi_weight", "mimi_weight", "tokenizer", mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: object) -> object:
        return None if value in ("", None) else value

    @property
    def origins(self) -> list[str]:
        """The allow-list, or [] when every origin is allowed."""
        items = [o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip()]
        return [] if not items or "*" in items else items

    def manager_options(self) -> dict[str, Any]:
        """The SessionManager keywords these settings give (0 limits mean none)."""
        return {
            "max_queue": self.max_queue,
            "max_call_s": self.max_call_s or None,
            "idle_timeout_s": self.idle_timeout_s or None,
            "cache_bytes": round(self.persona_cache_mb * (1 << 20)),
            "start_burst_s": self.start_burst_s,
            "headroom": self.headroom_config(),
            "arrivals": self.arrival_config(),
        }

    def arrival_config(self) -> ArrivalConfig:
        """How call set-up is paced on the event loop (docs/capacity.md)."""
        return ArrivalConfig(enabled=self.arrival_pacing)

    def headroom_config(self) -> HeadroomConfig:
        """The saturation policy these settings ask for (the exit levels sit below the enter
        levels given: load and step load by 0.15, lag at a quarter)."""
        load, step, lag = self.saturation_loop_load, self.saturation_step_load, self.saturation_loop_lag_ms
        return HeadroomConfig(
            enabled=self.saturation,
            exit_hold_s=self.saturation_exit_hold_s,
            loop_load_enter=load,
            loop_load_exit=max(0.0, round(load - 0.15, 3)),
            loop_lag_enter_s=lag / 1000,
            loop_lag_exit_s=round(lag / 4000, 4),
            step_load_enter=step,
            step_load_exit=max(0.0, round(step - 0.15, 3)),
        )

    @property
    def carrier_names(self) -> list[str]:
        """The phone carriers to mount, `--twilio` included, in the order given."""
        names = [n.strip().lower() for n in self.carriers.split(",") if n.strip()]
        if self.twilio and "twilio" not in names:
            names.insert(0, "twilio")
        if self.audiosocket and "asterisk" not in names:
            names.append("asterisk")
        return names

    @property
    def cluster(self) -> bool:
        """True when serve runs front-end processes and engine workers instead of one process."""
        return bool(self.workers or self.engine_workers or self.gpus or self.ray)

    @property
    def gpu_list(self) -> list[int]:
        return [int(g) for g in self.gpus.split(",") if g]

    @property
    def scheme(self) -> str:
        return "https" if self.ssl else "http"

    def ssl_files(self) -> tuple[Path, Path] | None:
        """(cert.pem, key.pem) inside the --ssl directory, or None when serving plain http."""
        if self.ssl is None:
            return None
        return self.ssl / "cert.pem", self.ssl / "key.pem"


def settings_from_file(path: str | os.PathLike[str], **overrides: Any) -> ServerSettings:
    """Settings a parent process wrote as JSON (the supervisor for its children)."""
    values = json.loads(Path(path).read_text())
    return ServerSettings(**{**values, **overrides})
