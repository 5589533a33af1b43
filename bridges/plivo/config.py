"""Settings of the Plivo carrier: Plivo's own variable names for its credentials, the rest
`PERSONAPLEX_PLIVO_*`."""

from __future__ import annotations

from typing import Literal

from personaplex_phone.config import CarrierSettings, carrier_config
from pydantic import AliasChoices, Field, SecretStr


class PlivoSettings(CarrierSettings):
    model_config = carrier_config("PERSONAPLEX_PLIVO_")

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

    def check(self, validate: bool) -> None:
        self.require_secret(
            validate,
            bool(self.auth_token.get_secret_value()),
            "the Plivo carrier needs PLIVO_AUTH_TOKEN to check request signatures",
        )
