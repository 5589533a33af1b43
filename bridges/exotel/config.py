"""Settings of the Exotel carrier: Exotel's own names for its credentials, the rest
`PERSONAPLEX_EXOTEL_*`."""

from __future__ import annotations

from typing import Literal

from personaplex_phone.config import CarrierSettings, carrier_config
from pydantic import AliasChoices, Field, SecretStr


class ExotelSettings(CarrierSettings):
    model_config = carrier_config("PERSONAPLEX_EXOTEL_")

    # Exotel authenticates the stream's WebSocket with HTTP Basic, API key and token (the `wss://`
    # URL we answer holds `KEY:TOKEN@`, which Exotel sends as `Authorization: Basic`); our REST
    # calls use them too.
    api_key: str = Field("", validation_alias=AliasChoices("EXOTEL_API_KEY", "api_key"))
    api_token: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("EXOTEL_API_TOKEN", "api_token")
    )
    account_sid: str = Field("", validation_alias=AliasChoices("EXOTEL_ACCOUNT_SID", "account_sid"))
    # Mumbai accounts: https://cpaas-api.in.exotel.com
    api_url: str = "https://cpaas-api.exotel.com"
    # The Voicebot stream's rate (`?sample-rate=` on its URL): 8000 (Exotel's default, the phone
    # network's), 16000 or 24000.
    sample_rate: Literal[8000, 16000, 24000] = 8000
    # Exotel documents no credentials for the applet's HTTPS (dynamic) URL fetch: put this token
    # in its query, `https://host/exotel/answer?token=…` (and the status callback's). A fetch
    # that carries HTTP Basic credentials instead is checked against the API key and token.
    answer_token: SecretStr = SecretStr("")

    def check(self, validate: bool) -> None:
        self.require_secret(
            validate,
            bool(self.api_key and self.api_token.get_secret_value()),
            "the Exotel carrier needs EXOTEL_API_KEY and EXOTEL_API_TOKEN: the stream's WebSocket "
            "carries them as HTTP Basic credentials",
        )
