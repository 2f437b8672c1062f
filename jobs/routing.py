from django.urls import path, re_path

from jobs import consumers

websocket_urlpatterns = [
    path("ws/jobs/", consumers.JobListConsumer.as_asgi()),
    # A job id holds no NUL (PostgreSQL stores none): such a path matches no route and is refused.
    re_path(r"^ws/jobs/(?P<job_id>[^/\x00]+)/$", consumers.JobConsumer.as_asgi()),
]
