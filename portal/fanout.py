"""The channel layer behind the websockets' live updates (jobs.live, jobs.consumers): Redis pub/sub.

On pub/sub a status change reaches each web process as one message, which it hands to every socket
of its own in the group (the list-based layer queued a copy per socket in Redis and the web process
fetched them one round trip each: bench controlplane, README "Many jobs at once").

Pub/sub channels belong to the whole Redis server, not to a database number as every other key of
the platform does (cache, Celery). Platforms sharing a server on different database numbers would
see each other's live updates, the tenants and jobs of another deployment among them, so the
channel names carry the database number.
"""
from redis.connection import parse_url


def channel_layers(redis_url):
    """settings.CHANNEL_LAYERS for the Redis at `redis_url`."""
    database = parse_url(redis_url).get("db", 0)
    return {"default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
                        "CONFIG": {"hosts": [redis_url], "prefix": f"trainyard.db{database}."}}}
