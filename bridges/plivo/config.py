"""Settings of the Plivo carrier: Plivo's own variable names for its credentials, the rest
`PERSONAPLEX_PLIVO_*`."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from personaplex_voice.errors import UserError


class PlivoSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PERSONAPLEX_PLIVO_", extra="ignore", populate_by_name=True)

    auth_id: str = Field("", validation_alias=AliasChoices("PLIVO_AUTH_ID", "auth_id"))
    # Signs every request Plivo makes to us (V3 signatures) and authenticates our REST calls.
    auth_token: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("PLIVO_AUTH_TOKEN", "auth_token")
    )
    api_url: str = "https://api.plivo.com"
    # The bidirectional stream's audio, both ways: L16 at 16 kHz (wideband, the default) or
    # μ-law at 8 kHz.
    content_type: Literal["audio/x-l16;rate=16000", "audio/x-l16;rate=8000", "audio/x-mulaw;rate=8000"] = (
        "audio/x-l16;rate=16000"
    )
    dev_skip_signature: bool = False

    def check(self, validate: bool) -> None:
        if validate and not self.dev_skip_signature and not self.auth_token.get_secret_value():
            raise UserError(
                "the Plivo carrier needs PLIVO_AUTH_TOKEN to check request signatures "
                "(for local development only: PERSONAPLEX_PLIVO_DEV_SKIP_SIGNATURE=1)"
            )
