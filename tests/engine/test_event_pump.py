"""The engine thread's events reach the event loop in order, with one wake-up per batch."""

import asyncio
import threading
import time

import pytest

from nodraft.engine.client import EventPump


def count_wakeups(loop: asyncio.AbstractEventLoop) -> list:
    """The callbacks other threads hand ``loop`` from now on (a list that grows)."""
    wakeups = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args):
        wakeups.append(cb)
        return real(cb, *args)

    loop.call_soon_threadsafe = counting
    return wakeups


def test_events_arrive_in_order_with_one_wakeup_per_batch():
    async def main():
        loop = asyncio.get_running_loop()
        pump = EventPump(loop)
        wakeups = count_wakeups(loop)
        queues = [asyncio.Queue() for _ in range(4)]

        def engine_iteration(start):  # another thread posts a batch while the loop waits
            for i in range(start, start + 32):
                pump.post(queues[i % 4].put_nowait, i)

        for batch in range(3):
            t = threading.Thread(target=engine_iteration, args=(batch * 32,))
            t.start()
            t.join()  # the loop cannot drain until we await: the batch is one wake-up
            assert len(wakeups) == batch + 1
            await asyncio.sleep(0)
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        assert got == [list(range(k, 96, 4)) for k in range(4)]

    asyncio.run(main())


def test_a_closed_loop_refuses_and_keeps_nothing():
    loop = asyncio.new_event_loop()
    pump = EventPump(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        pump.post(asyncio.Queue().put_nowait, 1)
    assert pump._pending == []


def test_a_loop_closed_while_collecting_on_its_timer_refuses_too():
    loop = asyncio.new_event_loop()
    pump = EventPump(loop)
    pump.interval = 0.01
    queue = asyncio.Queue()
    pump.post(queue.put_nowait, 1)  # wakes the loop
    loop.run_until_complete(asyncio.sleep(0))  # hands it out, arms the timer
    loop.close()
    with pytest.raises(RuntimeError):
        pump.post(queue.put_nowait, 2)
    assert pump._pending == [] and queue.get_nowait() == 1


def test_one_pump_per_loop():
    loop = asyncio.new_event_loop()
    try:
        assert EventPump.for_loop(loop) is EventPump.for_loop(loop)
    finally:
        loop.close()


def test_a_busy_producer_wakes_the_loop_once_then_the_loop_collects_on_its_timer():
    async def main():
        loop = asyncio.get_running_loop()
        pump = EventPump(loop)
        pump.interval = 0.005
        wakeups = count_wakeups(loop)
        queue = asyncio.Queue()
        got = []

        def engine(start, n):  # an engine thread stepping every ~0.5 ms
            for i in range(start, start + n):
                pump.post(queue.put_nowait, i)
                time.sleep(0.0005)

        async def consume(until):
            while not got or got[-1] < until:
                got.append(await queue.get())

        t = threading.Thread(target=engine, args=(0, 60))
        t.start()
        await consume(59)
        t.join()
        # the first event woke the loop; the rest came by its timer (woken per event, 60)
        busy = len(wakeups)
        assert got == list(range(60)) and 1 <= busy <= 5
        await asyncio.sleep(0.03)  # a quiet spell: the timer found nothing and stopped
        t = threading.Thread(target=engine, args=(60, 1))
        t.start()
        await asyncio.wait_for(consume(60), 1.0)  # a lone event is not held for a timer
        t.join()
        assert got == list(range(61)) and len(wakeups) == busy + 1

    asyncio.run(main())
