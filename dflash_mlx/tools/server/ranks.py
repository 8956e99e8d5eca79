"""dflash-serve on a target sharded over several ranks: rank 0 serves HTTP, the others follow.

Under ``mlx.launch`` every rank loads the pair. Rank 0 runs the server; before each request it
sends the others the request's generation settings (:meth:`Ranks.announce`), and every rank
then runs the same generation, rank 0 deciding each cycle (:mod:`dflash_mlx.loop.distributed`). A
request cut short (a client gone, a stop string) stops every rank after the cycle in flight.
On shutdown rank 0 tells the others to exit (:meth:`Ranks.shut_down`). A rank that dies breaks
the next collective of the others: a follower's error ends its process, and rank 0 exits
non-zero (:meth:`Ranks.abort`) rather than serve from ranks out of step. An idle rank 0 sends an
empty message every few seconds, so that a dead rank is found while no request runs.
"""

import json
import logging
import os

import mlx.core as mx

from ...base.errors import DFlashError
from ...loading.watch import end_load_watch
from ...tuning.policy import PolicyState
from ..session import Session
from .worker import PromptCaches, generate_for

log = logging.getLogger("dflash-serve")

_SHUT_DOWN = -1


class Ranks:
    """Rank 0's side: what it tells the other ranks."""

    HEARTBEAT = 5.0  # seconds idle between empty messages

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def announce(self, generation: dict) -> None:
        _send(self.group, json.dumps(generation).encode())

    def heartbeat(self) -> None:
        """An empty message: where a rank died, the collective fails and this rank exits."""
        try:
            _send(self.group, b"")
        except RuntimeError:
            end_load_watch(done=False)  # a rank that is gone is named (and this process ends)
            self.abort()

    def shut_down(self) -> None:
        end_load_watch()  # the ranks stop together, though no request came
        _send(self.group, None)

    def abort(self) -> None:
        log.error("a generation failed on a sharded target: exiting, as the other ranks may be out of step")
        logging.shutdown()
        os._exit(1)


def follow(model, draft, tokenizer, *, prompt_cache_size: int = 4, prefill_step_size: int = 512) -> None:
    """A rank other than 0: run each generation rank 0 announces, until it says to stop."""
    group = mx.distributed.init()
    session = Session(model, draft, tokenizer)  # no datastore: only rank 0 drafts
    caches = PromptCaches(session, prompt_cache_size)  # taken in the same order as rank 0's
    policy = PolicyState()
    while (message := _receive(group)) is not None:
        if not message:
            continue  # rank 0's heartbeat
        generation = json.loads(message)
        responses = generate_for(session, generation, prompt_cache=caches.take(generation["ids"]),
                                 policy=policy, prefill_step_size=prefill_step_size)  # fmt: skip
        try:
            for _ in responses:
                pass
        except DFlashError as e:  # refused as on rank 0, before any pass: the next request
            log.info("request refused: %s", e)
    end_load_watch()


def _send(group: mx.distributed.Group, payload: bytes | None) -> None:
    size = _SHUT_DOWN if payload is None else len(payload)
    mx.eval(mx.distributed.all_sum(mx.array([size], dtype=mx.int32), group=group, stream=mx.cpu))
    if payload:
        data = mx.array(list(payload), dtype=mx.int32)
        mx.eval(mx.distributed.all_sum(data, group=group, stream=mx.cpu))


def _receive(group: mx.distributed.Group) -> bytes | None:
    size = mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=group, stream=mx.cpu).item()
    if size == _SHUT_DOWN:
        return None
    if size == 0:
        return b""
    data = mx.distributed.all_sum(mx.zeros((size,), dtype=mx.int32), group=group, stream=mx.cpu)
    return bytes(data.tolist())
