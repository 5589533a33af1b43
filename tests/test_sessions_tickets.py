"""Reservation tickets: `reserve(ttl)` sets a slot aside for exactly one later `open(ticket=...)`."""

from __future__ import annotations

import asyncio
import time

import pytest
from support_sessions import audio, collect, wait_until

from personaplex_voice.engine.base import CapacityError, Persona, PersonaError
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import TicketError

pytestmark = pytest.mark.timeout(60)


async def test_a_reserved_slot_is_taken_for_everybody_but_its_ticket(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1), max_queue=1)
    ticket = manager.reserve(ttl_s=30, persona=Persona(text_prompt="promised"))
    assert manager.available == 0 and manager.reserved_count == 1
    assert manager.metrics.reserved_slots.value == 1
    with pytest.raises(CapacityError):
        manager.reserve(ttl_s=30)  # no second promise of the same slot

    walk_in = await manager.open(Persona(text_prompt="walk-in"))
    assert walk_in.queue_position == 1  # queued behind the reservation, not admitted

    holder = await manager.open(None, ticket=ticket.id)
    assert holder.slot == 0 and holder.persona.text_prompt == "promised"
    assert manager.reserved_count == 0
    await asyncio.wait_for(holder.ready(), 5)
    with pytest.raises(TicketError):
        await manager.open(Persona(), ticket=ticket.id)  # one use only

    await holder.close()
    await asyncio.wait_for(walk_in.ready(), 5)  # the queue gets the slot once it is given back
    assert walk_in.slot == 0
    assert manager.metrics.tickets.values() == {"issued": 1.0, "refused": 2.0, "redeemed": 1.0}


async def test_an_unredeemed_ticket_expires_and_frees_its_slot(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1), max_queue=1)
    await manager.start()  # its thread expires tickets even when nobody asks
    ticket = manager.reserve(ttl_s=0.3)
    waiting = await manager.open(Persona(text_prompt="patient"))
    assert waiting.queue_position == 1
    started = time.monotonic()
    await asyncio.wait_for(waiting.ready(), 5)
    assert 0.25 <= time.monotonic() - started <= 1.5
    with pytest.raises(TicketError):
        await manager.open(Persona(), ticket=ticket.id)
    assert manager.metrics.tickets.values()["expired"] == 1


async def test_cancelled_tickets_free_their_slot_and_unknown_ones_are_refused(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=2))
    first, second = manager.reserve(ttl_s=30), manager.reserve(ttl_s=30)
    assert manager.available == 0
    with pytest.raises(CapacityError):
        await manager.open(Persona())
    assert manager.cancel(first.id) and not manager.cancel(first.id)
    assert manager.available == 1
    with pytest.raises(TicketError):
        await manager.open(Persona(), ticket="not-a-ticket")
    session = await manager.open(Persona(text_prompt="mine"), ticket=second.id)  # its own persona
    assert session.persona.text_prompt == "mine"
    x = audio(2, seed=5)
    await asyncio.wait_for(session.ready(), 5)
    session.push(x)
    session.end_input()
    assert len(await collect(session)) == 2


async def test_a_ticket_whose_persona_fails_gives_the_slot_back(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1))
    ticket = manager.reserve(ttl_s=30, persona=Persona(voice="NO-SUCH-VOICE"))
    with pytest.raises(PersonaError):
        await manager.open(None, ticket=ticket.id)
    assert manager.reserved_count == 0 and manager.available == 1
    with pytest.raises(PersonaError):
        await manager.open(None, ticket=manager.reserve(ttl_s=30).id)  # carries no persona
    await wait_until(lambda: manager.available == 1)


async def test_close_reasons_are_bounded_metric_labels(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1))
    session = await manager.open(Persona())
    await session.close(reason="protocol error: `mark` for another stream ('MZ999')")
    assert session.close_reason.startswith("protocol error")  # the full text stays for logs
    assert manager.metrics.sessions_closed.values() == {"other": 1.0}
