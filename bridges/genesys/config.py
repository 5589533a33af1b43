"""Settings of the Genesys Cloud carrier: the Audio Connector integration's credentials under
Genesys's names, the rest `PERSONAPLEX_GENESYS_*`."""

from __future__ import annotations

import base64
import binascii

from personaplex_phone.config import CarrierSettings, carrier_config
from pydantic import AliasChoices, Field, SecretStr

from personaplex_voice.errors import UserError


class GenesysSettings(CarrierSettings):
    model_config = carrier_config("PERSONAPLEX_GENESYS_")

    # The integration's API key: every connection carries it as `X-API-KEY`.
    api_key: SecretStr = Field(SecretStr(""), validation_alias=AliasChoices("GENESYS_API_KEY", "api_key"))
    # The integration's client secret (base64, as Genesys shows it): when set, every connection
    # must carry an HTTP message signature made with it.
    client_secret: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("GENESYS_CLIENT_SECRET", "client_secret")
    )
    # A signature created longer ago than this is refused (Genesys signs as it connects).
    max_signature_age_s: float = Field(10.0, gt=0, le=300)
    # Our audio goes to Genesys in messages this long (PCMU 8 kHz): Genesys limits how many
    # messages a second a connector may send (an `error` 429 says so), so not 20 ms ones. The
    # price: up to two messages are queued at Genesys (the pacer keeps the next one coming).
    message_ms: int = Field(100, ge=20, le=400, multiple_of=20)

    def secret_key(self) -> bytes:
        """The HMAC key: the client secret, base64-decoded."""
        secret = self.client_secret.get_secret_value().strip()
        try:
            return base64.b64decode(secret, validate=True)
        except (binascii.Error, ValueError):
            raise UserError(
                "GENESYS_CLIENT_SECRET must be the integration's client secret as Genesys shows it (base64)"
            ) from None

    def check(self, validate: bool) -> None:
        self.require_secret(
            validate,
            bool(self.api_key.get_secret_value()),
            "the Genesys carrier needs GENESYS_API_KEY (the Audio Connector integration's API key) "
            "to check every connection",
        )
        if self.client_secret.get_secret_value():
            self.secret_key()
