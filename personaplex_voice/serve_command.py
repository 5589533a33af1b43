"""`personaplex-voice serve`: the flags, then one server process or a cluster.

Every flag has a `PERSONAPLEX_<NAME>` environment variable (e.g. `PERSONAPLEX_MAX_SESSIONS=8`);
a flag given on the command line wins over the environment. Defaults live in `ServerSettings`.
With no cluster flag the server runs in this process (`server.run`); with `--workers`,
`--engine-workers`, `--gpus` or `--ray` the supervisor runs the cluster (`cluster.supervisor`).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from personaplex_voice.cli_options import (
    DeviceOpt,
    DtypeOpt,
    KvDtype,
    MimiWeightOpt,
    ModelOpt,
    MoshiWeightOpt,
    PrefillMode,
    QuantizeMode,
    ThreadsOpt,
    TokenizerOpt,
    VoiceDirOpt,
)
from personaplex_voice.errors import UserError
from personaplex_voice.process.settings import ServerSettings


def serve(
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (env PERSONAPLEX_HOST; default 127.0.0.1)")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (env PERSONAPLEX_PORT; default 8998)")] = None,
    model: ModelOpt = None,  # type: ignore[assignment]  # None: PERSONAPLEX_MODEL or the default
    moshi_weight: MoshiWeightOpt = None,
    mimi_weight: MimiWeightOpt = None,
    tokenizer: TokenizerOpt = None,
    voice_prompt_dir: VoiceDirOpt = None,
    device: DeviceOpt = None,  # type: ignore[assignment]
    dtype: DtypeOpt = None,  # type: ignore[assignment]
    threads: ThreadsOpt = None,  # type: ignore[assignment]
    prefill: Annotated[
        PrefillMode | None,
        typer.Option(
            help="System prompts: parallel (fast) or stepwise (bit for bit the published run) "
            "(env PERSONAPLEX_PREFILL; parallel)"
        ),
    ] = None,
    quantize: Annotated[
        QuantizeMode | None,
        typer.Option(help="int8: the LM's linear weights as int8 (env PERSONAPLEX_QUANTIZE; none)"),
    ] = None,
    kv_dtype: Annotated[
        KvDtype | None,
        typer.Option(
            help="The LM's KV cache: auto (LM dtype), bfloat16, float16, float32, float8 "
            "(env PERSONAPLEX_KV_DTYPE; auto)"
        ),
    ] = None,
    cuda_graphs: Annotated[
        bool | None,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="GPU: every tick as one CUDA graph; a failed capture refuses readiness. "
            "--no-cuda-graphs runs eagerly, knowingly (env PERSONAPLEX_CUDA_GRAPHS; on)",
        ),
    ] = None,
    cpu_offload: Annotated[
        bool | None,
        typer.Option(
            "--cpu-offload/--no-cpu-offload",
            help="Fit a small GPU: int8 weights, fp8 KV, then layers streamed from host memory, as "
            "needed; the warm-up says if real time holds; nothing on CPU (env PERSONAPLEX_CPU_OFFLOAD)",
        ),
    ] = None,
    max_sessions: Annotated[
        int | None,
        typer.Option(help="Concurrent conversations = batch slots (env PERSONAPLEX_MAX_SESSIONS; 4)"),
    ] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="Callers that may wait for a free slot (env PERSONAPLEX_MAX_QUEUE; 0)")
    ] = None,
    max_call_s: Annotated[
        float | None,
        typer.Option(help="End a call after this many seconds, 0 = never (env PERSONAPLEX_MAX_CALL_S; 3600)"),
    ] = None,
    idle_timeout_s: Annotated[
        float | None,
        typer.Option(
            help="End a call after this many seconds without audio, 0 = never "
            "(env PERSONAPLEX_IDLE_TIMEOUT_S; 60)"
        ),
    ] = None,
    persona_cache_mb: Annotated[
        float | None,
        typer.Option(
            help="Memory for prefilled personas (slot snapshots), 0 = off "
            "(env PERSONAPLEX_PERSONA_CACHE_MB; 1024)"
        ),
    ] = None,
    ssl: Annotated[
        Path | None,
        typer.Option(
            help="Serve https/wss with DIR/cert.pem and key.pem; an empty or new DIR gets a self-signed "
            "pair, reused on later starts (env PERSONAPLEX_SSL)"
        ),
    ] = None,
    voice_dir: Annotated[
        Path | None,
        typer.Option(help="Same as --voice-prompt-dir (env PERSONAPLEX_VOICE_DIR)"),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require this key (?token=, Bearer or X-API-Key) (env PERSONAPLEX_API_KEY)"),
    ] = None,
    allowed_origins: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated browser origins allowed on /api/chat (env PERSONAPLEX_ALLOWED_ORIGINS)"
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="`model` (PersonaPlex) or `echo` (loopback, no torch) (env PERSONAPLEX_ENGINE)"),
    ] = None,
    twilio: Annotated[
        bool | None,
        typer.Option(
            "--twilio/--no-twilio",
            help="Mount the Twilio bridge at /twilio, as --carriers twilio (env PERSONAPLEX_TWILIO)",
        ),
    ] = None,
    carriers: Annotated[
        str | None,
        typer.Option(
            help="Phone carriers to answer, e.g. twilio,telnyx,plivo,vonage,exotel,asterisk "
            "(env PERSONAPLEX_CARRIERS)"
        ),
    ] = None,
    audiosocket: Annotated[
        str | None,
        typer.Option(
            help="Listen for Asterisk AudioSocket calls on HOST:PORT (a private address: AudioSocket "
            "has no authentication); mounts the asterisk carrier (env PERSONAPLEX_AUDIOSOCKET)"
        ),
    ] = None,
    records_dir: Annotated[
        Path | None,
        typer.Option(
            help="Keep call records, transcripts and recordings here (phone calls) "
            "(env PERSONAPLEX_RECORDS_DIR)"
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning (env PERSONAPLEX_LOG_LEVEL)")
    ] = None,
    static: Annotated[
        Path | None,
        typer.Option(
            help="Serve this client build at / instead of web/, e.g. the reference PersonaPlex "
            "client's dist/ (env PERSONAPLEX_STATIC)"
        ),
    ] = None,
    webrtc: Annotated[
        bool | None,
        typer.Option(
            "--webrtc/--no-webrtc",
            help="Serve WebRTC calls (WHIP at /api/whip, Pipecat's /api/offer); needs the webrtc "
            "extra (env PERSONAPLEX_WEBRTC; on)",
        ),
    ] = None,
    ice_servers: Annotated[
        str | None,
        typer.Option(
            help="STUN/TURN servers for WebRTC: URLs, comma-separated (turn:USER:PASS@HOST:PORT), or "
            "a JSON list of RTCIceServer objects (env PERSONAPLEX_WEBRTC_ICE_SERVERS)"
        ),
    ] = None,
    # -- cluster (docs/cluster.md) --
    workers: Annotated[
        int | None,
        typer.Option(
            help="Front-end processes sharing the port, each with every transport; 0 = one process "
            "(env PERSONAPLEX_WORKERS; 0)"
        ),
    ] = None,
    engine_workers: Annotated[
        int | None,
        typer.Option(
            help="Engine worker processes (one engine each; CPU or --device) (env PERSONAPLEX_ENGINE_WORKERS)"
        ),
    ] = None,
    gpus: Annotated[
        str | None, typer.Option(help="One engine worker per listed GPU, e.g. 0,1 (env PERSONAPLEX_GPUS)")
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            help="Join this Ray cluster (auto or HOST:PORT): engine workers are Ray actors "
            "(env PERSONAPLEX_RAY)"
        ),
    ] = None,
    drain_s: Annotated[
        float | None,
        typer.Option(
            help="Cluster: on SIGTERM admit nothing new and let calls run this long "
            "(env PERSONAPLEX_DRAIN_S; 30)"
        ),
    ] = None,
) -> None:
    """Serve /api/chat, WebRTC (WHIP, Pipecat's offer API), the browser client, health and metrics."""
    given = {
        name: value.value if isinstance(value, Enum) else value
        for name, value in locals().items()
        if value is not None
    }
    if "ice_servers" in given:
        given["webrtc_ice_servers"] = given.pop("ice_servers")
    alias = given.pop("voice_prompt_dir", None)
    if alias is not None:
        if given.get("voice_dir", alias) != alias:
            raise UserError("--voice-dir and --voice-prompt-dir name different directories: give one")
        given["voice_dir"] = alias
    try:
        settings = ServerSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise UserError(f"invalid server settings: {problems}") from None
    from personaplex_voice.server.webrtc.ice import IceServerError, parse_ice_servers

    try:
        parse_ice_servers(settings.webrtc_ice_servers)
    except IceServerError as exc:
        raise UserError(f"--ice-servers: {exc}") from None
    if settings.cluster:
        from personaplex_voice.cluster.supervisor import run_cluster

        run_cluster(settings)
    else:
        from personaplex_voice.server.run import run

        run(settings)
