"""The channel layer behind the websockets' live updates (jobs.live, jobs.consumers): Redis pub/sub.

On pub/sub a status change reaches each web process as one message, which it hands to every socket
of its own in the group (the list-based layer queues a copy per socket in Redis).

Pub/sub channels belong to the whole Redis server, not to a database number as every other key of
the platform does (cache, Celery). Platforms sharing a server on different database numbers would
see each other's live updates, the tenants and jobs of another deployment among them, so the
channel names carry the database number (the layer's `prefix` option).
"""
import asyncio
import weakref

from channels_redis.pubsub import RedisPubSubChannelLayer
from redis.connection import parse_url

LISTENING = "listening."  # the prefix of each event loop's channel that nobody publishes on


def channel_layers(redis_url):
    """settings.CHANNEL_LAYERS for the Redis at `redis_url`."""
    database = parse_url(redis_url).get("db", 0)
    return {"default": {"BACKEND": "portal.fanout.PubSubLayer",
                        "CONFIG": {"hosts": [redis_url], "prefix": f"trainyard.db{database}."}}}


class PubSubLayer:
    """channels_redis' pub/sub layer (RedisPubSubChannelLayer, through its public methods only), whose
    connection in each event loop stays subscribed from the first socket on.

    The library's receive loop reads its connection only while it holds a subscription, and sleeps
    between looks while it holds none; a web process whose last socket had closed (a script's
    Client.wait is often its only one) made the next socket's first changes wait out such a sleep.
    Here each event loop also opens a channel nobody publishes on, before its first socket's, and
    never receives on it, so it is never unsubscribed and the loop keeps reading.
    """

    def __init__(self, **config):
        self.layer = RedisPubSubChannelLayer(**config)
        self.listening = weakref.WeakKeyDictionary()  # event loop -> its listening channel

    async def new_channel(self, prefix="specific."):
        await self.listen()
        return await self.layer.new_channel(prefix)

    async def listen(self):
        """Subscribe this event loop's connection to its listening channel, once."""
        loop = asyncio.get_running_loop()
        if loop not in self.listening:
            self.listening[loop] = None  # claimed before the await: one channel per loop
            try:
                self.listening[loop] = await self.layer.new_channel(LISTENING)
            except BaseException:
                del self.listening[loop]
                raise

    async def flush(self):
        # Flushing drops every subscription of this loop's connection, the listening one too.
        self.listening.pop(asyncio.get_running_loop(), None)
        await self.layer.flush()

    def __getattr__(self, name):  # send, receive, group_add, group_discard, group_send, extensions...
        if name == "layer":  # not yet set (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)
