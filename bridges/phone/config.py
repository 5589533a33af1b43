"""Settings of the phone call (every carrier), read from the environment.

Each is `PERSONAPLEX_PHONE_<NAME>`; the Twilio bridge's older names `PERSONAPLEX_TWILIO_<NAME>` are
read too when the new one is not set, so a Twilio deployment keeps working unchanged. The public
base URL is `PUBLIC_URL`, the name tunnels and PaaS hosts commonly set. Carrier secrets live in
each carrier's own settings (their standard names: `TWILIO_AUTH_TOKEN`, `TELNYX_PUBLIC_KEY`, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from personaplex_voice.errors import UserError

PHONE_PREFIX = "PERSONAPLEX_PHONE_"
LEGACY_PREFIX = "PERSONAPLEX_TWILIO_"


class PhoneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PHONE_PREFIX, extra="ignore", populate_by_name=True)
    # Environment prefixes read after this class's own, in order (the older names).
    fallback_prefixes: ClassVar[tuple[str, ...]] = (LEGACY_PREFIX,)

    # Base URL the carriers reach us at, e.g. https://abc.ngrok.app. Webhook signatures are checked
    # against it (a proxy or tunnel rewrites the Host the server sees) and its scheme picks the
    # stream URLs': https -> wss, http -> ws. Empty: derived from each request (direct exposure only).
    public_url: str = Field("", validation_alias=AliasChoices("PUBLIC_URL", "public_url"))
    # Development only: accept unsigned webhooks and WebSocket upgrades (every carrier).
    dev_skip_signature: bool = False
    # YAML/JSON file: named personas, called number -> persona, default persona.
    personas_file: Path | None = None
    # Bearer token that guards the call list, records and outbound calls; empty disables them.
    api_token: SecretStr = SecretStr("")

    # Per-call limits. The caller is told goodbye by a hang-up via the carrier's REST API.
    max_call_s: float = Field(900.0, gt=0)
    idle_timeout_s: float = Field(20.0, gt=0)  # no media from the carrier (it sends silence too) this long
    ready_timeout_s: float = Field(15.0, gt=0)  # session admission + prompt prefill
    stream_connect_timeout_s: float = Field(20.0, gt=0)  # answer webhook answered -> stream started
    # Outbound pacing: never let the carrier hold more than `max_queued_ms` of our audio; keep
    # `playout_cushion_ms` there (silence at the start) so late engine frames leave no gap.
    max_queued_ms: float = Field(100.0, ge=40.0, le=1000.0)
    playout_cushion_ms: float = Field(40.0, ge=0.0, le=500.0)
    # Audio from the engine waiting to be paced out; beyond this the oldest is dropped.
    max_buffered_ms: float = Field(400.0, ge=100.0, le=5000.0)
    # How long before each engine tick the caller's next 80 ms frame should be complete: inbound
    # messages may come this much late without leaving the agent a gap. Set once per call by a
    # little silence ahead of the caller's audio, phased against the engine's frame clock.
    inbound_slack_ms: float = Field(30.0, ge=0.0, le=70.0)
    max_message_bytes: int = Field(64 * 1024, ge=1024)  # a 20 ms media message is 250-900 bytes
    # Barge-in: when the caller starts talking while the agent's audio is still to be heard,
    # drop that audio (the carrier's clear). Unset: as the carrier says (its `barge_in`
    # attribute; on for Asterisk, off elsewhere, where the carrier's buffer is kept short
    # instead); true or false: for every carrier. `barge_in_db`: how loud (RMS dBFS) a caller
    # message must be to count as talking (barge_in.py).
    barge_in: bool | None = None
    barge_in_db: float = Field(-35.0, ge=-70.0, le=-6.0)
    # DTMF digits that hang the call up (e.g. "#"); every digit is logged as a session event.
    hangup_digits: str = ""
    busy_message: str = "Sorry, all our agents are busy right now. Please call again later."
    # A call whose engine worker died hears this, then the call ends (a carrier may offer more).
    engine_lost_message: str = "Sorry, we lost the connection to our agent. Please call again."
    # A `play` action that resumes the agent holds the call's session this long for its return.
    resume_timeout_s: float = Field(60.0, gt=0, le=600)
    # Carriers' REST APIs (hang-up, transfer): each request's time limit.
    rest_timeout_s: float = Field(10.0, gt=0, le=60)

    # Call records (docs/contact-center.md): the folder (the server's `--records-dir` sets it),
    # kept this many days and up to this many MiB in all (the oldest go first). Without a folder
    # records go to a private temporary one, kept at most `temp_records_mb`.
    records_dir: Path | None = None
    records_max_age_days: float = Field(30.0, gt=0)
    records_max_mb: float = Field(2048.0, gt=0)
    temp_records_mb: float = Field(64.0, gt=0)
    # Post-call webhooks: the HMAC secret (a persona's `webhook_secret_env` may name another),
    # how long one delivery is retried, its first back-off and each attempt's timeout.
    webhook_secret: SecretStr = SecretStr("")
    webhook_retry_s: float = Field(300.0, ge=0)
    webhook_backoff_s: float = Field(1.0, gt=0)
    webhook_timeout_s: float = Field(5.0, gt=0, le=60)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        older = tuple(EnvSettingsSource(settings_cls, env_prefix=p) for p in cls.fallback_prefixes)
        return (init_settings, env_settings, *older, dotenv_settings, file_secret_settings)

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
                raise ValueError(f"PUBLIC_URL must look like https://host[:port][/prefix], got {value!r}")
        return value

    @field_validator("records_dir", "personas_file", mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: object) -> object:
        return None if value in ("", None) else value

    @model_validator(mode="after")
    def _cushion_fits(self) -> Any:
        if self.playout_cushion_ms + 20 > self.max_queued_ms:
            raise ValueError(
                f"playout_cushion_ms ({self.playout_cushion_ms:g}) + one 20 ms message must fit in "
                f"max_queued_ms ({self.max_queued_ms:g})"
            )
        return self

    @property
    def validate_signatures(self) -> bool:
        return not self.dev_skip_signature


def carrier_config(prefix: str) -> SettingsConfigDict:
    """A carrier settings class's config: its own `PERSONAPLEX_<NAME>_` prefix; the carrier's
    own variable names (TWILIO_AUTH_TOKEN, ...) are fields' aliases."""
    return SettingsConfigDict(env_prefix=prefix, extra="ignore", populate_by_name=True)


class CarrierSettings(BaseSettings):
    """What a carrier's settings share: the development switch that accepts its requests
    unsigned, and the check that refuses to start without the secret its signatures need."""

    dev_skip_signature: bool = False

    def require_secret(self, validate: bool, present: bool, problem: str) -> None:
        """UserError(`problem`, and the development switch) when requests are to be checked and
        the secret to check them with (`present`) is missing."""
        if validate and not self.dev_skip_signature and not present:
            switch = f"{self.model_config.get('env_prefix', '')}DEV_SKIP_SIGNATURE=1"
            raise UserError(f"{problem} (for local development only: {switch})")
