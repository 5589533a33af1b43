"""Every carrier at its edge: the secrets a test server and its simulated carriers share, a
recording fake of the carriers' REST APIs (the one thing faked; carriers are unreachable here),
and what phone tests ask of a running server (its calls, a call's record, waiting for both).

    apis = FakeCarrierApis().start()
    env = carrier_env(apis.url, personas_file)          # for `serve --carriers …`
    sim = PhoneSimulator(carrier_side("plivo"), server.url, public_url=PUBLIC_URL)
    apis.requests_for("plivo")                          # what the server asked Plivo to do
    await wait_idle(server); record = await wait_ended(server, call_id)
    line_echo_similarity(said, heard, rate)             # how well a call's echo came back (1.0: whole)
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from personaplex_phone.simulator import load_side
from personaplex_telnyx.sim import keypair

CARRIERS = ("twilio", "telnyx", "plivo", "vonage", "exotel")  # the cloud carriers (REST call control)
PLATFORMS = ("asterisk", "jambonz", "genesys")  # self-hosted switches and contact-center platforms
EVERY_CARRIER = (*CARRIERS, *PLATFORMS)
PUBLIC_URL = "https://voice.example.test"
API_TOKEN = "phone-test-api-token"
WEBHOOK_SECRET = "phone-test-webhook-secret"

TWILIO_TOKEN = "phone-test-twilio-token"
TWILIO_ACCOUNT = "AC" + "0" * 32
# Fixed, so that simulators in other processes (bench/phone_load.py) sign with the same key.
_TELNYX = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"personaplex-voice phone tests").digest())
TELNYX_PRIVATE = base64.b64encode(_TELNYX.private_bytes_raw()).decode()
TELNYX_PUBLIC = base64.b64encode(_TELNYX.public_key().public_bytes_raw()).decode()
TELNYX_API_KEY = "KEY-phone-test"
PLIVO_ID, PLIVO_TOKEN = "MAPHONETEST000000000", "phone-test-plivo-token"
VONAGE_SECRET, VONAGE_APP = "phone-test-vonage-signature-secret", "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
VONAGE_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
VONAGE_PEM = VONAGE_KEY.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()
EXOTEL_KEY, EXOTEL_TOKEN, EXOTEL_SID = "phone-test-exotel-key", "phone-test-exotel-token", "acme1"
EXOTEL_ANSWER_TOKEN = "phone-test-exotel-answer-token"
JAMBONZ_SECRET = "phone-test-jambonz-webhook-secret"
GENESYS_KEY = "phone-test-genesys-api-key"
GENESYS_SECRET = base64.b64encode(b"phone-test-genesys-client-key-01").decode()


def carrier_side(name: str, **options: Any) -> Any:
    """The carrier's side, signing with the test server's secrets."""
    secrets_ = {
        "twilio": {"auth_token": TWILIO_TOKEN},
        "telnyx": {"private_key": TELNYX_PRIVATE},
        "plivo": {"auth_id": PLIVO_ID, "auth_token": PLIVO_TOKEN},
        "vonage": {"signature_secret": VONAGE_SECRET},
        "exotel": {"api_key": EXOTEL_KEY, "api_token": EXOTEL_TOKEN, "answer_token": EXOTEL_ANSWER_TOKEN},
        "asterisk": {"api_key": API_TOKEN},
        "jambonz": {"webhook_secret": JAMBONZ_SECRET},
        "genesys": {"api_key": GENESYS_KEY, "client_secret": GENESYS_SECRET},
    }[name]
    return load_side(name, **secrets_, **options)


def wrong_side(name: str) -> Any:
    """The carrier's side with secrets that are not the server's (a forger)."""
    other = {
        "twilio": {"auth_token": "not-the-token"},
        "telnyx": {"private_key": keypair()[0]},
        "plivo": {"auth_id": PLIVO_ID, "auth_token": "not-the-token"},
        "vonage": {"signature_secret": "not-the-server's-signature-secret-but-long-enough"},
        "exotel": {
            "api_key": EXOTEL_KEY,
            "api_token": "not-the-token",
            "answer_token": "not-the-answer-token",
        },
        "asterisk": {"api_key": "not-the-api-token"},
        "jambonz": {"webhook_secret": "not-the-secret"},
        "genesys": {"api_key": "not-the-key", "client_secret": GENESYS_SECRET},
    }[name]
    return load_side(name, **other)


def carrier_env(api_url: str | None, personas_file: str) -> dict[str, str]:
    """The environment of a server answering every carrier, their REST APIs at `api_url` (None:
    no carrier's REST API is used). It also holds what the simulators sign with, for `phone
    simulate` run with it."""
    rest = {
        "PERSONAPLEX_TWILIO_API_URL": f"{api_url}/twilio",
        "PERSONAPLEX_TELNYX_API_URL": f"{api_url}/telnyx",
        "PERSONAPLEX_PLIVO_API_URL": f"{api_url}/plivo",
        "PERSONAPLEX_VONAGE_API_URL": f"{api_url}/vonage",
        "PERSONAPLEX_EXOTEL_API_URL": f"{api_url}/exotel",
    }
    return {
        "PUBLIC_URL": PUBLIC_URL,
        "PERSONAPLEX_PHONE_PERSONAS_FILE": personas_file,
        "PERSONAPLEX_PHONE_API_TOKEN": API_TOKEN,
        "PERSONAPLEX_PHONE_WEBHOOK_SECRET": WEBHOOK_SECRET,
        "PERSONAPLEX_PHONE_WEBHOOK_BACKOFF_S": "0.2",
        "TWILIO_AUTH_TOKEN": TWILIO_TOKEN,
        "TWILIO_ACCOUNT_SID": TWILIO_ACCOUNT,
        "TELNYX_PUBLIC_KEY": TELNYX_PUBLIC,
        "TELNYX_PRIVATE_KEY": TELNYX_PRIVATE,  # the simulator's half
        "TELNYX_API_KEY": TELNYX_API_KEY,
        "PLIVO_AUTH_ID": PLIVO_ID,
        "PLIVO_AUTH_TOKEN": PLIVO_TOKEN,
        "VONAGE_SIGNATURE_SECRET": VONAGE_SECRET,
        "VONAGE_APPLICATION_ID": VONAGE_APP,
        "VONAGE_PRIVATE_KEY": VONAGE_PEM,
        "EXOTEL_API_KEY": EXOTEL_KEY,
        "EXOTEL_API_TOKEN": EXOTEL_TOKEN,
        "EXOTEL_ACCOUNT_SID": EXOTEL_SID,
        "PERSONAPLEX_EXOTEL_ANSWER_TOKEN": EXOTEL_ANSWER_TOKEN,
        "JAMBONZ_WEBHOOK_SECRET": JAMBONZ_SECRET,
        "GENESYS_API_KEY": GENESYS_KEY,
        "GENESYS_CLIENT_SECRET": GENESYS_SECRET,
        **(rest if api_url is not None else {}),
    }


@dataclass
class ApiRequest:
    method: str
    path: str  # after the carrier's prefix
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def form(self) -> dict[str, str]:
        from urllib.parse import parse_qsl

        return dict(parse_qsl(self.body.decode()))


class FakeCarrierApis:
    """The carriers' REST APIs on 127.0.0.1 (one server; `/<carrier>` prefixes the real paths):
    every request is recorded and answered as the carrier would answer a good one (a created
    Twilio call gets its sid)."""

    def __init__(self) -> None:
        fake = self
        self.received: list[tuple[str, ApiRequest]] = []
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                carrier, _, rest = self.path.lstrip("/").partition("/")
                request = ApiRequest(
                    self.command, "/" + rest, {k.lower(): v for k, v in self.headers.items()}, body
                )
                with fake.lock:
                    fake.received.append((carrier, request))
                status, answer = fake.answer(carrier, request)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def answer(self, carrier: str, request: ApiRequest) -> tuple[int, Any]:
        if carrier == "twilio" and request.path.endswith("/Calls.json"):
            return 201, {"sid": "CA" + "f" * 32, "account_sid": TWILIO_ACCOUNT, "status": "queued"}
        if carrier == "twilio":
            sid = request.path.rsplit("/", 1)[-1].removesuffix(".json")
            return 200, {"sid": sid, "account_sid": TWILIO_ACCOUNT, "status": "in-progress"}
        if carrier == "plivo" and request.method == "DELETE":
            return 204, {}
        return 200, {"result": "ok"}

    def start(self) -> FakeCarrierApis:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def requests_for(self, carrier: str) -> list[ApiRequest]:
        with self.lock:
            return [r for c, r in self.received if c == carrier]

    def wait_for(self, carrier: str, count: int = 1, timeout: float = 10.0) -> list[ApiRequest]:
        deadline = time.monotonic() + timeout
        while len(self.requests_for(carrier)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{carrier}: {len(self.requests_for(carrier))} REST request(s), not {count}"
                )
            time.sleep(0.02)
        return self.requests_for(carrier)


def basic_user(headers: dict[str, str]) -> str:
    value = headers.get("authorization", "")
    return base64.b64decode(value[6:]).decode().partition(":")[0] if value.startswith("Basic ") else ""


# --- a running server's calls --------------------------------------------------------------------


def calls_state(server: Any) -> dict:
    """`GET /phone/calls`: slots, reservations, live calls, the latest records."""
    response = httpx.get(server.url + "/phone/calls", headers={"Authorization": f"Bearer {API_TOKEN}"})
    assert response.status_code == 200, response.text
    return response.json()


def record_of(server: Any, call_id: str) -> dict:
    response = httpx.get(
        f"{server.url}/phone/calls/{call_id}", headers={"Authorization": f"Bearer {API_TOKEN}"}
    )
    assert response.status_code == 200, response.text
    return response.json()


async def wait_for(check: Callable[[], bool], what: str = "condition", timeout: float = 15.0) -> None:
    """Until `check()` (run off the loop: it may ask the server) is true; fails saying `what`."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def wait_idle(server: Any) -> None:
    """Until no session runs, no slot is reserved and no call is live."""

    def idle() -> bool:
        state = calls_state(server)
        return state["active_sessions"] == 0 and state["reserved"] == 0 and not state["live"]

    await wait_for(idle, "the slots to be freed")


async def wait_ended(server: Any, call_id: str) -> dict:
    """The call's record once closed (a moment after the stream ends)."""
    record: dict = {}

    def ended() -> bool:
        nonlocal record
        record = record_of(server, call_id)
        return record.get("ended_at") is not None

    await wait_for(ended, f"call {call_id}'s record to close")
    return record


def speechlike(seconds: float, rate: int, seed: int = 5) -> np.ndarray:
    """Band-limited noise with a syllable-rate envelope (broadband: correlation finds its lag)."""
    rng = np.random.default_rng(seed)
    n = round(seconds * rate)
    noise = np.convolve(rng.standard_normal(n), np.hanning(round(rate / 1000) + 5) / 4, "same")
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * np.arange(n) / rate)
    return (0.3 * noise * envelope).astype(np.float32)


def line_echo_similarity(sent: np.ndarray, heard: np.ndarray, rate: int) -> float:
    """The median over 0.5 s blocks of each block's best normalized correlation with what was
    heard, its lag searched within 1 s (a starved CI machine may shift the echo mid-call)."""
    from scipy.signal import correlate

    block, lag = rate // 2, rate
    scores = []
    for start in range(0, len(sent) - block, block):
        a = sent[start : start + block]
        b = heard[start : start + block + lag]
        if len(b) < block or np.linalg.norm(a) == 0:
            continue
        c = correlate(b, a, mode="valid")
        # Each window's energy as a moving sum (np.convolve with a block of ones is quadratic).
        running = np.concatenate([[0.0], np.cumsum(np.square(b, dtype=np.float64))])
        energy = np.sqrt(np.maximum(running[block:] - running[:-block], 0.0))
        scores.append(float(np.max(c / np.maximum(np.linalg.norm(a) * energy, 1e-12))))
    return float(np.median(scores)) if scores else 0.0
