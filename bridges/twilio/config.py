"""Settings of the Twilio carrier, read from the environment.

Twilio's own variables keep their standard names (`TWILIO_ACCOUNT_SID`, `TWILIO_AUTH_TOKEN`); the
phone call's settings (personas, limits, pacing, records, webhooks: personaplex_phone.config) are
read as `PERSONAPLEX_TWILIO_*` first, then `PERSONAPLEX_PHONE_*`, so `TwilioSettings` alone
configures a Twilio-only server exactly as before the carrier-neutral phone call existed.
Signature validation is on unless the explicitly named development flag
`PERSONAPLEX_TWILIO_DEV_SKIP_SIGNATURE=1` is set.
"""

from __future__ import annotations

from typing import ClassVar

from personaplex_phone.config import PHONE_PREFIX, PhoneSettings
from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from personaplex_voice.errors import UserError


class TwilioSettings(PhoneSettings):
    model_config = SettingsConfigDict(env_prefix="PERSONAPLEX_TWILIO_", extra="ignore", populate_by_name=True)
    fallback_prefixes: ClassVar[tuple[str, ...]] = (PHONE_PREFIX,)

    account_sid: str = Field("", validation_alias=AliasChoices("TWILIO_ACCOUNT_SID", "account_sid"))
    auth_token: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("TWILIO_AUTH_TOKEN", "auth_token")
    )
    status_callback_events: tuple[str, ...] = ("initiated", "ringing", "answered", "completed")
    # Where Twilio's REST API is reached (empty: https://api.twilio.com): a proxy, or a fake in tests.
    api_url: str = ""
    # A call whose engine worker died follows this instead of hearing `engine_lost_message`: an
    # http(s) URL of your TwiML, or TwiML text.
    engine_lost_twiml: str = ""
    # A caller turned away busy (every slot taken, or no real-time headroom left) gets this
    # instead of hearing `busy_message`: an http(s) URL of your TwiML (another site, a queue, a
    # voicemail), or TwiML text.
    busy_twiml: str = ""
    # Our audio to Twilio in media messages of this many ms (20, 40, 60 or 80). 40 halves our
    # outbound WebSocket messages against Twilio's own 20 (marks still follow every frame) and
    # keeps what Twilio holds of ours (the cushion and one message) within the barge-in bound,
    # which 80 would not; docs/capacity.md has the measurements.
    message_ms: int = Field(40, ge=20, le=80, multiple_of=20)

    @field_validator("engine_lost_twiml", "busy_twiml")
    @classmethod
    def _check_fallback(cls, value: str) -> str:
        value = value.strip()
        if value and not value.startswith(("http://", "https://", "<")):
            raise ValueError(
                "ENGINE_LOST_TWIML and BUSY_TWIML must be an http(s) URL or TwiML text (<Response>…)"
            )
        return value

    def check(self) -> None:
        """Refuse to run in a state where every Twilio request would be rejected or unsafe."""
        if self.validate_signatures and not self.auth_token.get_secret_value():
            raise UserError(
                "the Twilio bridge needs TWILIO_AUTH_TOKEN to check request signatures "
                "(for local development only: PERSONAPLEX_TWILIO_DEV_SKIP_SIGNATURE=1)"
            )
