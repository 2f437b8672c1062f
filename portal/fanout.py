"""The channel layer behind the websockets' live updates (jobs.live, jobs.consumers): Redis pub/sub.

On pub/sub a status change reaches each web process as one message, which it hands to every socket
of its own in the group (the list-based layer queued a copy per socket in Redis and the web process
fetched them one round trip each: bench controlplane).

Pub/sub channels belong to the whole Redis server, not to a database number as every other key of
the platform does (cache, Celery). Platforms sharing a server on different database numbers would
see each other's live updates, the tenants and jobs of another deployment among them, so the
channel names carry the database number.
"""
from channels_redis import pubsub
from redis.connection import parse_url

LISTENING = "listening"  # the channel each connection stays subscribed to (nothing is published on it)


def channel_layers(redis_url):
    """settings.CHANNEL_LAYERS for the Redis at `redis_url`."""
    database = parse_url(redis_url).get("db", 0)
    return {"default": {"BACKEND": "portal.fanout.PubSubLayer",
                        "CONFIG": {"hosts": [redis_url], "prefix": f"trainyard.db{database}."}}}


class PubSubLayer(pubsub.RedisPubSubChannelLayer):
    """channels_redis' pub/sub layer, whose connections listen from their first subscription on.

    Its receive loop reads the connection only while it holds a subscription; with none it sleeps
    0.1 s at a time. A web process with no socket open (a script's Client.wait is often its only
    one) had no subscription between jobs, so the socket a script opened subscribed during such a
    sleep and its job's changes waited there for the rest of it: 20-50 ms of every short job's end as
    its script saw it (bench frameworks' timeline, "COMPLETED → the client knows"). Here each
    connection also subscribes to a channel nobody publishes on, before its receive loop starts,
    and never leaves it, so the loop is always reading and a change is handed on as it arrives.
    """

    def _get_layer(self):
        layer = super()._get_layer()
        if not isinstance(layer._shards[0], ListeningShard):  # made just now, for this event loop
            layer._shards = [ListeningShard(shard.host, layer) for shard in layer._shards]
        return layer


class ListeningShard(pubsub.RedisSingleShardConnection):
    """One Redis connection of PubSubLayer: subscribed to its LISTENING channel from the first
    subscription on, which it never leaves."""

    @property
    def listening(self):
        return self.channel_layer.prefix + LISTENING

    async def subscribe(self, channel):
        async with self._lock:
            if channel in self._subscribed_to:
                return
            self._ensure_redis()
            for name in ([self.listening] if self.listening not in self._subscribed_to else []) + [channel]:
                await self._pubsub.subscribe(name)
                self._subscribed_to.add(name)
            # Started only now (the library starts it before subscribing): its first look finds a
            # subscription, so it reads at once instead of sleeping first.
            self._ensure_receiver()

    async def unsubscribe(self, channel):
        if channel != self.listening:
            await super().unsubscribe(channel)
