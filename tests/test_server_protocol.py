"""The /api/chat wire format, query parsing, access checks and settings (no sockets)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from personaplex_voice.engine.base import Persona, Sampling
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server import access, protocol
from personaplex_voice.server.protocol import ChatParams, Kind, QueryError


def test_messages_round_trip_with_reference_kinds():
    assert protocol.encode_handshake() == b"\x00\x00\x00"
    assert protocol.encode_audio(b"OggS..") == b"\x01OggS.."
    assert protocol.encode_text(" héllo") == b"\x02" + " héllo".encode()
    assert protocol.encode_control(protocol.Control.RESTART) == b"\x03\x03"
    assert protocol.encode_error("full") == b"\x05full"
    assert protocol.encode_ping() == b"\x06"
    meta = protocol.decode(protocol.encode_metadata({"session_id": "x", "queue_position": 2}))
    assert (
        meta is not None
        and meta.kind == Kind.METADATA
        and meta.json() == {"session_id": "x", "queue_position": 2}
    )
    unknown = protocol.decode(b"\x42abc")
    assert unknown is not None and not unknown.known and unknown.payload == b"abc"
    assert protocol.decode(b"") is None


def test_query_values_become_a_persona():
    params = ChatParams.from_query(
        {
            "text_prompt": "You enjoy having a good conversation.",
            "voice_prompt": "NATF2.pt",
            "seed": "42",
            "text_temperature": "0.5",
            "text_topk": "30",
            "audio_temperature": "0.9",
            "audio_topk": "200.0",  # some clients send whole numbers as floats
            "pad_mult": "0",  # the reference client's extras are ignored
            "text_seed": "123",
        }
    )
    persona = params.persona()
    assert persona.voice == "NATF2.pt" and persona.seed == 42
    assert persona.sampling.text_temperature == 0.5 and persona.sampling.text_topk == 30
    assert persona.sampling.audio_temperature == 0.9 and persona.sampling.audio_topk == 200
    assert ChatParams.from_query({"seed": "-1"}).seed is None  # -1 = random, as in the reference client
    assert ChatParams.from_query({}).persona().voice is None
    again = ChatParams.from_query(params.to_query())
    assert again == params
    assert params.url("ws://h/api/chat", token="k").startswith("ws://h/api/chat?text_prompt=You+enjoy")


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ({"voice_prompt": "../../etc/passwd"}, "voice_prompt"),
        ({"voice_prompt": "/etc/passwd"}, "voice_prompt"),
        ({"voice_prompt": "a/b"}, "voice_prompt"),
        ({"voice_prompt": ".hidden"}, "voice_prompt"),
        ({"text_temperature": "abc"}, "text_temperature must be a number"),
        ({"text_temperature": "nan"}, "finite"),
        ({"audio_temperature": "-1"}, "audio_temperature"),
        ({"text_topk": "0"}, "text_topk must be between"),
        ({"audio_topk": "1.5"}, "audio_topk must be an integer"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"seed": "-2"}, "seed must be between"),
        ({"greedy": "perhaps"}, "greedy"),
        ({"text_prompt": "x" * 5000}, "text_prompt is too long"),
        ({"text_prompt": "a\x00b"}, "NUL"),
    ],
)
def test_bad_query_values_say_what_is_wrong(query, words):
    with pytest.raises(QueryError, match=words):
        ChatParams.from_query(query)


def test_api_key_from_query_bearer_or_header():
    settings = ServerSettings(api_key="s3cret")
    assert access.key_ok(settings, {}, {"token": "s3cret"})
    assert access.key_ok(settings, {"authorization": "Bearer s3cret"}, {})
    assert access.key_ok(settings, {"x-api-key": "s3cret"}, {})
    assert not access.key_ok(settings, {}, {})
    assert not access.key_ok(settings, {}, {"token": "wrong"})
    assert access.key_ok(ServerSettings(), {}, {})  # no key configured


def test_origin_allow_list():
    settings = ServerSettings(allowed_origins="https://a.example, https://b.example/")
    assert access.origin_ok(settings, {"origin": "https://b.example"})
    assert not access.origin_ok(settings, {"origin": "https://evil.example"})
    assert access.origin_ok(settings, {})  # non-browser clients send no Origin
    assert access.origin_ok(ServerSettings(), {"origin": "https://anything.example"})


def test_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PERSONAPLEX_MAX_SESSIONS", "7")
    monkeypatch.setenv("PERSONAPLEX_ENGINE", "echo")
    monkeypatch.setenv("PERSONAPLEX_SSL", str(tmp_path))
    settings = ServerSettings(port=1234)
    assert (settings.max_sessions, settings.engine, settings.port) == (7, "echo", 1234)
    assert settings.ssl_files() == (tmp_path / "cert.pem", tmp_path / "key.pem")
    assert settings.scheme == "https"
    assert ServerSettings(max_sessions=2).max_sessions == 2  # explicit values win over the env


def test_cli_reports_bad_settings_in_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "personaplex_voice.cli", "serve", "--engine", "banana"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "engine" in run.stderr and "Traceback" not in run.stderr
    (tmp_path / "key.pem").write_text("a key without its certificate")  # (an empty dir gets a pair)
    run = subprocess.run(
        [sys.executable, "-m", "personaplex_voice.cli", "serve", "--engine", "echo", "--ssl", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "cert.pem is not" in run.stderr


def test_echo_server_never_imports_torch():
    code = (
        "import sys, asyncio\n"
        "from fastapi.testclient import TestClient\n"
        "from personaplex_voice.server.app import create_app\n"
        "from personaplex_voice.process.settings import ServerSettings\n"
        "import personaplex_voice.cli\n"
        "app = create_app(ServerSettings(engine='echo', max_sessions=1))\n"
        "with TestClient(app) as client:\n"
        "    import time\n"
        "    for _ in range(100):\n"
        "        if client.get('/readyz').status_code == 200: break\n"
        "        time.sleep(0.05)\n"
        "    assert client.get('/api/voices').json()['voices']\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_twilio_flag_mounts_the_bridge_without_shadowing(monkeypatch):
    from fastapi.testclient import TestClient

    from personaplex_voice.errors import UserError
    from personaplex_voice.server.app import create_app

    monkeypatch.delenv("TWILIO_AUTH_TOKEN", raising=False)
    with pytest.raises(UserError, match="TWILIO_AUTH_TOKEN"):
        create_app(ServerSettings(engine="echo", max_sessions=1, twilio=True))

    monkeypatch.setenv("TWILIO_AUTH_TOKEN", "test-token")
    app = create_app(ServerSettings(engine="echo", max_sessions=1, twilio=True))
    with TestClient(app) as client:
        # The browser client is served for unmatched GETs only: /twilio/* still reaches the bridge.
        assert client.get("/twilio/calls").status_code != 404
        assert "PersonaPlex" in client.get("/").text


def test_a_persona_survives_the_query_string_round_trip():
    """What the remote Pipecat client sends is what the server rebuilds, sampling and seed included."""
    persona = Persona(
        text_prompt="You work for CitySan.",
        voice="NATF2",
        sampling=Sampling(
            text_temperature=0.5, text_topk=10, audio_temperature=0.9, audio_topk=100, greedy=True
        ),
        seed=1234,
    )
    params = ChatParams.from_persona(persona)
    assert params.persona() == persona
    assert ChatParams.from_query(params.to_query()).persona() == persona


@pytest.mark.parametrize(
    ("query", "shown"),
    [
        ({"seed": "9" * 30}, "got " + "9" * 30),  # not 1e30 rounded to another number
        ({"seed": "1e30"}, "got 1e30"),
        ({"text_topk": "1e30"}, "got 1e30"),
        ({"audio_topk": "0099999999999999999999"}, "got 0099999999999999999999"),
        ({"text_seed": "2147483648"}, "text_seed must be between -1 and 2147483647, got 2147483648"),
    ],
)
def test_numbers_in_errors_are_the_clients_own_text(query, shown):
    with pytest.raises(QueryError) as caught:
        ChatParams.from_query(query)
    assert str(caught.value).endswith(shown)


def test_text_and_audio_seeds_make_one_seed():
    # The reference client sends text_seed and audio_seed (never seed): a pair is one seed.
    pair = ChatParams.from_query({"text_seed": "123", "audio_seed": "456"}).seed
    assert pair == 123 * 2**32 + 456
    assert ChatParams.from_query({"audio_seed": "456", "text_seed": "123"}).seed == pair
    assert ChatParams.from_query({"text_seed": "123", "audio_seed": "457"}).seed != pair
    assert ChatParams.from_query({"text_seed": "-1", "audio_seed": "-1"}).seed is None
    assert ChatParams.from_query({"text_seed": "5"}).seed == 5 * 2**32
    assert ChatParams.from_query({"seed": "7", "text_seed": "5", "audio_seed": "6"}).seed == 7


def test_stored_prompts_expire_and_stay_bounded():
    from personaplex_voice.server.prompts import PromptStore

    now = [0.0]
    store = PromptStore(ttl_s=10, max_entries=3, clock=lambda: now[0])
    first = store.put("one")
    assert store.get(first) == "one" and store.get(first) == "one"  # reusable until it expires
    assert len(first) >= 22 and store.get("guess") is None
    ids = [store.put(f"p{i}") for i in range(3)]
    assert store.get(first) is None and len(store) == 3  # the oldest went first
    now[0] = 10.5
    assert all(store.get(i) is None for i in ids) and len(store) == 0


def test_model_paths_are_named_never_shown(tmp_path):
    from personaplex_voice.server import info

    model_dir = tmp_path / "models" / "secret-model"
    model_dir.mkdir(parents=True)
    assert info.public_model_name(str(model_dir)) == "secret-model"
    assert info.public_model_name("nvidia/personaplex-7b-v1") == "nvidia/personaplex-7b-v1"
    assert info.public_model_name("demo") == "demo"
    settings = ServerSettings(model=str(model_dir), moshi_weight=tmp_path / "w" / "lm.safetensors")
    line = f"loading model {model_dir} on cpu with {tmp_path}/w/lm.safetensors"
    assert str(tmp_path) not in info.redact_paths(line, settings)
    fields = info.reference_client_fields(settings, "x")
    assert fields["lm_model_file"] == "lm.safetensors"
