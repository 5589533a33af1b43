"""Settings of the jambonz carrier: jambonz's own name for its webhook secret, the rest
`PERSONAPLEX_JAMBONZ_*`."""

from __future__ import annotations

from typing import Literal

from personaplex_phone.config import CarrierSettings, carrier_config
from pydantic import AliasChoices, Field, SecretStr


class JambonzSettings(CarrierSettings):
    model_config = carrier_config("PERSONAPLEX_JAMBONZ_")

    # The account's webhook secret (jambonz portal: Account > Webhook secret): jambonz signs
    # every webhook with it (`Jambonz-Signature`).
    webhook_secret: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("JAMBONZ_WEBHOOK_SECRET", "webhook_secret")
    )
    # A signature older (or further ahead) than this is refused: a replay.
    max_signature_age_s: float = Field(300.0, gt=0, le=3600)
    # The listen verb's audio, both ways (L16, little-endian). jambonz has no default for the
    # rate of what we send back, so it is always set. 24 kHz is the model's own rate: no
    # resampling here, and whatever the line carries above 4 kHz (G.722, Opus) reaches the agent.
    sample_rate: Literal[8000, 16000, 24000] = 24000

    def check(self, validate: bool) -> None:
        self.require_secret(
            validate,
            bool(self.webhook_secret.get_secret_value()),
            "the jambonz carrier needs JAMBONZ_WEBHOOK_SECRET (the account's webhook secret) to "
            "check signed webhooks",
        )
