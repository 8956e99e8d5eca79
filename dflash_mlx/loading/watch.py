"""A TCP connection between rank 0 and each other rank, beside ``mlx.distributed``'s collectives, so that a
rank that dies ends the job within seconds with one line that names it.

MLX's ring ``all_sum`` can block for good when a peer dies instead of failing, and so can the barrier that
ends a sharded load. A :class:`RankWatch` holds the connections for a span in which every rank must stay: a
rank whose peer goes away before that span ended on every rank (:meth:`RankWatch.close` with ``done``) logs
which rank went away and exits (1) at once; rank 0 first tells the others which one, as they hold a
connection to rank 0 only. Rank 0's address comes from ``mlx.launch`` (ring hostfile or JACCL coordinator);
without one, nothing is watched.

:func:`watch_load` starts the span of a sharded load, kept until the first generation's own watch is up
(:func:`hand_over`; a server keeps it until it stops), so that no moment from the load on is left unwatched.
"""

import json
import logging
import os
import select
import socket
import struct
import threading

import mlx.core as mx

log = logging.getLogger("dflash_mlx")
_BYE = b"\x01"  # the span ended on this rank: its connection may close
_GONE = b"\x02"  # rank 0 to the others: the rank that follows (int32) went away
_CONNECT_S = 30.0


class RankWatch:
    """The connections of one span between rank 0 and the other ranks of ``group``.

    Args:
        group: The ranks that must all stay until the span ends.
    """

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.leads = group.rank() == 0
        self.links: dict[int, socket.socket] = {}  # the peer's rank -> its connection
        self.done = False  # the span ended on every rank: a connection may close
        self.closing = False
        self.lost = threading.Event()

    def start(self) -> None:
        """Connect (one ``all_sum`` gives the others rank 0's port), then watch each connection."""
        host, server, port = _leader_host(), None, 0
        if self.leads and host is not None:
            server = socket.create_server((host, 0))
            server.settimeout(_CONNECT_S)
            port = server.getsockname()[1]
        port = mx.distributed.all_sum(mx.array([port], dtype=mx.int32), group=self.group, stream=mx.cpu).item()
        try:
            if server is not None:
                for _ in range(self.group.size() - 1):
                    link = server.accept()[0]
                    link.settimeout(_CONNECT_S)
                    self.links[_read_rank(link)] = link
                server.close()
            elif port and host is not None:
                link = socket.create_connection((host, port), timeout=_CONNECT_S)
                link.sendall(struct.pack("!i", self.group.rank()))
                self.links[0] = link
        except OSError as e:
            log.warning("No watch on the other ranks (%s).", e)
        for rank, link in self.links.items():
            link.settimeout(None)
            threading.Thread(target=self._watch, args=(rank, link), daemon=True).start()

    def _watch(self, rank: int, link: socket.socket) -> None:
        try:
            said = link.recv(1)
            gone = _read_rank(link) if said == _GONE else rank
        except OSError:
            said, gone = b"", rank
        if said == _BYE or (self.closing and said != _GONE):
            return
        self.lost.set()
        if self.leads:
            for other, peer in self.links.items():
                if other != gone:
                    try:
                        peer.sendall(_GONE + struct.pack("!i", gone))
                    except OSError:
                        pass
        log.error("Rank %d of this sharded job went away (its connection was lost): exiting.", gone)
        logging.shutdown()
        os._exit(1)

    def close(self, done: bool | None = None) -> None:
        """End the span on this rank: with ``done`` (default: :attr:`done`) the peers are told goodbye, else
        they exit. Not done, a peer already gone is named first (an error of a collective may come before
        the connection's end is read)."""
        done = self.done if done is None else done
        links = list(self.links.values())
        if not done and links:
            readable, _, _ = select.select(links, [], [], 0.5)
            if readable and self.lost.wait(2.0):
                threading.Event().wait(5.0)  # the watch is ending the process
        self.closing = True
        for link in links:
            try:
                if done:
                    link.sendall(_BYE)
                link.close()
            except OSError:
                pass
        self.links = {}


_LOAD: list[RankWatch] = []  # the watch of a sharded load, until a generation's watch is up
_KEPT: list[bool] = []  # kept until end_load_watch, across generations (a server's ranks)


def watch_load(group: mx.distributed.Group) -> None:
    """Watch the ranks from a sharded load on, until :func:`end_load_watch`: a rank that leaves before then
    (its process ended, whatever the reason) ends the others."""
    if group.size() == 1 or _LOAD:
        return
    watch = RankWatch(group)
    watch.start()
    _LOAD.append(watch)


def keep_load_watch() -> None:
    """Keep the load's watch across generations, until :func:`end_load_watch` (a server's ranks, which wait
    for requests between them: a rank that dies then is named too)."""
    _KEPT.append(True)


def hand_over() -> None:
    """A generation's own watch is up: the load's ends, unless it is kept (:func:`keep_load_watch`)."""
    if not _KEPT:
        end_load_watch()


def end_load_watch(done: bool = True) -> None:
    """The load's watch ends: a generation's own watch has taken over, or the ranks stop together (``done``);
    not ``done``, a collective failed, and a rank already gone is named (and this process ends)."""
    while _LOAD:
        _LOAD.pop().close(done=done)


def _read_rank(link: socket.socket) -> int:
    data = b""
    while len(data) < 4:
        part = link.recv(4 - len(data))
        if not part:
            raise OSError("the connection closed")
        data += part
    return struct.unpack("!i", data)[0]


def _leader_host() -> str | None:
    # Rank 0's address as mlx.launch gave it: the ring's hostfile, or JACCL's coordinator.
    try:
        if path := os.environ.get("MLX_HOSTFILE"):
            with open(path) as f:
                return json.load(f)[0][0].rpartition(":")[0] or None
        if coordinator := os.environ.get("MLX_JACCL_COORDINATOR"):
            return coordinator.rpartition(":")[0] or None
    except (OSError, ValueError, IndexError, TypeError, AttributeError):
        pass
    return None
