"""asyncio: `await batch` on the batch's eventfd (loop.add_reader), many
batches at once without a thread each, errors raised from await, task
cancellation cancelling the batch, close() while awaited."""
import asyncio
import os
import select

import pytest

import segxfer
from conftest import cancel_while_awaited


def threads():
    return len(os.listdir("/proc/self/task"))


def test_async_await_several_batches_concurrently(pair):
    seg = pair.reader.open(pair.name)

    async def main():
        batches = [seg.read_blocks([i, 20 + i], [i, 8 + i]) for i in range(8)]
        results = await asyncio.gather(*batches)
        for b in batches:
            b.close()
        return results

    results = asyncio.run(main())
    assert [r.state for r in results] == ["COMPLETED"] * 8
    pair.expect([i for i in range(8)] + [20 + i for i in range(8)],
                [i for i in range(8)] + [8 + i for i in range(8)])
    seg.close()


def test_async_in_flight_batches_take_no_thread_and_leave_the_loop_free(stuck):
    seg, target = stuck

    async def main():
        before = threads()
        batches = [seg.read_blocks([i], [i], timeout=20) for i in range(12)]
        waits = asyncio.ensure_future(asyncio.gather(*batches))
        ticks = 0
        for _ in range(10):           # the loop runs while all 12 are in flight
            await asyncio.sleep(0.02)
            ticks += 1
        during = threads()
        assert not waits.done()
        target.resume()
        results = await asyncio.wait_for(waits, 20)
        for b in batches:
            b.close()
        return before, during, ticks, results

    before, during, ticks, results = asyncio.run(main())
    assert ticks == 10 and during == before
    assert all(r.ok for r in results)


def test_async_await_raises_the_batch_error(stuck):
    seg, _ = stuck

    async def main():
        with seg.read_blocks([1], [1], timeout=0.3) as b:
            with pytest.raises(segxfer.SX_ETIMEDOUT) as e:
                await b
            return e.value

    exc = asyncio.run(main())
    assert isinstance(exc, TimeoutError)
    assert exc.result.state == "TIMEOUT" and exc.result.failed == (0,)


def test_async_task_cancel_cancels_the_batch(stuck):
    seg, _ = stuck
    b = seg.read_blocks([2, 3], [2, 3], timeout=20)
    cancel_while_awaited(b)
    assert b.wait(5)
    assert b.result().state == "CANCELLED"
    b.close()


def test_async_close_while_awaited(stuck):
    seg, _ = stuck
    b = seg.read_blocks([2], [2], timeout=20)

    async def main():
        task = asyncio.ensure_future(b._wait_async())
        await asyncio.sleep(0.05)
        b.close()    # cancels, waits for the end, destroys; the await sees it
        with pytest.raises(segxfer.SX_ECANCELED) as e:
            await asyncio.wait_for(task, 5)
        return e.value

    exc = asyncio.run(main())
    assert exc.result.state == "CANCELLED"
    assert b.result().state == "CANCELLED"    # kept past destroy


def test_async_fileno_turns_readable_at_the_end(pair):
    with pair.reader.open(pair.name) as seg:
        with seg.batch() as b:
            b.add_block_ids([1, 2], [1, 2])
            fd = b.fileno()
            assert select.select([fd], [], [], 0)[0] == []
            b.submit()
            assert select.select([fd], [], [], 10)[0] == [fd]
            assert b.done() and b.result().ok
        # Awaiting an ended batch returns at once.
        with seg.read_blocks([3], [3]) as b2:
            b2.wait()
            assert asyncio.run(b2._wait_async()).ok
