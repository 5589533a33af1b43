"""The Asterisk carrier's settings, from the environment (`PERSONAPLEX_ASTERISK_*`; the ARI
credentials under the `ASTERISK_ARI_*` names). The phone call's own are `PhoneSettings`."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from personaplex_voice.errors import UserError


class AsteriskSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PERSONAPLEX_ASTERISK_", extra="ignore", populate_by_name=True
    )

    # HOST:PORT the AudioSocket listener binds (`serve --audiosocket`); empty: no listener. Keep it
    # on the network between Asterisk and this server only: AudioSocket has no authentication.
    audiosocket: str = ""
    # How to read audio kind 0x11: as the message lengths say (auto), or always 12 or 16 kHz.
    audiosocket_0x11: Literal["auto", "slin12", "slin16"] = "auto"
    # A new AudioSocket connection must send its UUID this soon.
    audiosocket_uuid_timeout_s: float = Field(5.0, gt=0, le=60)
    # websocket_client.conf's `username`/`password` for the media connection (optional): when
    # set, a chan_websocket upgrade must carry them (HTTP Basic) as well as its UUID.
    media_username: str = ""
    media_password: SecretStr = SecretStr("")
    # ARI (optional): actions then act on the caller's channel through ARI (it must be in your
    # Stasis application): PERSONAPLEX_* channel variables set, the channel sent on in the
    # dialplan at `ari_context`, extension = the action; a hang-up deletes the channel.
    ari_url: str = Field("", validation_alias=AliasChoices("ASTERISK_ARI_URL", "ari_url"))
    ari_username: str = Field("", validation_alias=AliasChoices("ASTERISK_ARI_USERNAME", "ari_username"))
    ari_password: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("ASTERISK_ARI_PASSWORD", "ari_password")
    )
    ari_context: str = "personaplex-next"

    @field_validator("ari_url")
    @classmethod
    def _check_ari_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"ASTERISK_ARI_URL must look like http://pbx:8088/ari, got {value!r}")
        return value

    @property
    def rate_0x11(self) -> int | None:
        return {"slin12": 12000, "slin16": 16000}.get(self.audiosocket_0x11)

    @property
    def ari(self) -> bool:
        return bool(self.ari_url)


def parse_listen(value: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 in brackets: `[::1]:9092`) -> (host, port)."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UserError(f"--audiosocket must be HOST:PORT (e.g. 10.0.0.5:9092), got {value!r}")
    return host, int(port)
