"""Call control through Twilio's REST API: place outbound calls, hang up, give a live call new TwiML.

The `twilio` client is synchronous (it blocks on HTTP), so the async helpers run it in a worker
thread. Tests hand the client a fake `twilio.http.HttpClient`, the one boundary we mock.
`TwilioControl` is the phone call's `CallControl` on top of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from urllib.parse import urlencode

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome

from personaplex_voice.errors import UserError
from twilio.base.exceptions import TwilioException
from twilio.http import HttpClient
from twilio.http.http_client import TwilioHttpClient
from twilio.rest import Client

from . import twiml
from .config import TwilioSettings

log = logging.getLogger(__name__)

VOICE_PATH = "/twilio/voice"
STATUS_PATH = "/twilio/status"
MEDIA_STREAM_PATH = "/twilio/media-stream"


WHISPER_PATH = "/twilio/whisper"


def voice_webhook_url(
    public_url: str,
    persona: str | None = None,
    outbound_token: str | None = None,
    *,
    resume: str | None = None,
    variables: Mapping[str, str] | None = None,
) -> str:
    """Our voice webhook; a query string is fine here (unlike Stream URLs) and Twilio signs it.
    `variables` fill the persona's prompt template, as a Studio flow's query parameters do."""
    query = {k: v for k, v in (("persona", persona), ("outbound", outbound_token), ("resume", resume)) if v}
    query.update(variables or {})
    return public_url + VOICE_PATH + (("?" + urlencode(query)) if query else "")


TWILIO_API = "https://api.twilio.com"


class RebasedHttpClient(TwilioHttpClient):
    """Twilio's HTTP client, sending to another base than api.twilio.com (PERSONAPLEX_TWILIO_API_URL)."""

    def __init__(self, base: str):
        super().__init__(timeout=10)
        self.base = base.rstrip("/")

    def request(self, method: str, url: str, *args: object, **kwargs: object) -> object:
        if url.startswith(TWILIO_API):
            url = self.base + url[len(TWILIO_API) :]
        return super().request(method, url, *args, **kwargs)  # type: ignore[arg-type]


class CallControl:
    """Places and ends calls. `available` is False without account credentials."""

    def __init__(self, settings: TwilioSettings, http_client: HttpClient | None = None):
        self.settings = settings
        if http_client is None and settings.api_url:
            http_client = RebasedHttpClient(settings.api_url)
        self._http_client = http_client
        self._client: Client | None = None

    @property
    def available(self) -> bool:
        return bool(self.settings.account_sid and self.settings.auth_token.get_secret_value())

    @property
    def client(self) -> Client:
        if not self.available:
            raise UserError("Twilio REST calls need TWILIO_ACCOUNT_SID and TWILIO_AUTH_TOKEN")
        if self._client is None:
            self._client = Client(
                self.settings.account_sid,
                self.settings.auth_token.get_secret_value(),
                http_client=self._http_client,
            )
        return self._client

    def place_call(
        self,
        to: str,
        from_: str,
        *,
        persona: str | None = None,
        outbound_token: str | None = None,
        public_url: str | None = None,
        time_limit_s: int | None = None,
        variables: Mapping[str, str] | None = None,
    ) -> str:
        """Dial `to` from `from_`; when answered Twilio fetches our voice webhook. Returns the CallSid."""
        base = (public_url or self.settings.public_url).rstrip("/")
        if not base:
            raise UserError("outbound calls need PUBLIC_URL (where Twilio reaches this server)")
        limit = int(time_limit_s if time_limit_s is not None else self.settings.max_call_s)
        try:
            call = self.client.calls.create(
                to=to,
                from_=from_,
                url=voice_webhook_url(base, persona, outbound_token, variables=variables),
                method="POST",
                status_callback=base + STATUS_PATH,
                status_callback_method="POST",
                status_callback_event=list(self.settings.status_callback_events),
                time_limit=max(1, limit),
            )
        except TwilioException as exc:
            raise UserError(f"Twilio refused the call: {exc}") from None
        log.info("twilio: placed call %s to %s (persona %s)", call.sid, to, persona)
        return str(call.sid)

    def hang_up(self, call_sid: str) -> bool:
        """End a live call (status=completed); errors are logged (False), never raised."""
        try:
            self.client.calls(call_sid).update(status="completed")
            log.info("twilio: hung up call %s", call_sid)
            return True
        except (TwilioException, UserError) as exc:
            log.warning("twilio: could not hang up %s: %s", call_sid, exc)
            return False

    async def hang_up_async(self, call_sid: str) -> bool:
        if not self.available:
            return False
        return await asyncio.to_thread(self.hang_up, call_sid)

    def update(self, call_sid: str, *, twiml: str | None = None, url: str | None = None) -> bool:
        """Give a live call new instructions (TwiML text, or a URL Twilio fetches TwiML from):
        Twilio stops what the call was doing (our stream too) and follows them. False, logged,
        when Twilio refused or cannot be reached."""
        try:
            if url is not None:
                self.client.calls(call_sid).update(url=url, method="POST")
            else:
                self.client.calls(call_sid).update(twiml=twiml)
            return True
        except (TwilioException, UserError) as exc:
            log.warning("twilio: could not update call %s: %s", call_sid, exc)
            return False

    async def update_async(self, call_sid: str, *, twiml: str | None = None, url: str | None = None) -> bool:
        if not self.available:
            log.warning("twilio: no REST credentials: cannot update call %s", call_sid)
            return False
        return await asyncio.to_thread(lambda: self.update(call_sid, twiml=twiml, url=url))

    async def place_call_async(self, to: str, from_: str, **kwargs: object) -> str:
        return await asyncio.to_thread(lambda: self.place_call(to, from_, **kwargs))  # type: ignore[arg-type]


class TwilioControl:
    """The phone call's CallControl for Twilio: a hang-up is `Status=completed`, anything else a
    call update with TwiML (or with the user's URL for a lone `Redirect`)."""

    def __init__(self, calls: CallControl):
        self.calls = calls

    @property
    def available(self) -> bool:
        return self.calls.available

    async def hang_up(self, call: CallHandle) -> Outcome:
        ok = await self.calls.hang_up_async(call.call_id)
        return Outcome(ok, "" if ok else "refused by Twilio, or no REST credentials")

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        if len(steps) == 1 and isinstance(steps[0], phone.Redirect):
            ok = await self.calls.update_async(call.call_id, url=steps[0].url)
        elif len(steps) == 1 and isinstance(steps[0], phone.Markup):
            ok = await self.calls.update_async(call.call_id, twiml=steps[0].text)
        else:
            document = twiml.render(
                steps,
                whisper_url=lambda dial: whisper_url(call.public_base, dial),
                resume_url=lambda resume: voice_webhook_url(
                    call.public_base, resume.persona, resume=resume.token
                ),
            )
            ok = await self.calls.update_async(call.call_id, twiml=document)
        return Outcome(ok, "" if ok else "refused by Twilio, or no REST credentials")


def whisper_url(public_base: str, dial: phone.Dial) -> str | None:
    """What the far end of a transfer hears first: our signed whisper webhook for the rule."""
    if not dial.whisper or dial.rule is None:
        return None
    persona, index = dial.rule
    return f"{public_base}{WHISPER_PATH}?{urlencode({'persona': persona, 'rule': index})}"
