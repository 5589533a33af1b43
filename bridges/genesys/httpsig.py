"""HTTP Message Signatures (the IETF httpbis draft Genesys signs with) for the Audio Connector's
WebSocket upgrade: the few Structured Field Values (RFC 8941) they need, the signature base, and
HMAC-SHA256 over it.

Genesys sends, beside `X-API-KEY`:

    Signature-Input: sig1=("@request-target" "@authority" "audiohook-organization-id"
        "audiohook-session-id" "audiohook-correlation-id" "x-api-key");keyid="<the API key>";
        nonce="<random>";alg="hmac-sha256";created=<unix s>;expires=<unix s>
    Signature: sig1=:<base64 HMAC-SHA256>:

The signed text is one line per covered component, `"<name>": <value>` (a header's value
trimmed; `@request-target` the path and query it asked for, `@authority` the host it dialled),
then `"@signature-params": ` and the inner list above re-serialized; the key is the client
secret of the integration, base64-decoded.

Pure functions and one small class (the nonces seen): no sockets, no settings.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAX_FIELD = 4096  # longer Signature-Input / Signature fields are refused unread
CLOCK_SKEW_S = 5.0
MIN_NONCE = 22  # Genesys's nonces are 24 characters (18 random bytes, base64)
REQUIRED = (
    "@request-target",
    "@authority",
    "audiohook-organization-id",
    "audiohook-session-id",
    "audiohook-correlation-id",
    "x-api-key",
)
DERIVED = {"@request-target", "@authority", "@method", "@scheme", "@target-uri", "@path", "@query"}
# RFC 8941's character classes are ASCII: `str.isdigit` and friends also take "²", "٣", "é".
DIGIT = frozenset("0123456789")
LCALPHA = frozenset("abcdefghijklmnopqrstuvwxyz")
ALPHA = LCALPHA | frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
KEY_START, KEY_CHARS = LCALPHA | {"*"}, LCALPHA | DIGIT | frozenset("_-.*")
TOKEN_START, TOKEN_CHARS = ALPHA | {"*"}, ALPHA | DIGIT | frozenset("!#$%&'*+-.^_`|~:/")
INTEGER_START = DIGIT | {"-"}


class SfError(ValueError):
    """A field that is not the Structured Field it must be."""


@dataclass(frozen=True)
class Token:
    value: str


Bare = str | int | bool | bytes | Token
Params = list[tuple[str, Bare]]


@dataclass(frozen=True)
class InnerList:
    items: list[tuple[Bare, Params]]
    params: Params


# --- Structured Field Values (RFC 8941): the subset signatures use ---------------------------------


class _Reader:
    def __init__(self, text: str):
        self.text = text
        self.at = 0

    def peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""

    def take(self, char: str) -> None:
        if self.peek() != char:
            raise SfError(f"expected {char!r} at {self.at}")
        self.at += 1

    def spaces(self) -> None:
        while self.peek() == " ":
            self.at += 1

    def ows(self) -> None:
        while self.peek() in (" ", "\t") and self.peek():
            self.at += 1

    def key(self) -> str:
        start = self.at
        if not self.peek() or self.peek() not in KEY_START:
            raise SfError(f"a key expected at {self.at}")
        while self.peek() and self.peek() in KEY_CHARS:
            self.at += 1
        return self.text[start : self.at]

    def bare(self) -> Bare:
        char = self.peek()
        if char == '"':
            return self.string()
        if char == ":":
            return self.bytes_()
        if char == "?":
            self.at += 1
            value = self.peek()
            if value not in ("0", "1"):
                raise SfError("a boolean is ?0 or ?1")
            self.at += 1
            return value == "1"
        if char and char in INTEGER_START:
            return self.integer()
        if char and char in TOKEN_START:
            start = self.at
            while self.peek() and self.peek() in TOKEN_CHARS:
                self.at += 1
            return Token(self.text[start : self.at])
        raise SfError(f"an item expected at {self.at}")

    def string(self) -> str:
        self.take('"')
        out = []
        while True:
            char = self.peek()
            if not char:
                raise SfError("an unterminated string")
            self.at += 1
            if char == "\\":
                escaped = self.peek()
                if escaped not in ('"', "\\"):
                    raise SfError("a bad escape in a string")
                out.append(escaped)
                self.at += 1
            elif char == '"':
                return "".join(out)
            elif not (" " <= char <= "~"):
                raise SfError("a string holds printable ASCII only")
            else:
                out.append(char)

    def bytes_(self) -> bytes:
        self.take(":")
        end = self.text.find(":", self.at)
        if end < 0:
            raise SfError("an unterminated byte sequence")
        chunk = self.text[self.at : end]
        self.at = end + 1
        try:
            return base64.b64decode(chunk, validate=True)
        except (binascii.Error, ValueError):
            raise SfError("a byte sequence that is not base64") from None

    def integer(self) -> int:
        start = self.at
        if self.peek() == "-":
            self.at += 1
        while self.peek() and self.peek() in DIGIT:
            self.at += 1
        digits = self.text[start : self.at]
        if digits in ("", "-") or len(digits.lstrip("-")) > 15:
            raise SfError("a bad integer")
        return int(digits)

    def params(self) -> Params:
        out: Params = []
        while self.peek() == ";":
            self.at += 1
            self.spaces()
            name = self.key()
            value: Bare = True
            if self.peek() == "=":
                self.at += 1
                value = self.bare()
            out.append((name, value))
        return out

    def inner_list(self) -> InnerList:
        self.take("(")
        items: list[tuple[Bare, Params]] = []
        while True:
            self.spaces()
            if self.peek() == ")":
                self.at += 1
                return InnerList(items, self.params())
            items.append((self.bare(), self.params()))
            if self.peek() not in (" ", ")"):
                raise SfError("inner list items are separated by spaces")


def parse_dictionary(text: str) -> dict[str, InnerList | tuple[Bare, Params]]:
    """An RFC 8941 Dictionary whose members are Inner Lists or Items."""
    if len(text) > MAX_FIELD:
        raise SfError("the field is too long")
    reader = _Reader(text.strip())
    out: dict[str, InnerList | tuple[Bare, Params]] = {}
    while reader.peek():
        name = reader.key()
        if reader.peek() == "=":
            reader.at += 1
            if reader.peek() == "(":
                out[name] = reader.inner_list()
            else:
                value = reader.bare()
                out[name] = (value, reader.params())
        else:
            out[name] = (True, reader.params())
        reader.ows()
        if not reader.peek():
            break
        reader.take(",")
        reader.ows()
        if not reader.peek():
            raise SfError("a trailing comma")
    return out


def serialize_bare(value: Bare) -> str:
    if isinstance(value, bool):
        return "?1" if value else "?0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, bytes):
        return ":" + base64.b64encode(value).decode("ascii") + ":"
    if isinstance(value, Token):
        return value.value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def serialize_params(params: Params) -> str:
    return "".join(f";{k}" if v is True else f";{k}={serialize_bare(v)}" for k, v in params)


def serialize_inner_list(inner: InnerList) -> str:
    items = " ".join(serialize_bare(v) + serialize_params(p) for v, p in inner.items)
    return f"({items}){serialize_params(inner.params)}"


# --- verification ---------------------------------------------------------------------------------


def canonical(value: str) -> str:
    """A header field's value as signed: trimmed, obsolete line folding made one space."""
    return " ".join(part.strip() for part in value.strip().splitlines())


