"""Settings of the Telnyx carrier: Telnyx's own variable names for its secrets, the rest
`PERSONAPLEX_TELNYX_*`."""

from __future__ import annotations

from typing import Literal

from personaplex_phone.config import CarrierSettings, carrier_config
from pydantic import AliasChoices, Field, SecretStr

from personaplex_voice.errors import UserError


class TelnyxSettings(CarrierSettings):
    model_config = carrier_config("PERSONAPLEX_TELNYX_")

    # The account's webhook signing key (Portal > Keys & Credentials > Public Key), base64 Ed25519.
    public_key: str = Field("", validation_alias=AliasChoices("TELNYX_PUBLIC_KEY", "public_key"))
    # The API key for call control (hang-up, transfer, TeXML call updates).
    api_key: SecretStr = Field(SecretStr(""), validation_alias=AliasChoices("TELNYX_API_KEY", "api_key"))
    api_url: str = "https://api.telnyx.com"
    # Webhooks signed longer ago than this (or ahead of our clock by as much) are refused: a
    # captured webhook cannot be replayed later.
    signature_tolerance_s: float = Field(300.0, gt=0, le=3600)
    # What we send back on the bidirectional stream. TeXML's <Stream> documents PCMU, PCMA,
    # G722, OPUS and AMR-WB for `bidirectionalCodec` (PCMU by default), so PCMU at 8 kHz is the
    # default; L16 (wideband, 16 kHz) is documented for Call Control's streaming, not TeXML: an
    # opt-in (`CODEC=L16 SAMPLE_RATE=16000`) for accounts where it is known to work.
    codec: Literal["L16", "PCMU", "PCMA"] = "PCMU"
    sample_rate: Literal[8000, 16000] = 8000

    def check(self, validate: bool) -> None:
        self.require_secret(
            validate,
            bool(self.public_key),
            "the Telnyx carrier needs TELNYX_PUBLIC_KEY (the base64 Ed25519 key of your account, "
            "Portal > Keys & Credentials) to check webhook signatures",
        )
        if self.codec != "L16" and self.sample_rate != 8000:
            raise UserError(f"PERSONAPLEX_TELNYX_CODEC={self.codec} is an 8 kHz codec: set SAMPLE_RATE=8000")
