"""The round channel's Ray side: a worker opens its server (its own threads); a caller links to it.

    worker (a ChannelHost):   `channel()` -> its Endpoint (the server opened on the first call)
    caller (any thread):      link = link_to(lambda: ray.get(actor.channel.remote())); link.call("verify", batch)

(specserve_types/round_channel.py holds the transport itself, free of Ray.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import ray

from specserve_types.round_channel import ChannelServer, Endpoint, FrameReader, Handler
from specserve_types.round_channel_client import ChannelLink


def this_node() -> str:
    return ray.get_runtime_context().get_node_id()


def open_server(handlers: Mapping[str, Handler], name: str, reader: FrameReader | None = None) -> ChannelServer:
    """A listening server for `handlers` on this node's address (and an abstract Unix socket); `reader`: the
    thread that reads its connections (None: a thread per connection)."""
    server = ChannelServer(handlers, this_node(), ray.util.get_node_ip_address(), name, reader)
    server.start()
    return server


def link_to(resolve: Callable[[], Endpoint]) -> ChannelLink:
    return ChannelLink(resolve, this_node())


class ChannelHost:
    """A Ray worker (Serve replica or actor) that also serves `channel_handlers()` (blocking callables) on a
    round channel, opened on the first `channel()` call."""

    _channel_server: ChannelServer | None = None

    def channel_handlers(self) -> Mapping[str, Handler]:
        raise NotImplementedError

    def channel_reader(self) -> FrameReader | None:
        """The thread that reads the channel's connections (a worker's ComputeThread); None: their own threads."""
        return None

    async def channel(self) -> Endpoint:
        if self._channel_server is None:  # no await before the assignment: one server per worker
            self._channel_server = open_server(self.channel_handlers(), type(self).__name__.lower(),
                                               self.channel_reader())
        return self._channel_server.start()
