"""Settings of the jambonz carrier: jambonz's own name for its webhook secret, the rest
`PERSONAPLEX_JAMBONZ_*`."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from personaplex_voice.errors import UserError


class JambonzSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PERSONAPLEX_JAMBONZ_", extra="ignore", populate_by_name=True
    )

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
    dev_skip_signature: bool = False

    def check(self, validate: bool) -> None:
        if validate and not self.dev_skip_signature and not self.webhook_secret.get_secret_value():
            raise UserError(
                "the jambonz carrier needs JAMBONZ_WEBHOOK_SECRET (the account's webhook secret) to "
                "check signed webhooks (for local development only: "
                "PERSONAPLEX_JAMBONZ_DEV_SKIP_SIGNATURE=1)"
            )
