"""Settings of the Vonage carrier: Vonage's own variable names for its secrets, the rest
`PERSONAPLEX_VONAGE_*`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from personaplex_phone.config import CarrierSettings, carrier_config
from pydantic import AliasChoices, Field, SecretStr

from personaplex_voice.errors import UserError


class VonageSettings(CarrierSettings):
    model_config = carrier_config("PERSONAPLEX_VONAGE_")

    # Signed webhooks: the account's signature secret (Dashboard > API settings), HS256 key of
    # the JWT in each webhook's Authorization header.
    signature_secret: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("VONAGE_SIGNATURE_SECRET", "signature_secret")
    )
    # REST calls (hang-up, transfer) are authorised by a JWT signed with the application's key.
    application_id: str = Field("", validation_alias=AliasChoices("VONAGE_APPLICATION_ID", "application_id"))
    private_key: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("VONAGE_PRIVATE_KEY", "private_key")
    )  # PEM text, or the path of the .key file
    api_url: str = "https://api.nexmo.com"
    # A webhook's JWT issued longer ago than this is refused (a replay).
    max_token_age_s: float = Field(300.0, gt=0, le=3600)
    # The WebSocket's audio, both ways: L16 at 16 kHz (wideband, the default) or 8 kHz.
    sample_rate: Literal[8000, 16000] = 16000

    def private_key_pem(self) -> str:
        value = self.private_key.get_secret_value().strip()
        if value and "-----BEGIN" not in value:
            try:
                return Path(value).expanduser().read_text()
            except OSError as exc:
                raise UserError(f"VONAGE_PRIVATE_KEY: {value}: {exc.strerror or exc}") from None
        return value.replace("\\n", "\n")

    def check(self, validate: bool) -> None:
        self.require_secret(
            validate,
            bool(self.signature_secret.get_secret_value()),
            "the Vonage carrier needs VONAGE_SIGNATURE_SECRET to check signed webhooks (turn on "
            "signed webhooks for the application)",
        )
        if self.private_key.get_secret_value():
            self.private_key_pem()
