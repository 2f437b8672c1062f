from django.urls import path

from jobs import consumers

websocket_urlpatterns = [
    path("ws/jobs/", consumers.JobListConsumer.as_asgi()),
    path("ws/jobs/<str:job_id>/", consumers.JobConsumer.as_asgi()),
]
