"""A Pipecat phone bot on Twilio, with PersonaPlex as the speech-to-speech model.

    Twilio number --(voice webhook)--> POST /twiml --> <Connect><Stream url="wss://HOST/ws">
    Twilio Media Streams <--> FastAPIWebsocketTransport + TwilioFrameSerializer
                              Pipeline: transport.input() -> PersonaPlexLLMService -> transport.output()

The model is full duplex: there is no VAD, no STT, no TTS and no turn logic in the pipeline.

Run it next to a personaplex-voice server (the GPU box) ...

    PERSONAPLEX_URL=ws://gpu-host:8998/api/chat PERSONAPLEX_API_KEY=... \
    PUBLIC_URL=https://abc.ngrok.app TWILIO_AUTH_TOKEN=... python examples/pipecat_twilio_bot.py

... or with the model in this process (one engine shared by every call, `--max-sessions` slots):

    PERSONAPLEX_MODEL=nvidia/personaplex-7b-v1 PERSONAPLEX_DEVICE=cuda PERSONAPLEX_SLOTS=4 \
    PUBLIC_URL=https://abc.ngrok.app TWILIO_AUTH_TOKEN=... python examples/pipecat_twilio_bot.py

then set the number's "A call comes in" webhook to `POST https://abc.ngrok.app/twiml`.
Persona: PERSONAPLEX_TEXT_PROMPT, PERSONAPLEX_VOICE (e.g. NATF2). With TWILIO_AUTH_TOKEN set, every
webhook and WebSocket upgrade must carry a valid `X-Twilio-Signature`; with TWILIO_ACCOUNT_SID too,
the bot hangs up through Twilio's REST API when the pipeline ends.

Needs `pip install "personaplex-voice[pipecat,twilio]"`.
"""

from __future__ import annotations

import contextlib
import html
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import PlainTextResponse, Response
from personaplex_pipecat import Backend, InProcessBackend, PersonaPlexLLMService, RemoteBackend
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.runner.utils import parse_telephony_websocket
from pipecat.serializers.twilio import TwilioFrameSerializer
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport
from pipecat.workers.runner import WorkerRunner

log = logging.getLogger("pipecat_twilio_bot")

TWILIO_RATE = 8000  # μ-law 8 kHz both ways; the service resamples to and from the model's 24 kHz


@dataclass(frozen=True)
class BotConfig:
    public_url: str | None = None  # https://host as Twilio reaches us (needed behind tunnels)
    twilio_auth_token: str | None = None  # validates X-Twilio-Signature when set
    twilio_account_sid: str | None = None  # with the token: hang up via REST when the bot ends
    text_prompt: str = "You are a friendly assistant. Keep your answers short."
    voice: str | None = None

    @classmethod
    def from_env(cls) -> BotConfig:
        return cls(
            public_url=os.environ.get("PUBLIC_URL") or None,
            twilio_auth_token=os.environ.get("TWILIO_AUTH_TOKEN") or None,
            twilio_account_sid=os.environ.get("TWILIO_ACCOUNT_SID") or None,
            text_prompt=os.environ.get("PERSONAPLEX_TEXT_PROMPT", cls.text_prompt),
            voice=os.environ.get("PERSONAPLEX_VOICE") or None,
        )


def backend_from_env() -> Backend:
    """A remote server when PERSONAPLEX_URL is set, else the model in this process."""
    url = os.environ.get("PERSONAPLEX_URL")
    if url:
        return RemoteBackend(url, api_key=os.environ.get("PERSONAPLEX_API_KEY"))
    return InProcessBackend(
        model=os.environ.get("PERSONAPLEX_MODEL", "demo"),
        device=os.environ.get("PERSONAPLEX_DEVICE", "cpu"),
        num_slots=int(os.environ.get("PERSONAPLEX_SLOTS", "1")),
    )


