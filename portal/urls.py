from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from jobs import api
from portal import views

api_v1 = [
    path("jobs/", api.JobList.as_view(), name="job-list"),
    path("jobs/<str:job_id>/", api.JobDetail.as_view(), name="job-detail"),
    *[path(f"jobs/<str:job_id>/{action}/", api.JobAction.as_view(action=action), name=f"job-{action}")
      for action in ("halt", "resume", "terminate")],
    path("jobs/<str:job_id>/events/", api.JobEvents.as_view(), name="job-events"),
    path("jobs/<str:job_id>/logs/", api.JobLogs.as_view(), name="job-logs"),
    path("jobs/<str:job_id>/metrics/", api.JobMetrics.as_view(), name="job-metrics"),
    path("jobs/<str:job_id>/artifacts/", api.JobArtifacts.as_view(), name="job-artifacts"),
    path("jobs/<str:job_id>/artifacts/<path:name>", api.JobArtifactDownload.as_view(), name="job-artifact"),
    path("tenants/current/", api.CurrentTenant.as_view(), name="tenant-current"),
    path("cluster/", api.Cluster.as_view(), name="cluster"),
    path("ingest/<str:job_id>/", api.ingest_view, name="ingest"),
]

urlpatterns = [
    path("", views.job_list, name="home"),
    path("jobs/<str:job_id>/", views.job_page, name="job-page"),
    path("login/", auth_views.LoginView.as_view(template_name="login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/", include(api_v1)),
]
