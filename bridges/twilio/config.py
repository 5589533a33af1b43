"""Settings of the Twilio bridge, read from the environment.

Twilio's own variables keep their standard names (`TWILIO_ACCOUNT_SID`, `TWILIO_AUTH_TOKEN`) and
the public base URL is `PUBLIC_URL`, the name tunnels and PaaS hosts commonly set; everything
else is `PERSONAPLEX_TWILIO_*`. Signature validation is on unless the explicitly named
development flag `PERSONAPLEX_TWILIO_DEV_SKIP_SIGNATURE=1` is set.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from personaplex_voice.errors import UserError


class TwilioSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PERSONAPLEX_TWILIO_", extra="ignore", populate_by_name=True)

    account_sid: str = Field("", validation_alias=AliasChoices("TWILIO_ACCOUNT_SID", "account_sid"))
    auth_token: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("TWILIO_AUTH_TOKEN", "auth_token")
    )
    # Base URL Twilio reaches us at, e.g. https://abc.ngrok.app. Webhook signatures are checked
    # against it (a proxy or tunnel rewrites the Host the server sees) and its scheme picks the
    # Stream URL's: https -> wss, http -> ws. Empty: derived from each request (direct exposure only).
    public_url: str = Field("", validation_alias=AliasChoices("PUBLIC_URL", "public_url"))
    # Development only: accept unsigned webhooks and WebSocket upgrades.
    dev_skip_signature: bool = False
    # YAML/JSON file: named personas, called number -> persona, default persona.
    personas_file: Path | None = None
    # Bearer token that guards POST /twilio/call and GET /twilio/calls; empty disables both.
    api_token: SecretStr = SecretStr("")

    # Per-call limits. The caller is told goodbye by a hang-up via the REST API.
    max_call_s: float = Field(900.0, gt=0)
    idle_timeout_s: float = Field(20.0, gt=0)  # no `media` from Twilio (it sends silence too) this long
    ready_timeout_s: float = Field(15.0, gt=0)  # session admission + prompt prefill
    stream_connect_timeout_s: float = Field(20.0, gt=0)  # webhook answered -> `start` received
    # Outbound pacing: never let Twilio hold more than `max_queued_ms` of our audio; keep
    # `playout_cushion_ms` there (silence at the start) so late engine frames leave no gap.
    max_queued_ms: float = Field(100.0, ge=40.0, le=1000.0)
    playout_cushion_ms: float = Field(40.0, ge=0.0, le=500.0)
    # Audio from the engine waiting to be paced out; beyond this the oldest is dropped.
    max_buffered_ms: float = Field(400.0, ge=100.0, le=5000.0)
    # How long before each engine tick the caller's next 80 ms frame should be complete: inbound
    # messages may come this much late without leaving the agent a gap. Set once per call by a
    # little silence ahead of the caller's audio, phased against the engine's frame clock.
    inbound_slack_ms: float = Field(30.0, ge=0.0, le=70.0)
    max_message_bytes: int = Field(64 * 1024, ge=1024)  # a 20 ms media message is ~250 bytes
    # DTMF digits that hang the call up (e.g. "#"); every digit is logged as a session event.
    hangup_digits: str = ""
    busy_message: str = "Sorry, all our agents are busy right now. Please call again later."
    status_callback_events: tuple[str, ...] = ("initiated", "ringing", "answered", "completed")
    # A call whose engine worker died hears this, then the call ends; or, when `engine_lost_twiml`
    # is set, the call follows it instead: an http(s) URL of your TwiML, or TwiML text.
    engine_lost_message: str = "Sorry, we lost the connection to our agent. Please call again."
    engine_lost_twiml: str = ""
    # A `play` action that resumes the agent holds the call's session this long for its return.
    resume_timeout_s: float = Field(60.0, gt=0, le=600)

    # Call records (docs/contact-center.md): the folder (the server's `--records-dir` sets it),
    # kept this many days and up to this many MiB in all (the oldest go first).
    records_dir: Path | None = None
    records_max_age_days: float = Field(30.0, gt=0)
    records_max_mb: float = Field(2048.0, gt=0)
    # Post-call webhooks: the HMAC secret (a persona's `webhook_secret_env` may name another),
    # how long one delivery is retried, its first back-off and each attempt's timeout.
    webhook_secret: SecretStr = SecretStr("")
    webhook_retry_s: float = Field(300.0, ge=0)
    webhook_backoff_s: float = Field(1.0, gt=0)
    webhook_timeout_s: float = Field(5.0, gt=0, le=60)

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
                raise ValueError(f"PUBLIC_URL must look like https://host[:port][/prefix], got {value!r}")
        return value

    @field_validator("engine_lost_twiml")
    @classmethod
    def _check_fallback(cls, value: str) -> str:
        value = value.strip()
        if value and not value.startswith(("http://", "https://", "<")):
            raise ValueError("ENGINE_LOST_TWIML must be an http(s) URL or TwiML text (<Response>…)")
        return value

    @field_validator("records_dir", mode="before")
    @classmethod
    def _empty_dir_is_none(cls, value: object) -> object:
        return None if value in ("", None) else value

    @model_validator(mode="after")
    def _cushion_fits(self) -> TwilioSettings:
        if self.playout_cushion_ms + 20 > self.max_queued_ms:
            raise ValueError(
                f"playout_cushion_ms ({self.playout_cushion_ms:g}) + one 20 ms message must fit in "
                f"max_queued_ms ({self.max_queued_ms:g})"
            )
        return self

    @property
    def validate_signatures(self) -> bool:
        return not self.dev_skip_signature

    def check(self) -> None:
        """Refuse to run in a state where every Twilio request would be rejected or unsafe."""
        if self.validate_signatures and not self.auth_token.get_secret_value():
            raise UserError(
                "the Twilio bridge needs TWILIO_AUTH_TOKEN to check request signatures "
                "(for local development only: PERSONAPLEX_TWILIO_DEV_SKIP_SIGNATURE=1)"
            )