class SignatureCheck:
    """`X-Twilio-Signature` over the URL Twilio requested (rebuilt from PUBLIC_URL behind a proxy)."""

    def __init__(self, config: BotConfig):
        self.public_url = config.public_url
        self.validator = None
        if config.twilio_auth_token:
            from twilio.request_validator import RequestValidator

            self.validator = RequestValidator(config.twilio_auth_token)

    def url_of(self, conn: Request | WebSocket) -> str:
        base = self.public_url or f"{conn.url.scheme}://{conn.url.netloc}"
        return base.rstrip("/") + conn.url.path

    def ok(self, url: str, params: dict[str, str], signature: str | None) -> bool:
        if self.validator is None:
            return True
        if not signature:
            return False
        # Twilio signs the wss:// Stream URL for the upgrade; accept its https:// twin as well.
        alternatives = {url, url.replace("https://", "wss://", 1), url.replace("http://", "ws://", 1)}
        return any(self.validator.validate(u, params, signature) for u in alternatives)


def twiml_for(stream_url: str) -> str:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f'<Response><Connect><Stream url="{html.escape(stream_url)}" /></Connect></Response>'
    )


async def run_bot(websocket: WebSocket, backend: Backend, config: BotConfig) -> None:
    """One phone call: a Pipecat pipeline from the Media Streams socket through PersonaPlex and back."""
    _transport_type, call_data = await parse_telephony_websocket(websocket)
    can_hang_up = bool(config.twilio_account_sid and config.twilio_auth_token)
    serializer = TwilioFrameSerializer(
        stream_sid=call_data["stream_id"],
        call_sid=call_data["call_id"],
        account_sid=config.twilio_account_sid,
        auth_token=config.twilio_auth_token if can_hang_up else None,
        params=TwilioFrameSerializer.InputParams(auto_hang_up=can_hang_up),
    )
    transport = FastAPIWebsocketTransport(
        websocket=websocket,
        params=FastAPIWebsocketParams(
            audio_in_enabled=True,
            audio_out_enabled=True,
            add_wav_header=False,
            serializer=serializer,
            # No vad_analyzer and no turn strategies: PersonaPlex listens while it talks and
            # decides itself when to speak and when to stop for a barge-in.
        ),
    )
    llm = PersonaPlexLLMService(backend=backend, text_prompt=config.text_prompt, voice=config.voice)
    pipeline = Pipeline([transport.input(), llm, transport.output()])
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(
            audio_in_sample_rate=TWILIO_RATE, audio_out_sample_rate=TWILIO_RATE, enable_metrics=True
        ),
        enable_rtvi=False,
    )

    @transport.event_handler("on_client_disconnected")
    async def on_client_disconnected(_transport, _websocket):
        await worker.cancel()  # the caller hung up: CancelFrame frees the model's slot at once

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()


def create_app(backend: Backend, config: BotConfig | None = None) -> FastAPI:
    """The bot's web app. `backend` is shared by every call and prepared at startup (the model
    loads once, before the first call, instead of inside a call's pipeline)."""
    config = config or BotConfig()
    signatures = SignatureCheck(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await backend.prepare()
        yield
        await backend.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/twiml")
    async def twiml(request: Request) -> Response:
        # Twilio posts application/x-www-form-urlencoded (parsed here: no python-multipart needed)
        form = dict(parse_qsl((await request.body()).decode("utf-8"), keep_blank_values=True))
        if not signatures.ok(signatures.url_of(request), form, request.headers.get("X-Twilio-Signature")):
            return PlainTextResponse("bad signature", status_code=403)
        base = config.public_url or f"{request.url.scheme}://{request.url.netloc}"
        stream = base.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1) + "/ws"
        return Response(twiml_for(stream), media_type="application/xml")

    @app.websocket("/ws")
    async def media_stream(websocket: WebSocket) -> None:
        if not signatures.ok(signatures.url_of(websocket), {}, websocket.headers.get("X-Twilio-Signature")):
            await websocket.close(code=1008)
            return
        await websocket.accept()
        await run_bot(websocket, backend, config)

    return app


def main() -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    app = create_app(backend_from_env(), BotConfig.from_env())
    uvicorn.run(app, host=os.environ.get("HOST", "0.0.0.0"), port=int(os.environ.get("PORT", "8765")))


if __name__ == "__main__":
    main()
