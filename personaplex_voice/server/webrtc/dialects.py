"""What the agent says on a call's data channel, in the language of the client that called.

The events are those of /api/chat (metadata, the handshake once the persona is in its slot, text
pieces, an error before the server ends the call); each endpoint speaks them its client's way:

* **chat kinds** (`POST /api/whip`, the web page): exactly the binary messages of /api/chat,
  first byte the kind (0x04 metadata JSON, 0x00 handshake, 0x02 text, 0x05 error), so a client
  decodes them with the same code (`server/protocol.py`, `web/protocol.js`). The client may send
  0x06 pings (the page does, every second) to show it is alive; other kinds are ignored.
* **RTVI** (`POST /api/offer`, Pipecat's small-WebRTC client): JSON messages labelled `rtvi-ai`
  as Pipecat's server sends them (pipecat/processors/frameworks/rtvi/models.py, pipecat-ai
  1.14): `server-message` for the metadata, `bot-ready` for the handshake (once the persona
  is in and the client said `client-ready`, answering its id), `bot-transcription` for each
  text piece, `error` (fatal) and then Pipecat's `signalling` `peerLeft` before the server
  ends the call. From the client: its `ping: <ms>` keepalive strings, `signalling`
  `trackStatus` messages, `client-ready`, and `disconnect-bot` (hang up), as
  pipecat/transports/smallwebrtc/connection.py reads them.

A dialect turns events into data-channel payloads and reads what the client sends; it owns no
channel and no call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from personaplex_voice.server import protocol
from personaplex_voice.server.protocol import Kind

__all__ = ["ChatKinds", "ClientSaid", "Dialect", "Rtvi"]

Payload = str | bytes
MAX_INBOUND_BYTES = 64 * 1024  # a client message larger than this is not read


@dataclass(frozen=True)
class ClientSaid:
    hang_up: bool = False  # the client asked to end the call
    mic_enabled: bool | None = None  # the client says its microphone is on or off
    ready_request: bool = False  # the client asked whether the agent is ready (RTVI client-ready)


class Dialect(Protocol):
    name: str

    def metadata(self, data: dict[str, Any]) -> list[Payload]: ...

    def ready(self) -> list[Payload]: ...

    def text(self, piece: str) -> list[Payload]: ...

    def error(self, message: str, kind: str) -> list[Payload]: ...

    def read(self, message: Payload) -> ClientSaid: ...


class ChatKinds:
    name = "chat"

    def metadata(self, data: dict[str, Any]) -> list[Payload]:
        return [protocol.encode_metadata(data)]

    def ready(self) -> list[Payload]:
        return [protocol.encode_handshake()]

    def text(self, piece: str) -> list[Payload]:
        return [protocol.encode_text(piece)]

    def error(self, message: str, kind: str) -> list[Payload]:
        return [protocol.encode_error(message)]

    def read(self, message: Payload) -> ClientSaid:
        # Pings (0x06) only show the client is alive; control (0x03) is ignored as on /api/chat.
        return ClientSaid()


class Rtvi:
    name = "rtvi"
    LABEL = "rtvi-ai"
    VERSION = "1.0.0"  # the RTVI messages used here are unchanged since 1.0

    def __init__(self) -> None:
        self._client_ready_id: str | None = None

    def _message(self, type_: str, data: Any, **extra: Any) -> str:
        return json.dumps({"label": self.LABEL, "type": type_, **extra, "data": data}, separators=(",", ":"))

    def metadata(self, data: dict[str, Any]) -> list[Payload]:
        return [self._message("server-message", {"type": "personaplex-metadata", "metadata": data})]

    def ready(self) -> list[Payload]:
        """`bot-ready` answers the client's `client-ready` (as Pipecat's RTVI processor does):
        nothing before it; the call sends it again when the client asks."""
        if self._client_ready_id is None:
            return []
        about = {"library": "personaplex-voice", "transport": "small-webrtc"}
        data = {"version": self.VERSION, "about": about}
        return [self._message("bot-ready", data, id=self._client_ready_id)]

    def text(self, piece: str) -> list[Payload]:
        return [self._message("bot-transcription", {"text": piece})]

    def error(self, message: str, kind: str) -> list[Payload]:
        left = json.dumps({"type": "signalling", "message": {"type": "peerLeft"}}, separators=(",", ":"))
        return [self._message("error", {"message": message, "fatal": True}), left]

    def read(self, message: Payload) -> ClientSaid:
        if isinstance(message, bytes) or message.startswith("ping"):
            return ClientSaid()
        try:
            data = json.loads(message)
        except ValueError:
            return ClientSaid()
        if not isinstance(data, dict):
            return ClientSaid()
        if data.get("type") == "signalling" and isinstance(data.get("message"), dict):
            inner = data["message"]
            if inner.get("type") == "trackStatus" and inner.get("receiver_index") == 0:
                return ClientSaid(mic_enabled=bool(inner.get("enabled")))
            return ClientSaid()
        if data.get("label") != self.LABEL:
            return ClientSaid()
        if data.get("type") == "client-ready":
            given = data.get("id")
            self._client_ready_id = given[:128] if isinstance(given, str) and given else uuid.uuid4().hex
            return ClientSaid(ready_request=True)
        if data.get("type") == "disconnect-bot":
            return ClientSaid(hang_up=True)
        return ClientSaid()


def inbound_kind(message: Payload) -> str:
    """A label for the metrics: what kind of message a client sent on the data channel."""
    if isinstance(message, bytes):
        decoded = protocol.decode(message)
        if decoded is None:
            return "empty"
        return Kind(decoded.kind).name.lower() if decoded.known else "unknown"
    return "text"