@dataclass(frozen=True)
class Request:
    """What of the upgrade request a signature can cover."""

    request_target: str  # path and query, as the platform requested them
    authority: str  # the host it dialled (no default port)
    header: Callable[[str], str | None]  # a header field's canonical value (lower-case name)


def signature_base(inner: InnerList, request: Request) -> str:
    lines = []
    for name, params in inner.items:
        if not isinstance(name, str) or params:
            raise SfError("covered components are plain strings")
        if name.startswith("@"):
            if name == "@request-target":
                value: str | None = request.request_target
            elif name == "@authority":
                value = request.authority
            else:
                raise SfError(f"the derived component {name} is not supported")
        else:
            value = request.header(name)
        if value is None:
            raise SfError(f"the covered header {name} is missing")
        lines.append(f"{serialize_bare(name)}: {value}")
    lines.append(f'"@signature-params": {serialize_inner_list(inner)}')
    return "\n".join(lines)


def sign(key: bytes, inner: InnerList, request: Request) -> bytes:
    return hmac.new(key, signature_base(inner, request).encode(), hashlib.sha256).digest()


class SignatureVerifier:
    """Checks one request's signature; remembers the nonces of the last `max_age_s` (a replay of
    a signed upgrade within its lifetime is refused too)."""

    MAX_NONCES = 100_000

    def __init__(self, key: bytes, max_age_s: float):
        self.key = key
        self.max_age_s = max_age_s
        self._nonces: OrderedDict[str, float] = OrderedDict()

    def verify(
        self, headers: Mapping[str, str], api_key: str, request: Request, now: float | None = None
    ) -> str:
        """ "" when the request is signed as Genesys signs it, else why not (for the log)."""
        now = time.time() if now is None else now
        try:
            inputs = parse_dictionary(headers.get("signature-input", ""))
            values = parse_dictionary(headers.get("signature", ""))
        except ValueError as exc:  # SfError, and anything else a field's text can raise
            return f"unreadable signature fields ({exc})"
        if not inputs:
            return "unsigned (no Signature-Input)"
        label, inner = next(iter(inputs.items()))
        signature = values.get(label)
        if not isinstance(inner, InnerList) or not isinstance(signature, tuple):
            return "Signature-Input and Signature do not match"
        given = signature[0]
        if not isinstance(given, bytes):
            return "the signature is not a byte sequence"
        params = dict(inner.params)
        covered = {name for name, _ in inner.items}
        missing = [c for c in REQUIRED if c not in covered]
        if missing:
            return f"the signature does not cover {', '.join(missing)}"
        if params.get("keyid") != api_key:
            return "the signature's keyid is not the X-API-KEY"
        if params.get("alg", "hmac-sha256") != "hmac-sha256":
            return f"unsupported algorithm {params.get('alg')!r}"
        nonce = params.get("nonce")
        if not isinstance(nonce, str) or len(nonce) < MIN_NONCE:
            return "no nonce, or one too short"
        created, expires = params.get("created"), params.get("expires")
        if not isinstance(created, int) or isinstance(created, bool):
            return "no `created` time"
        if created > now + CLOCK_SKEW_S:
            return "signed in the future"
        if created + self.max_age_s < now - CLOCK_SKEW_S:
            return "the signature is too old"
        if isinstance(expires, int) and not isinstance(expires, bool) and expires < now - CLOCK_SKEW_S:
            return "the signature has expired"
        try:
            expected = sign(self.key, inner, request)
        except SfError as exc:
            return str(exc)
        if not hmac.compare_digest(expected, given):
            return "wrong signature"
        self._forget_old(now)
        if nonce in self._nonces:
            return "a signature seen before (a replay)"
        self._nonces[nonce] = now
        return ""

    def _forget_old(self, now: float) -> None:
        horizon = now - self.max_age_s - 2 * CLOCK_SKEW_S
        while self._nonces and (
            len(self._nonces) >= self.MAX_NONCES or next(iter(self._nonces.values())) < horizon
        ):
            self._nonces.popitem(last=False)


def signed_headers(
    key: bytes,
    api_key: str,
    request_target: str,
    authority: str,
    headers: Mapping[str, str],
    nonce: str,
    created: int | None = None,
    lifetime_s: int = 30,
) -> dict[str, str]:
    """`Signature-Input` and `Signature` as Genesys sends them (the simulator's, the tests')."""
    created = int(time.time()) if created is None else created
    lower = {k.lower(): v for k, v in headers.items()}
    lower["x-api-key"] = api_key
    inner = InnerList(
        [(name, []) for name in REQUIRED],
        [
            ("keyid", api_key),
            ("nonce", nonce),
            ("alg", "hmac-sha256"),
            ("created", created),
            ("expires", created + lifetime_s),
        ],
    )
    request = Request(request_target, authority, lambda name: lower.get(name))
    signature = sign(key, inner, request)
    return {
        "Signature-Input": f"sig1={serialize_inner_list(inner)}",
        "Signature": f"sig1={serialize_bare(signature)}",
    }
